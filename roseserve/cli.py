"""``roseserve``: the command-line entry point."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Optional, Sequence

from common.config import CacheConfig, EngineConfig, env_default
from common.errors import ModelLoadError
from common.logging_setup import setup_logging


def _generate(args: argparse.Namespace) -> int:
    """A generation demo on the in-process engine: chat prompt in, text out."""
    from transformers import AutoTokenizer

    from common.model_files import resolve_model_dir
    from common.protocol import SamplingParams
    from engine_worker.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=args.model, device=args.device,
                                    num_threads=args.threads,
                                    cache=CacheConfig(enable_prefix_caching=True)))
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir(args.model)))
    prompts = args.prompt or ["What is the capital of France?",
                              "Write a haiku about the sea."]
    token_ids = []
    for prompt in prompts:
        if tokenizer.chat_template:
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                 add_generation_prompt=True, tokenize=False)
            token_ids.append(tokenizer.encode(text, add_special_tokens=False))
        else:
            token_ids.append(tokenizer.encode(prompt))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            seed=args.seed)
    start = time.perf_counter()
    outputs = engine.generate(token_ids, params)
    elapsed = time.perf_counter() - start
    for prompt, output in zip(prompts, outputs):
        print(f"> {prompt}\n{tokenizer.decode(output, skip_special_tokens=True).strip()}\n")
    total = sum(len(o) for o in outputs)
    print(f"[{engine.model_name}: {total} tokens in {elapsed:.2f} s, "
          f"{total / elapsed:.1f} tokens/s]")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from engine_worker.__main__ import engine_config_from_args
    from frontend.__main__ import frontend_config_from_args
    from roseserve.launcher import serve

    try:  # refuse bad flags here, before any process starts
        if args.prefill_engines or args.decode_engines:
            if args.prefill_engines < 1 or args.decode_engines < 1:
                raise ValueError("--prefill-engines and --decode-engines go together, each "
                                 "at least 1")
            if args.engines is not None:
                raise ValueError("--engines runs mixed engines; give it or --prefill-engines "
                                 "and --decode-engines, not both")
        elif args.engines is not None and args.engines < 1:
            raise ValueError(f"--engines must be at least 1, got {args.engines}")
        if args.frontends < 1:
            raise ValueError(f"--frontends must be at least 1, got {args.frontends}")
        if args.tokenizer_workers is not None and args.tokenizer_workers < 1:
            raise ValueError(f"--tokenizer-workers must be at least 1, got "
                             f"{args.tokenizer_workers} (default: half the cores)")
        if args.kv_store and args.kv_store_address:
            raise ValueError("--kv-store runs a KV store here; --kv-store-address names "
                             "another: give one or the other")
        if not args.kv_store_memory * 2**30 >= 1:
            raise ValueError(f"--kv-store-memory must be positive, got {args.kv_store_memory}")
        engine_config_from_args(args)
        frontend_config_from_args(args, ["ipc://check"], "ipc://check")
    except ValueError as e:
        print(f"roseserve serve: {e}", file=sys.stderr)
        return 2
    return serve(args)


def _keygen(args: argparse.Namespace) -> int:
    """Write a cluster CURVE key for the internal sockets (common/curve.py)."""
    import os

    from common.curve import CurveKey, create_key_file

    if os.path.exists(args.file):
        if not args.if_missing:
            print(f"roseserve keygen: {args.file} exists; not overwriting it", file=sys.stderr)
            return 1
        try:
            CurveKey.load(args.file)
        except ValueError as e:
            print(f"roseserve keygen: {e}", file=sys.stderr)
            return 1
        print(f"{args.file} holds a cluster key already")
        return 0
    key = create_key_file(args.file)
    print(f"wrote the cluster key {args.file} (public key {key.public.decode()}); give it "
          f"to every engine, tokenizer pool and frontend as --curve-key-file")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from engine_worker.__main__ import add_engine_args
    from frontend.__main__ import add_frontend_args

    parser = argparse.ArgumentParser(prog="roseserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    srv = sub.add_parser("serve", help="run the whole stack: engine, tokenizer pool, frontend")
    add_engine_args(srv)
    add_frontend_args(srv)
    srv.add_argument("--engines", type=int, default=None,
                     help="engine worker processes (default 1); the frontend spreads "
                          "requests over them by prefix")
    srv.add_argument("--prefill-engines", type=int, default=0,
                     help="prefill/decode disaggregation: engines that compute prompts "
                          "(with --decode-engines, instead of --engines)")
    srv.add_argument("--decode-engines", type=int, default=0,
                     help="engines that decode, pulling each prompt's KV blocks from a "
                          "prefill engine")
    srv.add_argument("--frontends", type=int, default=1,
                     help="frontend processes (default 1), on consecutive ports from --port, "
                          "for a load balancer in front of them")
    srv.add_argument("--tokenizer-workers", type=int, default=None,
                     help="tokenizer processes (default: half the cores, at least 1)")
    srv.add_argument("--kv-store", action="store_true",
                     help="run a shared KV store (python -m kv_store) beside the engines: "
                          "each puts the blocks it evicts or its requests leave there and "
                          "pulls a prompt's blocks it lacks from there, so that a prefix "
                          "computed on one engine serves them all, restarts included")
    srv.add_argument("--kv-store-memory", type=float, default=4.0, metavar="GIB",
                     help="the KV store's memory (default 4)")
    srv.add_argument("--kv-store-dir", default=None, metavar="DIR",
                     help="where the KV store spills what memory does not hold")
    srv.add_argument("--log-level", default=None)
    srv.set_defaults(func=_serve)
    gen = sub.add_parser("generate", help="generate from prompts with the in-process engine")
    gen.add_argument("--model", default=env_default("MODEL"),
                     help="Hugging Face model directory, or a GGUF file (served as it is "
                        "on the CPU kernels; default: SmolLM2-135M-Instruct)")
    gen.add_argument("--device", default=env_default("DEVICE", "auto"))
    gen.add_argument("--threads", type=int, default=None, help="CPU threads for matmuls")
    gen.add_argument("--prompt", action="append", help="a user message (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.set_defaults(func=_generate)
    key = sub.add_parser("keygen", help="write a CURVE key for the cluster's internal sockets")
    key.add_argument("file", help="where to write it (a ZeroMQ secret certificate)")
    key.add_argument("--if-missing", action="store_true",
                     help="leave an existing key file as it is (exit 0)")
    key.set_defaults(func=_keygen)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    setup_logging("roseserve")
    try:
        code = args.func(args)
    except ModelLoadError as e:   # a model that is not there, or not one we serve
        print(f"roseserve {args.command}: {e}", file=sys.stderr)
        code = 2
    sys.exit(code)
