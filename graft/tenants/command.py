"""`graft tenants serve`: many users' LoRA adapters trained and sampled on one base, behind the Tinker API.

The service loads the base once for training (graft.tenants.policy) and serves each tenant's
published versions from one vLLM server as `<tenant>-v<N>` (launched here, or `--engine-url`).
Loopback by default; every request needs the API key (`X-API-Key`), which the SDK reads from
TINKER_API_KEY like this command does (the SDK refuses keys that do not start with "tml-").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import sys
from collections.abc import AsyncIterator
from pathlib import Path

from graft.config.arguments import COUNT, PORT

DEFAULT_PORT = 8210


def check_api_key(key: str) -> str:
    if not key.startswith("tml-") or len(key) < 8:
        raise ValueError(f"an API key must start with 'tml-' and be at least 8 characters (the tinker SDK refuses "
                         f"others), got {key[:4]!r}...")
    return key


@contextlib.asynccontextmanager
async def tenant_service(model_dir: Path, engine, *, run_dir: Path, max_loras: int, max_rank: int,
                         keep_versions: int = 2, dtype: str = "float32", base_model: str | None = None,
                         batch_window_s: float = 0.01, session_timeout_s: float = 300.0) -> AsyncIterator:
    """A started `TenantService` on the base at `model_dir`, its versions served by `engine` (a
    RolloutEngine serving that base with LoRA slots `max_loras`, ranks up to `max_rank`; None: training
    only, sampling refused)."""
    from graft.models.loading import load_model, load_tokenizer
    from graft.tenants.policy import TenantPolicy
    from graft.tenants.service import TenantService
    from graft.tenants.serving import TenantServing

    tokenizer = load_tokenizer(model_dir)
    policy = TenantPolicy(load_model(model_dir, dtype), pad_id=tokenizer.pad_token_id or 0)
    serving = (TenantServing(engine, run_dir / "adapters", max_loras=max_loras, keep_versions=keep_versions)
               if engine is not None else None)
    service = TenantService(policy, serving, base_model=base_model or str(model_dir), tokenizer_id=str(model_dir),
                            max_rank=max_rank, state_root=run_dir / "states", batch_window_s=batch_window_s,
                            session_timeout_s=session_timeout_s)
    service.start()
    try:
        yield service
    finally:
        await service.close()


async def _serve(args: argparse.Namespace, key: str) -> None:
    import uvicorn

    from graft.models.packaged import base_model_dir
    from graft.rollout.vllm.client import VllmClient
    from graft.rollout.vllm.launcher import VllmServer, VllmServerConfig
    from graft.tenants.api import build_app

    model_dir = base_model_dir(args.model, log=lambda message: print(f"graft: {message}", file=sys.stderr))
    with contextlib.ExitStack() as stack:
        url = args.engine_url
        if url is None:
            print(f"graft: starting vLLM for {model_dir} (takes ~30-70 s on CPU)", file=sys.stderr, flush=True)
            server = stack.enter_context(VllmServer(VllmServerConfig(
                model=str(model_dir), dtype=args.dtype, max_lora_rank=args.max_rank, max_loras=args.max_loras,
                log_dir=args.run_dir)))
            url = server.url
        async with VllmClient(url) as engine, tenant_service(
                model_dir, engine, run_dir=args.run_dir, max_loras=args.max_loras, max_rank=args.max_rank,
                keep_versions=args.keep_versions, dtype=args.dtype) as service:
            config = uvicorn.Config(build_app(service, {key}), host=args.host, port=args.port, log_level="warning")
            print(f"graft: Tinker API for {model_dir} at http://{args.host}:{args.port} (vLLM at {url}); "
                  "clients: tinker.ServiceClient(base_url=...) with TINKER_API_KEY set; Ctrl-C stops it",
                  file=sys.stderr, flush=True)
            await uvicorn.Server(config).serve()


def cmd_tenants_serve(args: argparse.Namespace) -> None:
    key = os.environ.get("TINKER_API_KEY")
    if key is None:
        key = "tml-" + secrets.token_hex(16)
        print(f"graft: no TINKER_API_KEY set; this service's key: {key}", file=sys.stderr, flush=True)
    check_api_key(key)
    asyncio.run(_serve(args, key))


def add_tenants_command(sub) -> None:
    p = sub.add_parser("tenants", help="many users' LoRA adapters on one base, behind the Tinker API",
                       description="Train and sample many tenants' LoRA adapters on one frozen base, batched "
                                   "together, behind the Tinker API (the `tinker` SDK's ServiceClient).")
    tenants = p.add_subparsers(dest="tenants_command", required=True)
    serve = tenants.add_parser("serve", help="serve the Tinker API for one base model")
    serve.add_argument("--model", required=True, help="the base: a packaged model's name (smollm2), an HF directory "
                                                    "or a .gguf file")
    serve.add_argument("--host", default="127.0.0.1", help="interface to bind (default loopback only)")
    serve.add_argument("--port", type=PORT, default=DEFAULT_PORT)
    serve.add_argument("--engine-url", help="a running vLLM server of the same base (default: launch one)")
    serve.add_argument("--max-loras", type=COUNT, default=8, help="the engine's adapter slots, for all tenants")
    serve.add_argument("--max-rank", type=COUNT, default=32, help="the largest LoRA rank a tenant may ask for")
    serve.add_argument("--keep-versions", type=COUNT, default=2, help="versions of each tenant kept served")
    serve.add_argument("--dtype", default="float32")
    serve.add_argument("--run-dir", type=Path, default=Path("runs/tenants"), help="published adapters and logs")
    serve.set_defaults(func=cmd_tenants_serve)
