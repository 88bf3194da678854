"""python -m frontend: the OpenAI-compatible HTTP server.

    python -m frontend --host 127.0.0.1 --port 8000 --engine tcp://127.0.0.1:5557 \\
        --tokenizer tcp://127.0.0.1:5558
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING, Optional, Sequence

from common.config import (DEFAULT_ENGINE_ADDRESS, DEFAULT_TOKENIZER_ADDRESS,
                           ROUTING_POLICIES, FrontendConfig, env_default)
from common.curve import CurveKey, add_curve_args
from common.errors import ModelLoadError
from common.logging_setup import setup_logging
from common.tokenizer import add_chat_template_arg
from frontend.reasoning import PARSERS

if TYPE_CHECKING:
    from frontend.app import ModelParts

logger = logging.getLogger("frontend")


def add_frontend_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("frontend")
    g.add_argument("--host", default=env_default("HOST", "127.0.0.1"),
                   help="address to listen on (default: loopback only)")
    g.add_argument("--port", type=int, default=int(env_default("PORT", "8000")))
    g.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require this Bearer key on every path but /health, /metrics and "
                        "/version (repeat for several keys, any of which is taken); "
                        "visible to other local users in the process list: prefer "
                        "ROSESERVE_API_KEY (keys separated by commas) or --api-key-file")
    g.add_argument("--api-key-file", default=None,
                   help="read the Bearer keys from this file (one a line)")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model names clients may send, the first one listed first "
                        "(default: the model's folder name)")
    g.add_argument("--max-body-bytes", type=int, default=8 << 20)
    g.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="engine requests (n x prompts) admitted and not yet producing "
                        "tokens before 429")
    g.add_argument("--max-waiting-tokens", type=int, default=2_000_000,
                   help="their prompt tokens (estimated for text) before 429")
    g.add_argument("--max-choices-per-request", type=int, default=256,
                   help="most engine requests (n x prompts) in one HTTP request")
    g.add_argument("--tokenize-timeout", type=float, default=60.0,
                   help="seconds before a tokenization that has not finished ends in 504")
    g.add_argument("--request-timeout", type=float, default=None,
                   help="seconds before an unfinished request ends in 504 and is aborted "
                        "(default: no limit)")
    g.add_argument("--routing", choices=ROUTING_POLICIES, default="prefix",
                   help="how requests are spread over engines")
    g.add_argument("--disagg-min-prompt-tokens", type=int, default=256,
                   help="with prefill and decode engines: prompts whose blocks the decode "
                        "engine lacks come to fewer tokens than this skip the prefill "
                        "engine (default 256; 0: every prompt goes to one)")
    g.add_argument("--kv-lease", type=float, default=30.0,
                   help="seconds a prefill engine keeps a prompt's KV blocks for the "
                        "decode engine to pull (default 30)")
    g.add_argument("--dns-refresh", type=float, default=5.0,
                   help="seconds between lookups of engine addresses given by DNS name "
                        "(tcp://tasks.engine:5557: every address the name resolves to)")
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds the requests in flight (streams included) get "
                        "to finish; new connections are refused at once (default 30)")
    g.add_argument("--stream-interval", type=int, default=1,
                   help="send a stream's tokens this many at a time, from the engine and "
                        "to the client (its first token and its end at once): fewer messages "
                        "per token, chunkier streams (default 1)")
    add_chat_template_arg(g)
    g.add_argument("--reasoning-parser", choices=sorted(PARSERS),
                   default=env_default("REASONING_PARSER"),
                   help="a reasoning model's thinking (between <think> and </think>) goes to "
                        "reasoning_content, its answer to content: deepseek_r1 (DeepSeek-R1 "
                        "and its distillations, QwQ), qwen3, or gpt_oss (harmony's channels; "
                        "the default for a model whose chat template writes harmony; "
                        "otherwise none, all content; ROSESERVE_REASONING_PARSER)")
    g.add_argument("--generation-config", choices=["auto", "none"], default="auto",
                   help="auto: requests that do not set temperature, top_p, top_k, min_p or "
                        "repetition_penalty get the model's generation_config.json values "
                        "(its makers' recommendation, as vLLM applies them); none: "
                        "OpenAI's defaults (temperature 1, top_p 1)")
    g.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs name each token 'token_id:N' instead of by its text, for "
                        "clients that must tell apart tokens holding part of a character "
                        "(a request's return_tokens_as_token_ids overrides it)")
    g.add_argument("--otlp-traces-endpoint", default=env_default("OTLP_TRACES_ENDPOINT"),
                   metavar="URL",
                   help="send a span per request to this OpenTelemetry collector over "
                        "OTLP/HTTP (e.g. http://collector:4318/v1/traces; needs "
                        "'roseserve[tracing]'); a request's traceparent header makes it "
                        "part of the caller's trace (ROSESERVE_OTLP_TRACES_ENDPOINT)")
    g.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                   help="web pages from these origins (https://ui.example.com; * for any) "
                        "may call the API from a browser: CORS, preflights answered "
                        "before the API key is asked for (default: none)")
    g.add_argument("--ssl-certfile", default=None,
                   help="serve HTTPS with this certificate (PEM, the chain after it)")
    g.add_argument("--ssl-keyfile", default=None, help="its private key (PEM)")
    g.add_argument("--no-access-log", action="store_true",
                   help="no log line per request (by default each ends in one: method, "
                        "path, status, time, X-Request-Id; for a completion its id, tokens, "
                        "finish reasons, time to first token and engine)")
    g.add_argument("--request-retries", type=int, default=2,
                   help="times a request is sent to another engine when its engine refused "
                        "it (draining) or failed: whole before any output, else continuing "
                        "after the tokens sent (default 2; 0: never)")
    g.add_argument("--failover-timeout", type=float, default=30.0,
                   help="seconds a request whose engine failed mid-stream waits for an "
                        "engine to continue it on (the only engine's restart) before its "
                        "stream ends with an error (default 30)")


def api_keys_from_args(args: argparse.Namespace) -> tuple[str, ...]:
    """--api-key (each), else --api-key-file's lines, else ROSESERVE_API_KEY's
    comma-separated keys; none: no authentication."""
    if args.api_key:
        return tuple(args.api_key)
    if args.api_key_file:
        try:
            with open(args.api_key_file) as f:
                keys = tuple(line.strip() for line in f if line.strip())
        except OSError as e:
            raise ValueError(f"cannot read --api-key-file: {e}") from None
        if not keys:
            raise ValueError(f"--api-key-file {args.api_key_file} is empty")
        return keys
    return tuple(k.strip() for k in (env_default("API_KEY") or "").split(",") if k.strip())


def frontend_config_from_args(args: argparse.Namespace, engines: Sequence[str],
                              tokenizer: str) -> FrontendConfig:
    return FrontendConfig(
        host=args.host, port=args.port, engine_addresses=tuple(engines),
        tokenizer_address=tokenizer, model=args.model,
        served_model_names=tuple(args.served_model_name or ()),
        api_keys=api_keys_from_args(args), max_body_bytes=args.max_body_bytes,
        max_waiting_requests=args.max_waiting_requests,
        max_waiting_tokens=args.max_waiting_tokens,
        max_choices_per_request=args.max_choices_per_request,
        tokenize_timeout_s=args.tokenize_timeout, request_timeout_s=args.request_timeout,
        routing=args.routing, request_retries=args.request_retries,
        failover_timeout_s=args.failover_timeout,
        dns_refresh_s=args.dns_refresh, disagg_min_prompt_tokens=args.disagg_min_prompt_tokens,
        kv_lease_s=args.kv_lease, stream_interval=args.stream_interval,
        drain_timeout_s=args.drain_timeout, access_log=not args.no_access_log,
        reasoning_parser=args.reasoning_parser, chat_template=args.chat_template,
        generation_config=args.generation_config,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        otlp_traces_endpoint=args.otlp_traces_endpoint or None,
        allowed_origins=tuple(args.allowed_origins or ()),
        ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile,
        curve_key=CurveKey.from_option(getattr(args, "curve_key_file", None)))


def serve(config: FrontendConfig, log_level: Optional[str] = None,
          parts: Optional[ModelParts] = None) -> None:
    import uvicorn

    from frontend.app import create_app
    from frontend.http_server import Server

    server = Server(uvicorn.Config(
        create_app(config, parts), host=config.host, port=config.port,
        log_level=(log_level or "info").lower(), access_log=False,
        timeout_graceful_shutdown=config.drain_timeout_s,
        ssl_certfile=config.ssl_certfile, ssl_keyfile=config.ssl_keyfile))
    server.run()
    if not server.started:
        sys.exit(3)  # uvicorn's exit status when it cannot start (the port taken, say)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m frontend", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=env_default("MODEL"),
                        help="model directory or GGUF file, for its tokenizer (default: "
                             "SmolLM2-135M-Instruct)")
    parser.add_argument("--engine", action="append", default=None,
                        help="engine worker address (repeat for several engines); "
                             "tcp://NAME:PORT with a DNS name stands for every address NAME "
                             "resolves to, looked up again every --dns-refresh seconds")
    parser.add_argument("--tokenizer", default=env_default("TOKENIZER_ADDRESS",
                                                           DEFAULT_TOKENIZER_ADDRESS),
                        help="tokenizer pool address")
    add_curve_args(parser, binds=False)
    add_frontend_args(parser)
    parser.add_argument("--log-level", default=None)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging("frontend", args.log_level)
    engines = args.engine or [a for a in (env_default("ENGINE_ADDRESS") or
                                          DEFAULT_ENGINE_ADDRESS).split(",") if a]
    try:
        config = frontend_config_from_args(args, engines, args.tokenizer)
    except ValueError as e:
        parser.error(str(e))
    from frontend.app import load_model_parts   # (not for --help, nor for roseserve's flags)

    try:   # before the server: its start-up would fail with a traceback
        parts = load_model_parts(config)
        if config.otlp_traces_endpoint:
            from frontend import tracing

            tracing.require()
    except (ModelLoadError, ValueError) as e:
        logger.error("cannot start the frontend: %s", e)
        return 2
    if config.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("listening on %s: reachable beyond this host, as asked", config.host)
    serve(config, args.log_level, parts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
