"""`graft verify`: the delivery check for any server and adapter (graft.sync.served_adapter does the work). Imports nothing heavy until
the command runs, so that `graft --help` stays fast."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def run(args: argparse.Namespace) -> int:
    """`graft verify`: exit 0 when the server serves exactly the adapter, 1 when not (one line)."""
    import asyncio

    from graft.rollout.factory import HTTP_CLIENTS
    from graft.sync.guard import check_finite_adapter_dir
    from graft.sync.served_adapter import verify_served_adapter
    from graft.sync.verify import base_calibrated_tolerance

    api_key = None
    if args.api_key_env is not None and not (api_key := os.environ.get(args.api_key_env)):
        raise ValueError(f"--api-key-env {args.api_key_env}: that environment variable is not set")
    model = check_finite_adapter_dir(args.base, args.dtype, args.adapter)  # before the server sees it

    async def check():
        async with HTTP_CLIENTS[args.engine](args.url, api_key=api_key) as engine:
            tolerance = (args.tolerance if args.tolerance is not None
                         else await base_calibrated_tolerance(engine, model, args.dtype))
            if args.load:
                await engine.load_adapter(args.name, str(Path(args.adapter).resolve()))
            return await verify_served_adapter(engine, model, args.name, tolerance)

    verdict = asyncio.run(check())
    print(verdict.line(), file=sys.stdout if verdict.passed else sys.stderr)
    return 0 if verdict.passed else 1


def add_command(sub) -> None:
    """The `graft verify` subcommand."""
    p = sub.add_parser("verify", help="does a running vLLM/SGLang server serve exactly this LoRA adapter?",
                       description="For adapters trained by any framework: the server answers a fixed probe "
                                   "prompt greedily under --name, the adapter applied to --base here teacher-forces "
                                   "the answer, and the largest log-prob gap decides. Exit 0: served exactly; 1: "
                                   "not (one line: the gap and the likely cause, e.g. base model served, scaling "
                                   "applied twice, a module missing, a stale prefix cache); 2: bad input.")
    p.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--base", required=True, help="the base model's HF directory (what the server serves)")
    p.add_argument("--adapter", required=True, metavar="DIR", help="the PEFT LoRA adapter directory")
    p.add_argument("--name", required=True, help="the adapter's name on the server (what requests name)")
    p.add_argument("--load", action="store_true", help="load the adapter under --name first")
    p.add_argument("--engine", choices=["vllm", "sglang"], default="vllm")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="the dtype the server computes in (vLLM --dtype; default float32)")
    p.add_argument("--tolerance", type=float, help="largest allowed log-prob gap (default: 1e-3 for float32; for "
                                                   "bfloat16 3x the server's base model's gap to --base here, "
                                                   "within 0.1-0.5)")
    p.add_argument("--api-key-env", metavar="NAME", help="environment variable holding the server's API key")
    p.set_defaults(func=run)
