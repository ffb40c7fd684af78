"""`graft serve` starts a real vLLM server and leaves no process behind when it is stopped."""

import json
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from graft.rollout.vllm_launcher import free_port
from tests.helpers import live_group_members

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _models(url: str) -> list[dict] | None:
    try:
        with _NO_PROXY.open(url + "/v1/models", timeout=2) as response:
            return json.loads(response.read())["data"]
    except OSError:
        return None


@pytest.mark.vllm
def test_graft_serve_serves_and_sigterm_stops_every_process(base_dir, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # Own session, so the test can list the group graft and vLLM run in.
    proc = subprocess.Popen([sys.executable, "-m", "graft.cli", "serve", str(base_dir), "--port", str(port),
                             "--dtype", "float32", "--max-lora-rank", "8", "--log-dir", str(tmp_path)],
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while (models := _models(url)) is None:
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "graft serve did not come up in 300 s"
            time.sleep(1)
        assert models[0]["id"] == str(base_dir) and models[0]["parent"] is None
        assert (tmp_path / f"vllm-{port}.log").is_file()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143
        assert _models(url) is None
    finally:
        if proc.poll() is None:
            proc.kill()
    # vLLM runs in its own process group, led by the server process; none of its processes may be left.
    leftovers = subprocess.run(["pgrep", "-f", f"--port {port}"], capture_output=True, text=True).stdout.split()
    assert leftovers == [], [live_group_members(int(pid)) for pid in leftovers]
