"""tests/worker_deaths.py: a test during which a launched server's log gains a "died unexpectedly"
line fails, naming the log and quoting the line; the same death is not blamed on a later test; an
ordinary log, or a death an earlier server wrote to the same file, fails nothing."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from types import SimpleNamespace

from tests.worker_deaths import LogWatch

DEATH = ("(EngineCore pid=7) ERROR 12-07 18:34:39 [multiproc_executor.py:316] Worker proc VllmWorker-0 died "
         "unexpectedly (exit code: -4), shutting down executor.")
REPO = Path(__file__).parents[1]
FAILURE = "a server's worker died during this test: "


def _launched(watch: LogWatch, log: Path) -> None:
    watch.launched(SimpleNamespace(log_path=log))  # all `launched` reads of a ServerProcess


def test_a_death_written_after_the_launch_is_reported_once_with_its_log(tmp_path):
    log, watch = tmp_path / "vllm-1.log", LogWatch()
    _launched(watch, log)  # before the server wrote anything: no file yet
    log.write_text("INFO starting\n")
    assert watch.new_deaths() == []
    with open(log, "a") as f:
        f.write(f"{DEATH}\nERROR EngineDeadError\n")
    assert watch.new_deaths() == [f"{log}: {DEATH}"]
    assert watch.new_deaths() == []  # blamed on one test only


def test_the_kernel_guards_line_naming_a_fatal_fault_is_quoted_beside_the_death(tmp_path):
    log, watch = tmp_path / "vllm-1.log", LogWatch()
    _launched(watch, log)
    fault = ("graft: fatal SIGILL at ip 0x7f01 = /venv/vllm/_C.abi3.so+0x3e6671 (bytes 0xc4 0xe2 0x7b 0x4b), "
             "address 0x7f01: not in graft's LoRA kernel, handed on")
    log.write_text(f"INFO step\n{fault}\n{DEATH}\n")
    assert watch.new_deaths() == [f"{log}: {fault}", f"{log}: {DEATH}"]


def test_what_an_earlier_server_wrote_to_the_same_log_is_not_this_launchs(tmp_path):
    log, watch = tmp_path / "vllm-1.log", LogWatch()
    log.write_text(f"{DEATH}\n")  # a server on the same port, before: the log is appended to
    _launched(watch, log)
    with open(log, "a") as f:
        f.write("INFO Application startup complete.\n")
    assert watch.new_deaths() == []


def test_a_death_line_still_being_written_is_reported_once_whole(tmp_path):
    log, watch = tmp_path / "vllm-1.log", LogWatch()
    _launched(watch, log)
    half = len(DEATH) // 2
    log.write_text(DEATH[:half])
    assert watch.new_deaths() == []
    with open(log, "a") as f:
        f.write(DEATH[half:] + "\n")
    assert watch.new_deaths() == [f"{log}: {DEATH}"]


def test_a_log_whose_directory_is_gone_is_skipped(tmp_path):
    log, watch = tmp_path / "gone" / "vllm-1.log", LogWatch()
    _launched(watch, log)
    assert watch.new_deaths() == []


# A server that says LINE, then answers /health: a stand-in for vLLM that starts in well under a second.
STAND_IN = """
import http.server, sys
print(sys.argv[2], flush=True)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""

INNER_TESTS = textwrap.dedent(f"""
    import os, sys
    import pytest
    from graft.rollout.launcher import ServerConfig, ServerProcess

    class StandIn(ServerProcess):
        LOG_PREFIX = "vllm"

        def __init__(self, line, log_dir):
            super().__init__(ServerConfig(model="stand-in", log_dir=log_dir))
            self.line = line

        def command(self):
            return [sys.executable, "-c", {STAND_IN!r}, str(self.port), self.line]

        def environment(self):
            return dict(os.environ)

    def test_a_server_started_in_the_body_whose_worker_dies(tmp_path):
        with StandIn({DEATH!r}, tmp_path):
            pass

    def test_a_quiet_server(tmp_path):
        with StandIn("INFO Application startup complete.", tmp_path):
            pass

    @pytest.fixture(scope="module")
    def dying(tmp_path_factory):
        with StandIn({DEATH!r}, tmp_path_factory.mktemp("logs")) as server:
            yield server

    def test_the_first_user_of_a_module_server_whose_worker_dies(dying):
        pass

    def test_a_later_user_of_it(dying):
        pass
""")


def test_a_test_during_which_a_worker_died_fails_naming_the_log_and_quoting_the_line(pytester, monkeypatch):
    pytester.makepyfile(test_inner=INNER_TESTS)
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # graft and tests, from the inner pytest's own directory
    result = pytester.runpytest_subprocess("-p", "tests.worker_deaths", timeout=120)
    result.assert_outcomes(passed=4, errors=2)
    failed = [line.split(" - ")[0] for line in result.stdout.lines if line.startswith("ERROR test_inner.py::")]
    assert failed == ["ERROR test_inner.py::test_a_server_started_in_the_body_whose_worker_dies",
                      "ERROR test_inner.py::test_the_first_user_of_a_module_server_whose_worker_dies"]
    messages = [line.removeprefix(FAILURE) for line in result.stdout.lines if line.startswith(FAILURE)]
    assert len(messages) == 2
    for message in messages:
        log, quoted = message.split(": ", 1)
        assert Path(log).is_relative_to(pytester.path) and Path(log).is_file(), log
        assert re.fullmatch(r"vllm-\d+\.log", Path(log).name) and quoted == DEATH
