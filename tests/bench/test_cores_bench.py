"""`graft bench cores`: each setting reaches its own server's environment, on top of graft's own."""

import io

from rich.console import Console

from graft.bench import cores
from graft.rollout.vllm.launcher import VllmServerConfig


def test_each_setting_reaches_the_server_environment_over_graft_s_own():
    config = VllmServerConfig(model="m", dtype="float32")
    for extra in cores.SETTINGS.values():
        env = cores._ServerWithEnvironment(config, extra).environment()
        assert all(env[key] == value for key, value in extra.items())
        assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"  # graft's own settings are kept
    assert {extra.get("VLLM_CPU_NUM_OF_RESERVED_CPU") for extra in cores.SETTINGS.values()} == {None, "0"}


def test_the_report_has_a_row_per_model_and_setting(monkeypatch):
    rows = [{"model": m, "setting": s, "seconds_per_step": 1.0, "rollout_seconds": 0.5, "train_seconds": 0.4,
             "sync_seconds": 0.1, "verify_seconds": 0.05} for m in ("h128 l2", "h512 l8") for s in cores.SETTINGS]
    out = io.StringIO()
    monkeypatch.setattr(cores, "Console", lambda **kwargs: Console(file=out, width=200))
    cores.print_cores_report({"workload": "16x8x32", "steps_per_run": 6, "warmup_steps": 2, "rows": rows})
    text = out.getvalue()
    assert all(s.split(",")[0] in text for s in cores.SETTINGS) and text.count("h512 l8") == len(cores.SETTINGS)
