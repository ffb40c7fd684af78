"""The TRL virtualenv the side-by-side benches run TRL in, kept apart from graft's dependencies.

Built once under the cache directory with the same torch, transformers and PEFT versions as
graft's environment (so both sides run the same kernels and model code), plus TRL.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

from rich.console import Console

from graft.atomic import one_builder

TRL_VERSION = "1.16.0"


class TrlEnvError(RuntimeError):
    """The TRL virtualenv could not be built (the message names the pip log)."""


def _requirements() -> list[str]:
    torch_version = version("torch").split("+")[0]  # 2.13.0+cpu -> the same build pip picks here
    return [f"torch=={torch_version}", f"trl=={TRL_VERSION}", f"transformers=={version('transformers')}",
            f"peft=={version('peft')}",
            # graft.config (the worker builds the task through it)
            f"pydantic=={version('pydantic')}", f"pyyaml=={version('pyyaml')}"]


def trl_python(cache_dir: Path, console: Console | None = None) -> Path:
    """The python of a virtualenv with TRL and graft's torch/transformers/PEFT versions (built on first use)."""
    venv = cache_dir / "trl-venv"
    python = venv / "bin" / "python"
    stamp = venv / ".graft-requirements.json"
    requirements = _requirements()
    with one_builder(cache_dir / "trl-venv.lock"):  # a second bench waits here for the first one's build
        if python.exists() and stamp.exists() and json.loads(stamp.read_text()) == requirements:
            return python
        _build(venv, requirements, cache_dir / "trl-venv-install.log", console or Console(stderr=True))
        stamp.write_text(json.dumps(requirements))
    return python


def _build(venv: Path, requirements: list[str], log: Path, console: Console) -> None:
    python = venv / "bin" / "python"
    steps = [[sys.executable, "-m", "venv", str(venv)],
             [str(python), "-m", "pip", "install", "--upgrade", "pip"],
             # torch alone first: the local CPU wheel, so that TRL's requirements never pull a CUDA torch.
             [str(python), "-m", "pip", "install", requirements[0]],
             [str(python), "-m", "pip", "install", *requirements]]
    with console.status(f"building the TRL virtualenv at {venv} (once, a few minutes; log {log})"), \
            open(log, "w") as out:
        for command in steps:
            if subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ}).returncode:
                raise TrlEnvError(f"building the TRL virtualenv failed at `{' '.join(command)}`; see {log}")


def worker_environment() -> dict[str, str]:
    """Environment for `python -m graft.bench.trl.worker` in the TRL venv: graft's source on the path
    (the worker imports only graft.tasks and graft.config from it)."""
    package_root = str(Path(__file__).resolve().parents[3])  # graft/bench/trl/env.py -> what holds graft/
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": package_root + (os.pathsep + path if path else "")}


def run_trl(python: Path, spec: dict, work_dir: Path, module: str = "graft.bench.trl.worker") -> dict:
    """Runs the worker `module` (`python -m MODULE SPEC.json OUT.json`) on `spec` in the TRL venv; its
    result (see the worker)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    spec_path, out_path, log = work_dir / "spec.json", work_dir / "result.json", work_dir / "trl.log"
    spec_path.write_text(json.dumps(spec, indent=1))
    with open(log, "w") as out:
        code = subprocess.run([str(python), "-m", module, str(spec_path), str(out_path)],
                              stdout=out, stderr=subprocess.STDOUT, env=worker_environment(), cwd=work_dir).returncode
    if code:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise TrlEnvError(f"the TRL run failed (exit {code}); last lines of {log}:\n{tail}")
    return json.loads(out_path.read_text())
