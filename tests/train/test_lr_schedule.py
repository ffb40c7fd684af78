"""The learning-rate schedule (graft.train.lr_schedule) step by step against Hugging Face's schedulers
(what TRL trains with), and the config's checks on it."""

import pytest
import torch
from transformers import get_scheduler

from graft.config import ConfigError, load_config
from graft.train.lr_schedule import learning_rate

STEPS, LR = 10, 3e-4


def _hugging_face_rates(name: str, warmup: int, **kwargs) -> list[float]:
    """The rate HF's scheduler sets for each of STEPS optimizer steps (step s runs at its index s - 1)."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=STEPS,
                              scheduler_specific_kwargs=kwargs)
    rates = []
    for _ in range(STEPS):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize("schedule, floor, hf_name, hf_kwargs", [
    ("linear", 0.0, "linear", {}),
    ("cosine", 0.0, "cosine", {}),
    ("cosine", 0.1, "cosine_with_min_lr", {"min_lr_rate": 0.1}),
    ("constant", 0.0, "constant", {}),
])
@pytest.mark.parametrize("warmup", [0, 3])
def test_the_schedule_after_the_warmup_is_hugging_face_s(schedule, floor, hf_name, hf_kwargs, warmup):
    config = load_config(None, [f"train.steps={STEPS}", f"train.lr={LR}", f"train.warmup_steps={warmup}",
                                f"train.lr_schedule={schedule}", f"train.min_lr_ratio={floor}"])
    ours = [learning_rate(config, step) for step in range(1, STEPS + 1)]
    theirs = _hugging_face_rates(hf_name, warmup, **hf_kwargs)
    assert ours[warmup:] == pytest.approx(theirs[warmup:], rel=1e-12, abs=1e-18)
    # graft's warmup ends at the full rate on step `warmup` (HF's starts at 0: a step that learns nothing)
    assert ours[:warmup] == pytest.approx([LR * step / warmup for step in range(1, warmup + 1)])
    if schedule != "constant":
        assert ours[warmup] == pytest.approx(LR) and LR * floor < ours[-1] < ours[warmup + 1] < LR


def test_a_floor_without_a_decay_is_one_clear_error():
    with pytest.raises(ConfigError) as refused:
        load_config(None, ["train.min_lr_ratio=0.1"])
    assert "train.lr_schedule is 'constant'" in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(ConfigError, match="min_lr_ratio"):
        load_config(None, ["train.lr_schedule=linear", "train.min_lr_ratio=1.5"])
