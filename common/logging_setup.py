"""One logging setup per process."""

from __future__ import annotations

import logging
from typing import Optional

from common.config import env_default


def setup_logging(process_name: str, level: Optional[str] = None) -> None:
    level_name = (level or env_default("LOG_LEVEL", "INFO") or "INFO").upper()
    logging.basicConfig(
        level=level_name,
        format=f"%(asctime)s %(levelname)s {process_name} %(name)s: %(message)s",
    )
