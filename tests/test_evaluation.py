"""`graft eval`'s adapter name: named by the adapter's files, so that a server graft did not start (vLLM
keys prefix-cache blocks by name, or name and path) never serves one adapter's KV to another; what a
killed evaluation left loaded is unloaded first."""

import asyncio

from graft.evaluation import _unload_earlier_evaluations, eval_adapter_name
from graft.lora.adapter_io import save_adapter
from tests.helpers import trained_like_peft_model


def test_an_adapter_is_evaluated_under_a_name_its_weights_give(base_dir, tmp_path):
    save_adapter(trained_like_peft_model(base_dir, seed=1), tmp_path / "a")
    save_adapter(trained_like_peft_model(base_dir, seed=1), tmp_path / "copy")
    first = eval_adapter_name("graft", tmp_path / "a")
    assert first.startswith("graft-eval-") and eval_adapter_name("graft", tmp_path / "copy") == first
    save_adapter(trained_like_peft_model(base_dir, seed=2), tmp_path / "a", overwrite=True)  # trained further
    assert eval_adapter_name("graft", tmp_path / "a") != first


class _Listed:
    """An engine that lists and unloads names (one vanishes before its unload, as on a busy server)."""

    def __init__(self, names: list[str]) -> None:
        self.names, self.unloaded = names, []

    async def list_adapters(self) -> list[str]:
        return list(self.names)

    async def unload_adapter(self, name: str) -> None:
        from graft.rollout.engine import UnknownAdapterError

        if name == "graft-eval-gone":
            raise UnknownAdapterError(f"{name} is not loaded")
        self.unloaded.append(name)


def test_a_killed_evaluation_s_adapters_are_unloaded_but_no_one_else_s():
    engine = _Listed(["graft-eval-1111", "graft-eval-gone", "graft-eval-2222", "graft-v7", "other-eval-3333"])
    asyncio.run(_unload_earlier_evaluations(engine, "graft", "graft-eval-2222"))
    assert engine.unloaded == ["graft-eval-1111"]
