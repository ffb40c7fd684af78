"""graft.config.data: the data section's reward forms, field mapping defaults and their errors."""

import pytest

from graft.config import DataConfig, RewardSpec, config_to_yaml, load_config
from tests.config.common import config_error as _error
from tests.config.common import write_config as _write


def test_defaults():
    data = DataConfig()
    assert (data.reward, data.rewards, data.reward_errors) == ("exact_numeric", [], "raise")
    assert (data.prompt_key, data.answer_key, data.system_prompt) == ("prompt", "answer", None)
    assert data.reward_specs() == [RewardSpec(name="exact_numeric", weight=1.0)]


def test_rewards_alone_replace_the_default_reward_and_the_resolved_config_loads_again(tmp_path):
    config = load_config(_write(tmp_path, "data:\n  rewards:\n    - {name: math}\n"
                                          "    - {name: 'rewards/mine.py:brevity', weight: -0.1}\n"))
    assert config.data.reward is None
    assert config.data.reward_specs() == [RewardSpec(name="math"), RewardSpec(name="rewards/mine.py:brevity",
                                                                              weight=-0.1)]
    saved = _write(tmp_path, config_to_yaml(config), name="saved.yaml")
    assert load_config(saved) == config


def test_reward_and_rewards_together_are_refused():
    msg = _error(overrides=["data.reward=math", "data.rewards=[{name: format}]"])
    assert msg.startswith("data.reward ('math') and data.rewards are both set: keep one")
    assert "from override 'data.reward=math', 'data.rewards=[{name: format}]'" in msg


def test_no_reward_at_all_is_refused():
    assert _error(overrides=["data.reward="]).startswith("data.reward is null and data.rewards is empty")


@pytest.mark.parametrize("name", ["exact_numeric+format", "math", "pkg.mod:fn", "rewards/mine.py:fn_2",
                                  "../up/r.py:score"])
def test_reward_names_of_every_form(name):
    assert load_config(overrides=[f"data.reward={name}"]).data.reward == name


@pytest.mark.parametrize("name", ["pkg.mod:", "pkg.mod:2fn", ":fn", "my reward", "mod:fn()"])
def test_malformed_reward_names_are_refused_at_config_load(name):
    msg = _error(overrides=[f"data.rewards=[{{name: '{name}'}}]"])
    assert msg.startswith(f"data.rewards[0].name: {name!r} is neither a built-in reward name nor")


def test_repeated_reward_names_are_refused():
    msg = _error(overrides=["data.rewards=[{name: math}, {name: math, weight: 2}]"])
    assert msg.startswith("data.rewards names ['math'] more than once")


def test_weights_must_be_finite_and_errors_raise_or_zero():
    assert _error(overrides=["data.rewards=[{name: math, weight: .nan}]"]).startswith(
        "data.rewards[0].weight: must be a finite number, got nan")
    assert _error(overrides=["data.reward_errors=skip"]).startswith("data.reward_errors: Input should be 'raise' or")
    assert load_config(overrides=["data.reward_errors=zero"]).data.reward_errors == "zero"


def test_eval_reward_takes_every_form_and_defaults_to_the_training_rewards():
    assert DataConfig().eval_reward is None
    assert load_config(overrides=["data.eval_reward=rewards/mine.py:fn"]).data.eval_reward == "rewards/mine.py:fn"
    assert _error(overrides=["data.eval_reward=mod:fn()"]).startswith("data.eval_reward: 'mod:fn()' is neither")


def test_field_mapping_and_system_prompt():
    data = load_config(overrides=["data.path=gsm8k/train", "data.prompt_key=question", "data.answer_key=",
                                  "data.system_prompt=Think step by step."]).data
    assert (data.task, data.prompt_key, data.answer_key, data.system_prompt) == (
        None, "question", None, "Think step by step.")
