"""Two streaming-benchmark reports side by side, with ratios.

    python benchmarks/compare.py before.json after.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROWS = [  # (label, key, unit)
    ("Submit wall", "submit_wall_s", "s"),
    ("add_request latency", "add_request_ms", "ms"),
    ("Client queue wait", "client_queue_ms", "ms"),
    ("Tokenize", "tokenize_ms", "ms"),
    ("Queue wait", "queue_ms", "ms"),
    ("Prefill->first token", "prefill_ms", "ms"),
    ("TTFT", "ttft_ms", "ms"),
    ("TPOT", "tpot_ms", "ms/token"),
    ("ITL", "itl_ms", "ms"),
    ("Latency", "latency_ms", "ms"),
    ("Throughput (completion)", "throughput_completion", "tokens/s"),
    ("Throughput (total)", "throughput_total", "tokens/s"),
    ("Failed requests", "num_failed", ""),
]
QUANTILES = ("p50", "p95", "p99")


def fmt(value) -> str:
    if value is None:
        return "n/a"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def ratio(a, b) -> str:
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or not a:
        return ""
    return f"{b / a:.2f}x"


def compare(a: dict, b: dict) -> list[str]:
    name_a, name_b = a.get("label") or "A", b.get("label") or "B"
    lines = [f"{'':<34}{name_a:>14}{name_b:>14}{'B/A':>9}"]
    for key in ("model", "pretok", "num_requests", "prompt_tokens", "completion_tokens"):
        lines.append(f"{key:<34}{fmt(a.get(key)):>14}{fmt(b.get(key)):>14}")
    for label, key, unit in ROWS:
        va, vb = a.get(key), b.get(key)
        if isinstance(va, list):
            for q, x, y in zip(QUANTILES, va, vb or [None] * 3):
                lines.append(f"{label + ' ' + q + ' (' + unit + ')':<34}{fmt(x):>14}"
                             f"{fmt(y):>14}{ratio(x, y):>9}")
        else:
            title = f"{label} ({unit})" if unit else label
            lines.append(f"{title:<34}{fmt(va):>14}{fmt(vb):>14}{ratio(va, vb):>9}")
    return lines


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    a, b = (json.loads(Path(p).read_text()) for p in args)
    print("\n".join(compare(a, b)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
