"""`graft tenants serve`: many users' LoRA adapters trained and sampled on one base, behind the Tinker API.

The service loads the base once for training (graft.tenants.policy) and serves each tenant's
published versions as `<tenant>-v<N>` from vLLM: one server launched here (`--engines N`: N of them),
or the servers at `--engine-url` (repeated: several). Several servers are one `EnginePool`
(graft.rollout.pool): every tenant's versions loaded on each, samples to the least busy, a server
that stops answering dropped. Under `torchrun --nproc-per-node N --no-python graft tenants serve`
the ranks train together on FSDP2 (and `--tp`) and rank 0 answers HTTP (graft.tenants.ranks).
Loopback by default (another interface warns); every request needs a user's API key (`X-API-Key`):
`--keys FILE` (`<user> <key>` lines) for many users, or TINKER_API_KEY for one, which the SDK reads
too (it refuses keys that do not start with "tml-"). The vLLM launched here requires a key of the
service's own, made at start and held in memory only, so no other local process reaches the
tenants' adapters through it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import sys
import threading
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from graft.config import LOOPBACK_HOSTS
from graft.config.arguments import COUNT, PORT
from graft.tenants.users import PASS_TOKENS, Limits, Users, check_api_key

DEFAULT_PORT = 8210
ENGINE_KEY_ENV = "GRAFT_TENANTS_ENGINE_KEY"  # the launched vLLM's key, in its environment only
STOP_GRACE_S = 2

# The model thread runs thousands of small torch ops a step, each releasing the GIL and taking it back;
# while the event loop's thread runs Python (clients' requests), each take-back waits out the switch
# interval (5 ms by default). Measured on SmolLM2, one LoRA AdamW step beside a busy Python thread:
# 0.023 s alone, 34.8 s at 5 ms, 2.3 s at 0.5 ms; 8 cookbook clients (`graft bench cookbook --tenants
# 1,8`): 97.7 trained tokens/s at 5 ms, 107.9 at 0.5 ms, passes shared by several 53% and 74%.
GIL_SWITCH_S = 0.0005


@contextlib.asynccontextmanager
async def tenant_service(model_dir: Path, engine, *, run_dir: Path, max_loras: int, max_rank: int,
                         keep_versions: int = 2, dtype: str = "float32", base_model: str | None = None,
                         limits: Limits = Limits(), batch_window_s: float = 10.0,
                         session_timeout_s: float = 300.0, batch_invariant: bool = False,
                         pass_tokens: int = PASS_TOKENS, ranked=None) -> AsyncIterator:
    """A started `TenantService` on the base at `model_dir`, its versions served by `engine` (a
    RolloutEngine serving that base with LoRA slots `max_loras`, ranks up to `max_rank`; None: training
    only, sampling refused). `ranked`: rank 0's `RankedTenantPolicy` (graft.tenants.ranks), which
    trains on every rank; None: one process."""
    from graft.models.loading import load_model, load_tokenizer
    from graft.parallel.abandon import stop_points
    from graft.tenants.parse import Bounds
    from graft.tenants.policy import TenantPolicy
    from graft.tenants.ranks import RankedSource
    from graft.tenants.service import TenantService
    from graft.tenants.serving import TenantServing
    from graft.tenants.source import TenantSource

    tokenizer = load_tokenizer(model_dir)
    if ranked is None:
        base = load_model(model_dir, dtype)
        # On the base's decoder layers, which every tenant's PEFT model runs through: a stopping service
        # ends a pass at its next layer instead of waiting for it (a SIGTERM'd service on SmolLM2 sat in
        # close() over 120 s behind one pass of 8 x 500 tokens).
        stopping = stop_points(base)
        policy, source = TenantPolicy(base, pad_id=tokenizer.pad_token_id or 0, pass_tokens=pass_tokens,
                                      batch_invariant=batch_invariant), TenantSource
    else:  # a ranked pass is a collective of every rank: rank 0 alone must not cut it short
        base, stopping, policy, source = ranked.base, threading.Event(), ranked, RankedSource
    bounds = Bounds.of(base, limits)  # before any tenant: a ranked policy's base goes to its first build
    serving = (TenantServing(engine, run_dir / "adapters", max_loras=max_loras, keep_versions=keep_versions)
               if engine is not None else None)
    service = TenantService(policy, serving, base_model=base_model or str(model_dir), tokenizer_id=str(model_dir),
                            max_rank=max_rank, state_root=run_dir / "states", bounds=bounds,
                            batch_window_s=batch_window_s, session_timeout_s=session_timeout_s, source=source)
    service.start()
    switch_s = sys.getswitchinterval()
    sys.setswitchinterval(GIL_SWITCH_S)
    try:
        yield service
    finally:
        sys.setswitchinterval(switch_s)
        stopping.set()
        await service.close()


@contextlib.asynccontextmanager
async def served_tenants(url: str | Sequence[str], model_dir: Path, *, api_key: str | None = None,
                         **settings) -> AsyncIterator:
    """`tenant_service` with its versions served by the vLLM server at `url`, or by the servers at each
    of several urls (an `EnginePool`); `settings`: its keywords."""
    from graft.rollout.pool import EnginePool
    from graft.rollout.vllm.client import VllmClient

    urls = [url] if isinstance(url, str) else list(url)
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(VllmClient(u, api_key=api_key)) for u in urls]
        engine = clients[0] if len(clients) == 1 else EnginePool(clients)
        async with tenant_service(model_dir, engine, **settings) as service:
            yield service


async def _serve(args: argparse.Namespace, users: Users, model_dir: Path, ranked=None) -> None:
    import uvicorn

    from graft.rollout.vllm.launcher import VllmServer, VllmServerConfig, split_cores
    from graft.tenants.api import build_app

    with contextlib.ExitStack() as stack:
        urls, engine_key = list(args.engine_url or ()), None
        if not urls:
            print(f"graft: starting {args.engines} vLLM server(s) for {model_dir} (each ~15-40 s on CPU)",
                  file=sys.stderr, flush=True)
            engine_key = os.environ[ENGINE_KEY_ENV] = secrets.token_hex(24)
            # One server keeps vLLM's own binding; several each get their own cores.
            shares = [None] if args.engines == 1 else split_cores(args.engines, os.sched_getaffinity(0))
            for cores in shares:
                urls.append(stack.enter_context(VllmServer(VllmServerConfig(
                    model=str(model_dir), dtype=args.dtype, max_lora_rank=args.max_rank, max_loras=args.max_loras,
                    log_dir=args.run_dir, api_key_env=ENGINE_KEY_ENV, cpu_cores=cores))).url)
        url = ", ".join(urls)
        async with served_tenants(urls, model_dir, api_key=engine_key, run_dir=args.run_dir,
                                  max_loras=args.max_loras, max_rank=args.max_rank, keep_versions=args.keep_versions,
                                  dtype=args.dtype, limits=limits_of(args), batch_invariant=args.batch_invariant,
                                  pass_tokens=args.pass_tokens, ranked=ranked) as service:
            # A stop waits at most STOP_GRACE_S for open requests: a retrieve_future long poll holds its
            # connection up to 25 s, and a SIGTERM'd service took 24 s to exit behind one (measured).
            config = uvicorn.Config(build_app(service, users), host=args.host, port=args.port, log_level="warning",
                                    timeout_graceful_shutdown=STOP_GRACE_S)
            print(f"graft: Tinker API for {model_dir} at http://{args.host}:{args.port} (vLLM at {url}); "
                  "clients: tinker.ServiceClient(base_url=...) with TINKER_API_KEY set; Ctrl-C stops it",
                  file=sys.stderr, flush=True)
            await uvicorn.Server(config).serve()


def limits_of(args: argparse.Namespace) -> Limits:
    return Limits(body_bytes=args.max_body_bytes, datum_tokens=args.max_datum_tokens,
                  request_tokens=args.max_request_tokens, sample_tokens=args.max_sample_tokens,
                  models_per_user=args.max_models, sessions_per_user=args.max_sessions,
                  pending_per_user=args.max_pending, engine_per_user=args.max_engine_requests)


def users_of(args: argparse.Namespace) -> Users:
    """The users: the keys file, else TINKER_API_KEY's one user, else one user with a new key (printed)."""
    if args.keys is not None:
        return Users.from_file(args.keys)
    key = os.environ.get("TINKER_API_KEY")
    if key is None:
        key = "tml-" + secrets.token_hex(16)
        print(f"graft: no --keys and no TINKER_API_KEY; this service's one key: {key}", file=sys.stderr, flush=True)
    return Users.single(check_api_key(key))


def cmd_tenants_serve(args: argparse.Namespace) -> None:
    from graft.models.loading import require_model_dir
    from graft.tenants.ranks import serve_on_ranks

    def model_dir() -> Path:
        return require_model_dir(args.model)

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun: rank 0 serves, the others follow
        serve_on_ranks(args, model_dir, lambda found, ranked: asyncio.run(_serve(args, _users(args), found, ranked)))
    else:
        asyncio.run(_serve(args, _users(args), model_dir()))


def _users(args: argparse.Namespace) -> Users:
    users = users_of(args)
    if args.host not in LOOPBACK_HOSTS and not args.host.startswith("127."):
        print(f"graft: warning: the Tinker API on {args.host} is reachable from the network: anyone who can reach "
              f"it and holds one of the {len(users.names)} key(s) trains and samples there, and the traffic is "
              "plain HTTP (put TLS in front)", file=sys.stderr, flush=True)
    return users


def add_tenants_command(sub) -> None:
    p = sub.add_parser("tenants", help="many users' LoRA adapters on one base, behind the Tinker API",
                       description="Train and sample many tenants' LoRA adapters on one frozen base, batched "
                                   "together, behind the Tinker API (the `tinker` SDK's ServiceClient).")
    tenants = p.add_subparsers(dest="tenants_command", required=True)
    serve = tenants.add_parser("serve", help="serve the Tinker API for one base model")
    serve.add_argument("--model", required=True, help="the base: a packaged model's name (smollm2), an HF directory, "
                                                    "a .gguf file or a hub id in the local Hugging Face cache")
    serve.add_argument("--keys", type=Path, help="users' API keys: one '<user> <key>' per line, '#' comments "
                                                 "(default: TINKER_API_KEY, one user)")
    serve.add_argument("--host", default="127.0.0.1", help="interface to bind (default loopback only)")
    serve.add_argument("--port", type=PORT, default=DEFAULT_PORT)
    serve.add_argument("--engine-url", action="append", help="a running vLLM server of the same base, repeated for "
                                                            "several (default: launch --engines)")
    serve.add_argument("--engines", type=COUNT, default=1, help="vLLM servers to launch without --engine-url; "
                                                              "each tenant's versions on every one")
    serve.add_argument("--tp", type=COUNT, default=1, help="under torchrun: ranks per tensor-parallel group "
                                                         "(the rest is FSDP2 data parallelism)")
    serve.add_argument("--max-loras", type=COUNT, default=8, help="the engine's adapter slots, for all tenants")
    serve.add_argument("--max-rank", type=COUNT, default=32, help="the largest LoRA rank a tenant may ask for")
    serve.add_argument("--keep-versions", type=COUNT, default=2, help="versions of each tenant kept served")
    serve.add_argument("--dtype", default="float32")
    serve.add_argument("--run-dir", type=Path, default=Path("runs/tenants"), help="published adapters and logs")
    limits = Limits()
    serve.add_argument("--max-body-bytes", type=COUNT, default=limits.body_bytes, help="largest request body")
    serve.add_argument("--max-datum-tokens", type=COUNT, help="tokens per datum (default: the base's context)")
    serve.add_argument("--max-request-tokens", type=COUNT, default=limits.request_tokens,
                       help="tokens of all datums of one forward_backward")
    serve.add_argument("--max-sample-tokens", type=COUNT, default=limits.sample_tokens,
                       help="num_samples x max_tokens of one sample request")
    serve.add_argument("--max-models", type=COUNT, default=limits.models_per_user, help="training models per user")
    serve.add_argument("--max-sessions", type=COUNT, default=limits.sessions_per_user, help="live sessions per user")
    serve.add_argument("--max-pending", type=COUNT, default=limits.pending_per_user,
                       help="a user's requests in flight (more wait: 429)")
    serve.add_argument("--max-engine-requests", type=COUNT, default=limits.engine_per_user,
                       help="a user's sample requests at the engine at once (more wait their turn)")
    serve.add_argument("--pass-tokens", type=COUNT, default=PASS_TOKENS,
                       help="padded tokens of one forward pass (on each rank), more go in further passes: what "
                            "bounds a pass's activations (SmolLM2 on 2 ranks: 5 GB a rank at the default)")
    serve.add_argument("--batch-invariant", action="store_true",
                       help="a tenant trained in shared passes ends bit-equal to it alone (slower: docs/tenants.md)")
    serve.set_defaults(func=cmd_tenants_serve)
