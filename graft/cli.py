"""The `graft` command line: the parser of every command (each command's home: graft.commands), and how
the process runs one: signals, exit codes, one-line errors."""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys

from graft import __version__
from graft.bench.commands import add_bench_command
from graft.commands import config, evaluate, export, model, quickstart, serve, tiny_model, train, verify
from graft.tenants.command import add_tenants_command


def _quiet_libraries() -> None:
    """Keep library progress bars and advisory warnings out of graft's own output."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


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
    for command in (tiny_model, export, config):
        command.add_command(sub)
    add_bench_command(sub)
    for command in (train, evaluate, serve, model, verify, quickstart):
        command.add_command(sub)
    add_tenants_command(sub)
    return parser


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
    cached update memory (`graft.host.TCACHE_OFF`; its tunables are read at start-up
    only, so the process starts itself again once with them, same PID, same arguments)."""
    from graft.host import heap_friendly_environment

    environment = heap_friendly_environment(os.environ)
    if environment is not None:
        os.execve(sys.executable, sys.orig_argv, environment)
    return main()


if __name__ == "__main__":
    sys.exit(entry())
