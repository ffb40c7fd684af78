"""`graft eval`'s adapter name: named by the adapter's files, so that a server graft did not start (vLLM
keys prefix-cache blocks by name, or name and path) never serves one adapter's KV to another; what a
killed evaluation left loaded is unloaded first."""

import asyncio

from graft.evaluation import _unload_earlier_evaluations, eval_adapter_name, evaluate
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


class _Recording:
    """The reference engine, keeping the requests it was sent."""

    def __init__(self, engine) -> None:
        self.engine, self.requests = engine, []

    async def generate(self, requests, adapter=None):
        self.requests += requests
        return await self.engine.generate(requests, adapter=adapter)


def test_held_out_text_prompts_reach_the_engine_as_text_ids_and_rewards_see_text_before_the_stop(base_dir):
    from graft.models.loading import load_tokenizer
    from graft.rollout.reference import ReferenceEngine
    from graft.tasks import Example
    from graft.tasks.prompts import PromptFormat
    from graft.tasks.scoring import RewardTerm, Scorer

    tokenizer, seen = load_tokenizer(base_dir), []
    engine = _Recording(ReferenceEngine(base_dir))
    examples = [Example(f"What is {a} + 1?", str(a + 1)) for a in range(3)]
    prompts = PromptFormat("text", "Question: {prompt}\nAnswer:", stop=(" ",))
    scorer = Scorer([RewardTerm("seen", lambda text, example: seen.append(text) or 0.0)])
    asyncio.run(evaluate(engine, None, examples, tokenizer, 16, scorer, prompts))
    assert [list(r.prompt_token_ids) for r in engine.requests] == [
        tokenizer.encode(f"Question: What is {a} + 1?\nAnswer:") for a in range(3)]
    assert all(r.params.stop == (" ",) and r.params.temperature == 0 for r in engine.requests)
    assert len(seen) == 3 and all(" " not in text for text in seen)
