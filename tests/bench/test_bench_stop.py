"""A bench stopped from outside stops as `graft train` does: `graft bench e2e` on its smallest model,
SIGTERM'd while its graft side trains (in the bench's own process, against the vLLM server the bench
launched), is gone within 10 s, the server's whole process group with it."""

import os
import signal
import subprocess
import sys

import pytest

from tests.helpers import live_group_members
from tests.test_cli_train_signals import STOP_S, _children_running, _stopped_within, _wait_for


@pytest.mark.vllm
@pytest.mark.trl
def test_a_sigtermed_bench_is_gone_within_10_s_and_its_server_with_it(tmp_path):
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with open(out, "w") as stdout_file, open(err, "w") as stderr_file:
        bench = subprocess.Popen([sys.executable, "-m", "graft.cli", "bench", "e2e", "--hidden", "128", "--layers", "2",
                                  "--steps", "500", "--repeats", "1"], stdout=stdout_file, stderr=stderr_file)
    try:
        (server,) = _wait_for(lambda: _children_running("graft.rollout.vllm.server.entry", bench.pid), 300,
                              "the bench to launch vLLM")
        pgid = os.getpgid(server)
        _wait_for(lambda: "policy:" in out.read_text(), 300, "the bench's graft side to train")  # the trainer's line
        assert _stopped_within(bench, signal.SIGTERM, STOP_S) == 143, err.read_text()[-2000:]
        # stopped by the bench on its way out, not by the server's owner watch (10 s after its owner is gone)
        _wait_for(lambda: not live_group_members(pgid), 3, f"the vLLM process group {pgid} to exit")
    finally:
        bench.kill()
        bench.wait()
    assert "Traceback" not in err.read_text()
