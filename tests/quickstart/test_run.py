"""graft.quickstart.run: the quickstart resumes after losing its vLLM server."""

import io

from rich.console import Console

import graft.quickstart.run as quickstart_run
from graft.rollout.engine import EngineUnavailableError


def test_a_lost_server_is_reported_verbatim_and_the_run_resumes(tmp_path, monkeypatch):
    # The error of a dead launched server ends with its log tail, which may hold rich markup look-alikes.
    error = EngineUnavailableError("the vLLM server graft launched (pid 7) was killed by SIGKILL; last lines of "
                                   "its log vllm-1.log:\nINFO [core.py:133] GET [/v1/models]", address="http://h:1")
    calls = []

    async def fake_train(config, run_dir, resume):
        calls.append(resume)
        if len(calls) == 1:
            raise error
        return {"steps": 1}

    monkeypatch.setattr(quickstart_run, "train", fake_train)
    monkeypatch.setattr(quickstart_run, "latest_checkpoint", lambda path: path / "step-000001")
    out = io.StringIO()
    result = quickstart_run._train_resuming_after_engine_loss(None, tmp_path, Console(file=out, width=1000))
    assert result == {"steps": 1} and calls == [False, True]
    assert "INFO [core.py:133] GET [/v1/models]" in out.getvalue()
    assert f"resuming from {tmp_path / 'checkpoints' / 'step-000001'}" in out.getvalue()
