"""graft.tasks.reward_loading: built-in names, modules and files resolved to reward functions, signatures
checked, each bad reference one error naming the config key (CPU, pure Python)."""

import asyncio
import sys
import textwrap

import pytest

from graft.config import DataConfig, RewardSpec
from graft.tasks import Example
from graft.tasks.reward_loading import load_eval_scorer, load_scorer, resolve_reward
from graft.tasks.rewards import exact_numeric

USER_REWARDS = '''
from graft.tasks.rewards import exact_numeric

CALLS = []


def shout(completion, example):
    CALLS.append(completion)
    return float(completion.isupper())


def length(completions, examples):
    return [len(c) for c in completions]


async def remote(completion, example):
    return 0.5


def three(completion, example, extra):
    return 0.0


def trl_style(prompts, completions, **kwargs):
    return [0.0] * len(completions)


def broken(completion, example):
    return 1 / 0


THRESHOLD = 0.5
'''


@pytest.fixture
def reward_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # loading a file appends its directory
    (tmp_path / "rewards").mkdir()
    path = tmp_path / "rewards" / "mine.py"
    path.write_text(USER_REWARDS)
    return path


def test_built_in_names(reward_file):
    assert resolve_reward("exact_numeric") == (exact_numeric, False)
    with pytest.raises(ValueError, match=r"^data.reward: unknown reward 'exact'; built-in rewards: \[.*'math'"):
        resolve_reward("exact")


def test_a_file_path_relative_to_the_current_directory(reward_file):
    fn, batched = resolve_reward("rewards/mine.py:shout")
    assert fn("ABC", Example("q", "")) == 1.0 and not batched
    same, _ = resolve_reward(f"{reward_file}:shout")  # the absolute path names the same module
    assert same is fn
    assert resolve_reward("rewards/mine.py:length")[1] is True  # first parameter named 'completions'
    assert asyncio.run(resolve_reward("rewards/mine.py:remote")[0]("x", Example("q", ""))) == 0.5


def test_a_reward_file_imports_modules_beside_it(reward_file):
    (reward_file.parent / "byot_helper_mod.py").write_text("BONUS = 0.25\n")
    (reward_file.parent / "uses_helper.py").write_text(
        "from byot_helper_mod import BONUS\n\ndef score(completion, example):\n    return BONUS\n")
    fn, _ = resolve_reward("rewards/uses_helper.py:score")
    sys.modules.pop("byot_helper_mod")
    assert fn("x", Example("q", "")) == 0.25 and str(reward_file.parent) in sys.path


def test_a_module_path(tmp_path, monkeypatch):
    package = tmp_path / "site" / "byot_rewards_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "mine.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    try:
        fn, batched = resolve_reward("byot_rewards_pkg.mine:length")
    finally:
        for name in ("byot_rewards_pkg", "byot_rewards_pkg.mine"):
            sys.modules.pop(name, None)
    assert fn(["ab", "c"], [Example("q", "")] * 2) == [2, 1] and batched


@pytest.mark.parametrize("name, problem", [
    ("rewards/none.py:shout", r"file rewards/none.py does not exist \(relative paths start at the current "
                              r"directory, /"),
    ("no_such_pkg.mod:fn", r"cannot import 'no_such_pkg.mod' \(No module named 'no_such_pkg'\); is it installed "
                           r"or on PYTHONPATH\?"),
    ("rewards.mine:shout", r"cannot import 'rewards.mine' .*; for the file in this directory write "
                           r"'rewards/mine.py:function'"),
    ("rewards/mine.py:missing", r"rewards/mine.py has no function 'missing' \(its functions: \['broken', "
                                r"'exact_numeric', 'length', 'remote', 'shout', 'three', 'trl_style'\]\)"),
    ("rewards/mine.py:THRESHOLD", r"rewards/mine.py:THRESHOLD is a float, not a function"),
    ("rewards/mine.py:three", r"reward 'rewards/mine.py:three' has the signature \(completion, example, extra\); "
                              r"graft calls fn\(completion: str, example: Example\) -> float, or batched"),
    ("rewards/mine.py:trl_style", r"reward '.*' has the signature \(prompts, completions, \*\*kwargs\);.*"
                                  r"TRL's fn\(prompts, completions, \*\*kwargs\) becomes fn\(completions, examples\)"),
])
def test_each_bad_reference_is_one_error_naming_the_key(reward_file, name, problem):
    with pytest.raises(ValueError, match="^data.rewards\\[0\\].name: " + problem):
        resolve_reward(name, "data.rewards[0].name")


def test_a_module_that_fails_to_import_shows_where(reward_file):
    (reward_file.parent / "typo.py").write_text("def f(completion, example):\n    return 1 +\n")
    with pytest.raises(ValueError, match=r"^data.reward: running rewards/typo.py failed: SyntaxError: .*line 2"):
        resolve_reward("rewards/typo.py:f")
    (reward_file.parent / "raises.py").write_text(textwrap.dedent("""
        def setup():
            raise RuntimeError("no API key")

        setup()
    """))
    with pytest.raises(ValueError) as info:
        resolve_reward("rewards/raises.py:f")
    message = str(info.value)
    assert message.startswith("data.reward: running rewards/raises.py failed: RuntimeError: no API key")
    assert 'raises.py", line 3, in setup' in message and "importlib" not in message


def test_load_scorer_names_each_term_by_its_key(reward_file):
    config = DataConfig(rewards=[RewardSpec(name="math"), RewardSpec(name="rewards/mine.py:three", weight=0.1)])
    with pytest.raises(ValueError, match=r"^data.rewards\[1\].name: reward 'rewards/mine.py:three'"):
        load_scorer(config)
    config = DataConfig(rewards=[RewardSpec(name="math"), RewardSpec(name="rewards/mine.py:length", weight=0.1)],
                        reward_errors="zero")
    scorer = load_scorer(config)
    assert [(t.name, t.weight, t.batched) for t in scorer.terms] == [("math", 1.0, False),
                                                                      ("rewards/mine.py:length", 0.1, True)]
    assert scorer.on_error == "zero"
    assert [t.name for t in load_scorer(DataConfig()).terms] == ["exact_numeric"]


def test_the_eval_scorer_is_eval_reward_alone_else_the_training_rewards(reward_file):
    config = DataConfig(rewards=[RewardSpec(name="math"), RewardSpec(name="rewards/mine.py:length", weight=0.1)])
    assert [(t.name, t.weight) for t in load_eval_scorer(config).terms] == [("math", 1.0),
                                                                           ("rewards/mine.py:length", 0.1)]
    config = config.model_copy(update={"eval_reward": "rewards/mine.py:shout", "reward_errors": "zero"})
    scorer = load_eval_scorer(config)
    assert [(t.name, t.weight, t.batched) for t in scorer.terms] == [("rewards/mine.py:shout", 1.0, False)]
    assert scorer.on_error == "zero"
    with pytest.raises(ValueError, match=r"^data.eval_reward: unknown reward 'maths'"):
        load_eval_scorer(config.model_copy(update={"eval_reward": "maths"}))
