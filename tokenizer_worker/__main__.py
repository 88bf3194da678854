"""python -m tokenizer_worker: run the tokenizer pool (a supervisor and N workers).

    python -m tokenizer_worker --model DIR --workers 2 --bind tcp://127.0.0.1:5558
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional, Sequence

from common import faults
from common.config import DEFAULT_MAX_FRAME_BYTES, DEFAULT_TOKENIZER_ADDRESS, env_default
from common.curve import add_curve_args, key_for_bind
from common.errors import ModelLoadError
from common.logging_setup import setup_logging
from common.model_files import resolve_model_dir
from common.sockets import is_loopback
from common.tokenizer import (MAX_CHARS_PER_TOKEN, add_chat_template_arg, context_length,
                              load_decoder, read_chat_template)
from tokenizer_worker.pool import DEFAULT_JOB_TIMEOUT_S, TokenizerPool, default_num_workers

logger = logging.getLogger("tokenizer_worker")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tokenizer_worker", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=env_default("MODEL"),
                        help="Hugging Face model directory, or a GGUF file (served as it is "
                        "on the CPU kernels; default: SmolLM2-135M-Instruct)")
    parser.add_argument("--workers", type=int,
                        default=int(env_default("TOKENIZER_WORKERS") or default_num_workers()),
                        help="worker processes (default: half the cores, at least 1)")
    parser.add_argument("--bind", default=env_default("TOKENIZER_ADDRESS",
                                                      DEFAULT_TOKENIZER_ADDRESS))
    parser.add_argument("--max-prompt-chars", type=int, default=None,
                        help=f"refuse longer text before encoding (default: "
                             f"{MAX_CHARS_PER_TOKEN} x the model's context length)")
    parser.add_argument("--job-timeout", type=float, default=DEFAULT_JOB_TIMEOUT_S,
                        help="a worker holding a job this many seconds is presumed hung and "
                             "replaced")
    add_chat_template_arg(parser)
    parser.add_argument("--max-frame-bytes", type=int, default=DEFAULT_MAX_FRAME_BYTES,
                        help="a client sending a larger frame is disconnected")
    add_curve_args(parser, binds=True)
    parser.add_argument("--log-level", default=None)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging("tokenizer", args.log_level)
    if args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    try:
        curve_key = key_for_bind(args.bind, args.curve_key_file, args.insecure_no_curve)
    except ValueError as e:
        parser.error(str(e))
    if not is_loopback(args.bind):
        logger.warning("binding %s: reachable beyond this host, as asked (%s)", args.bind,
                       "clients must hold the cluster's CURVE key" if curve_key
                       else "WITHOUT authentication")
    try:
        model_dir = resolve_model_dir(args.model)
        # A quick check (the Rust tokenizer alone), not transformers' tokenizer: loading
        # that takes 1-3 s, which each worker spends anyway, and here it delayed the
        # workers' start by as much. A worker that cannot load it stops the pool with
        # its error (pool.py).
        load_decoder(model_dir)
        chat_template = read_chat_template(args.chat_template) if args.chat_template else None
        max_chars = args.max_prompt_chars or MAX_CHARS_PER_TOKEN * context_length(model_dir)
    except ModelLoadError as e:
        logger.error("cannot start the tokenizer pool: %s", e)
        return 2
    try:
        pool = TokenizerPool(model_dir, args.workers, args.bind, max_chars,
                             logging.getLevelName(logging.getLogger().level),
                             job_timeout_s=args.job_timeout, max_frame_bytes=args.max_frame_bytes,
                             curve_key=curve_key, chat_template=chat_template)
    except ValueError as e:
        parser.error(str(e))
    except Exception as e:  # zmq.ZMQError: address in use, bad address
        logger.error("cannot bind %s: %s", args.bind, e)
        return 2
    faults.install("tokenizer_pool", pool)
    logger.info("tokenizer pool: %d worker(s) for %s on %s", args.workers, model_dir, args.bind)
    return pool.serve()   # 2 if its workers cannot load the tokenizer


if __name__ == "__main__":
    sys.exit(main())
