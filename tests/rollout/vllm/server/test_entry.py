"""graft starts vLLM through `graft.rollout.vllm.server.entry`: after a request the engine's processes go
quiet within ~50 ms instead of spinning a core for 1 s, and no request waits for vLLM's 5 s
missed-wake-up recheck."""

import asyncio
import time

import pytest

from graft.rollout.engine import GenerateRequest, SamplingParams
from graft.rollout.process_group import group_cpu_seconds
from graft.rollout.vllm.client import VllmClient


async def _timed_requests(url: str, n: int) -> list[float]:
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=4, seed=0)
    seconds = []
    async with VllmClient(url) as client:
        for _ in range(n):
            start = time.perf_counter()
            await client.generate([GenerateRequest(tuple(range(5, 15)), params)])
            seconds.append(time.perf_counter() - start)
            await asyncio.sleep(0.2)  # past the short spin: the next request wakes a sleeping reader
    return seconds


@pytest.mark.vllm
def test_engine_is_idle_right_after_a_request_and_never_waits_for_the_recheck(vllm_server):
    seconds = asyncio.run(_timed_requests(vllm_server.url, 11))[1:]  # the first may warm up for seconds
    assert max(seconds) < 1.0, seconds  # a missed wake-up would wait for vLLM's 5 s recheck
    before = group_cpu_seconds(vllm_server.pid)
    time.sleep(1.0)
    # vLLM's default spins a reader for 1 s after the last request: ~1 CPU-second here.
    assert group_cpu_seconds(vllm_server.pid) - before < 0.3


def test_the_late_kill_after_the_owner_died_hits_only_this_launchs_processes():
    """By the time the grace period ends, the server's group id may belong to another group (pid
    reuse): the delayed SIGKILL goes to the processes carrying the launch's token, nothing else."""
    import os
    import signal
    import subprocess
    import sys

    from graft.rollout.process_group import SERVER_ID_ENV
    from graft.rollout.vllm.server.entry import _KILL_CARRIERS_LATER

    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    ours = subprocess.Popen(sleeper, env={**os.environ, SERVER_ID_ENV: "launch-a"})
    theirs = subprocess.Popen(sleeper, env={**os.environ, SERVER_ID_ENV: "launch-b"}, start_new_session=True)
    try:
        subprocess.run([sys.executable, "-c", _KILL_CARRIERS_LATER, "0.2", f"{SERVER_ID_ENV}=launch-a"], check=True,
                       timeout=30)
        assert ours.wait(timeout=10) == -signal.SIGKILL
        assert theirs.poll() is None
    finally:
        for proc in (ours, theirs):
            proc.kill()
            proc.wait()


def test_a_server_whose_owner_died_before_the_watch_began_stops_before_vllm_loads():
    """The launcher was SIGKILLed in the server's first seconds (here: before it started at all): the
    server, leader of its own group, sees an owner that is not its parent and stops its group at
    once, from the top of the entry module, before vLLM's imports."""
    import os
    import signal
    import subprocess
    import sys

    from graft.rollout.launcher import OWNER_ENV
    from graft.rollout.process_group import SERVER_ID_ENV

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that no longer runs: the owner that died
    env = {**os.environ, OWNER_ENV: str(gone.pid), SERVER_ID_ENV: "owner-gone-test"}
    started = time.monotonic()
    server = subprocess.Popen([sys.executable, "-m", "graft.rollout.vllm.server.entry", "--model", "/nonexistent"],
                              env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _, stderr = server.communicate(timeout=60)
    finally:
        server.kill()
    assert server.returncode == -signal.SIGTERM, stderr.decode()[-2000:]
    assert time.monotonic() - started < 30
    assert b"vllm" not in stderr.lower()  # stopped before vLLM said anything
