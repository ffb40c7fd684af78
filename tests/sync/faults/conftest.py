"""The faulty vLLM server of the server-side fault tests (tests.sync.faults.faulty_vllm_entry)."""

import os
from pathlib import Path

import pytest

from graft.rollout.vllm.launcher import SERVER_MODULE, VllmServer, VllmServerConfig
from tests.helpers import live_group_members
from tests.sync.faults.faulty_vllm_entry import FAULT_ENV, FAULTS

REPO = Path(__file__).parents[3]
MAX_LORAS = 4


class FaultyVllmServer(VllmServer):
    """graft's vLLM server, started through the faulty entry module with `faults` installed."""

    def __init__(self, config: VllmServerConfig, faults: tuple[str, ...]) -> None:
        super().__init__(config)
        self.faults = faults

    def command(self) -> list[str]:
        return ["tests.sync.faults.faulty_vllm_entry" if arg == SERVER_MODULE else arg for arg in super().command()]

    def environment(self) -> dict[str, str]:
        environment = super().environment()
        path = os.pathsep.join(p for p in (str(REPO), environment.get("PYTHONPATH", "")) if p)
        return {**environment, FAULT_ENV: ",".join(self.faults), "PYTHONPATH": path}


@pytest.fixture(scope="module")
def faulty_server(tiny_model_dirs, tmp_path_factory):
    config = VllmServerConfig(model=str(tiny_model_dirs["llama"]), dtype="float32", max_lora_rank=8,
                              max_loras=MAX_LORAS, log_dir=tmp_path_factory.mktemp("faulty-vllm-logs"))
    with FaultyVllmServer(config, tuple(FAULTS)) as server:
        pgid = server.pid
        print(f"\nfaulty vLLM server up in {server.startup_seconds:.1f} s at {server.url}, log {server.log_path}")
        installed = [line for line in server.log_path.read_text().splitlines()
                     if "graft test faults installed in engine process" in line]
        assert installed and all(line.endswith(", ".join(FAULTS)) for line in installed), installed
        yield server
    assert live_group_members(pgid) == [], "vLLM processes survived VllmServer.stop()"
