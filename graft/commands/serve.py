"""`graft serve`: a graft-configured vLLM (or SGLang) server in the foreground, stopped with the command."""

from __future__ import annotations

import argparse
import signal
import sys

from graft.config.arguments import COUNT, PORT


def add_command(sub) -> None:
    p = sub.add_parser("serve", help="run a graft-configured vLLM (or SGLang) server in the foreground",
                       description="Start vLLM (python -m vllm.entrypoints.openai.api_server) with LoRA and runtime "
                                   "adapter loading (sync.mode adapter), on loopback by default; --weight-reload "
                                   "adds the dev endpoints sync.mode merged needs. vLLM serves bf16 for --dtype "
                                   "auto even for an fp32 checkpoint: a run with model.dtype float32 needs "
                                   "--dtype float32.")
    p.add_argument("model", help="HF model directory, a packaged model's name (smollm2, see `graft model`), a "
                   ".gguf file, or a hub id already in the local Hugging Face cache")
    p.add_argument("--engine", choices=["vllm", "sglang"], default="vllm",
                   help="vllm (default), or sglang: EXPERIMENTAL, from the virtualenv `make sglang-venv` builds, "
                        "loopback only, no API key (see docs/sglang-cpu.md)")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    p.add_argument("--port", type=PORT, default=None, help="port (default: a free one)")
    p.add_argument("--max-lora-rank", type=COUNT, default=16, help="one of 1, 8, 16, 32, 64, 128, 256, 320, 512")
    p.add_argument("--max-loras", type=COUNT, default=4, help="adapters held at once (default 4)")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto")
    p.add_argument("--max-model-len", type=COUNT, default=2048, help="prompt + completion tokens (default 2048)")
    p.add_argument("--log-dir", default="runs/serve/logs", help="where vllm-<port>.log (sglang-<port>.log) goes")
    p.add_argument("--weight-reload", action=argparse.BooleanOptionalAction, default=False,
                   help="serve vLLM's dev endpoints (/pause, /collective_rpc, ...), which sync.mode merged needs; "
                        "vLLM never authenticates them, not even with an API key (default: off)")
    p.add_argument("--api-key-env", metavar="NAME", default=None,
                   help="require the API key held in environment variable NAME on /v1 requests (default: "
                        "$VLLM_API_KEY if set, else no key)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from rich.console import Console

    from graft.rollout.engine import EngineUnavailableError

    server = _serve_server(args)
    name = server.ENGINE_NAME
    # Ctrl-C and SIGTERM (see `main`) both unwind through the `finally` below, so the server never
    # outlives us (a background job inherits SIGINT ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    took = "~15-40 s" if args.engine == "vllm" else "~1-3 min"
    with Console(stderr=True).status(f"starting {name} for {args.model} (takes {took} on CPU)"):
        server.start()
    try:
        # Plain prints: rich would wrap these lines at 80 columns when stderr is not a terminal.
        print(_serving_lines(args, server), file=sys.stderr, flush=True)
        code = server.wait()
    finally:
        server.stop()
    if code:
        raise EngineUnavailableError(f"{name} exited with code {code}; see {server.log_path}", address=server.url)


def _serve_server(args: argparse.Namespace):
    """The (not yet started) server `graft serve` runs: vLLM, or SGLang from its own virtualenv."""
    from graft.models.loading import require_model_dir
    from graft.rollout.vllm.launcher import VllmServer, VllmServerConfig, exposure_warning

    model = str(require_model_dir(args.model))
    if args.engine == "sglang":
        from graft.rollout.sglang.launcher import SglangServer, SglangServerConfig

        if args.api_key_env is not None:
            raise ValueError("--api-key-env is for vLLM: graft launches SGLang on loopback only, without a key")
        return SglangServer(SglangServerConfig(model=model, host=args.host, port=args.port, dtype=args.dtype,
                                               max_lora_rank=args.max_lora_rank, max_loras=args.max_loras,
                                               context_length=args.max_model_len, log_dir=args.log_dir))
    config = VllmServerConfig(model=model, host=args.host, port=args.port,
                              dtype=args.dtype, max_lora_rank=args.max_lora_rank, max_loras=args.max_loras,
                              max_model_len=args.max_model_len, log_dir=args.log_dir,
                              dev_endpoints=args.weight_reload, api_key_env=args.api_key_env)
    if (warning := exposure_warning(config)) is not None:
        print(f"graft: warning: {warning}", file=sys.stderr, flush=True)
    return VllmServer(config)


def _serving_lines(args: argparse.Namespace, server) -> str:
    """What `graft serve` says once the server is up: where, in which dtype (a dtype other than the
    config's model.dtype fails the first delivery check of a run), and whether merged sync can
    reload weights."""
    dtype = server.served_dtype() or args.dtype
    lines = [f"{server.ENGINE_NAME} serving {args.model} in dtype {dtype} at {server.url} (ready in "
             f"{server.startup_seconds:.0f} s, log {server.log_path}); Ctrl-C stops it"]
    if dtype != "float32":
        lines.append("graft serve: a run with model.dtype float32 (the default) needs `graft serve --dtype float32`: "
                     f"on dtype {dtype} its first delivery check fails")
    if args.engine == "sglang":
        lines.append("graft serve: weight reload (sync.mode merged) is on: SGLang always serves "
                     "/update_weights_from_disk (loopback only)")
        return "\n".join(lines)
    lines.append("graft serve: weight reload (sync.mode merged) is " + (
        "on: the dev endpoints /pause, /collective_rpc, ... are served" if args.weight_reload else
        "off: sync.mode adapter only (--weight-reload turns it on)"))
    return "\n".join(lines)
