"""The built-in environments play by their rules, and `data.env` names resolve to an environment
class or fail with one error naming the key."""

import asyncio
import textwrap

import pytest

from graft.config import load_config
from graft.tasks.envs import ENVS, StepResult, resolve_env
from graft.tasks.envs.calculator import calculator_task, evaluate_expression
from graft.tasks.envs.guessing import MAX_GUESSES, guessing_task
from graft.tasks.examples import Example


def test_calculator_answers_tool_calls_and_scores_the_final_answer():
    train, held_out = calculator_task(n_train=50, n_eval=10)
    assert not {ex.prompt for ex in train} & {ex.prompt for ex in held_out}
    example = train[0]
    a, b = example.metadata["a"], example.metadata["b"]
    env = ENVS["calculator"]()
    assert env.reset(example) == [{"role": "user", "content": example.prompt}]
    assert env.step(f"calc: {a} * {b}") == StepResult([{"role": "tool", "content": str(a * b)}], 0.0, False)
    assert env.step(f"It is {a * b}") == StepResult([], 1.0, True)
    assert env.step("It is 3").reward == 0.0
    assert evaluate_expression("(2 + 3) * 4 / 8") == "2.5" and evaluate_expression("1/0").startswith("error:")
    assert evaluate_expression("__import__('os')").startswith("error:")  # only arithmetic is evaluated


def test_guessing_replies_higher_or_lower_and_fewer_guesses_earn_more():
    example = Example("guess", "11")
    env = ENVS["guessing"]()
    env.reset(example)
    assert env.step("8") == StepResult([{"role": "user", "content": "Higher."}])
    assert env.step("I say 12") == StepResult([{"role": "user", "content": "Lower."}])
    assert env.step("hmm") == StepResult([{"role": "user", "content": "Say a number."}])
    assert env.step("11") == StepResult([], 1.0 - 3 / MAX_GUESSES, True)
    env.reset(example)
    assert env.step("11").reward == 1.0
    train, _ = guessing_task(n_train=200, n_eval=0)
    assert {int(ex.answer) for ex in train} == set(range(1, 17))


USER_ENVS = textwrap.dedent('''
    import asyncio

    class Countdown:
        """Done when the model's text is short; async on purpose."""
        def reset(self, example):
            return [{"role": "user", "content": example.prompt}]
        async def step(self, model_text):
            await asyncio.sleep(0)
            return [{"role": "user", "content": "again"}], float(len(model_text) < 5), len(model_text) < 5

    def make_countdown():
        return Countdown()

    class NoStep:
        def reset(self, example):
            return []

    class TwoArgStep:
        def reset(self, example):
            return []
        def step(self, model_text, extra):
            return None

    class NeedsArgs:
        def __init__(self, size):
            pass

    VALUE = 3
''')


@pytest.fixture
def user_envs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "envs" ).mkdir()
    (tmp_path / "envs" / "my_envs.py").write_text(USER_ENVS)


def test_a_user_environment_loads_from_a_file_as_a_class_or_a_factory(user_envs):
    for name in ("envs/my_envs.py:Countdown", "envs/my_envs.py:make_countdown"):
        env = resolve_env(name)()
        assert env.reset(Example("p", "")) == [{"role": "user", "content": "p"}]
        assert asyncio.run(env.step("ok")) == ([{"role": "user", "content": "again"}], 1.0, True)


@pytest.mark.parametrize("name, error", [
    ("nope", "data.env: unknown environment 'nope'; built-in environments: ['calculator', 'guessing']"),
    ("no_such_pkg.envs:Env", "data.env: cannot import 'no_such_pkg.envs'"),
    ("envs/missing.py:Env", "data.env: file envs/missing.py does not exist"),
    ("envs/my_envs.py:Missing", "data.env: envs/my_envs.py has no class or function 'Missing' (its classes: "),
    ("envs/my_envs.py:NoStep", "data.env: environment 'envs/my_envs.py:NoStep' has no method step(); graft needs "
                               "a class (or factory) called with no arguments"),
    ("envs/my_envs.py:TwoArgStep", "data.env: environment 'envs/my_envs.py:TwoArgStep' has step(self, model_text, "
                                   "extra), which does not take one argument"),
    ("envs/my_envs.py:NeedsArgs", "data.env: environment 'envs/my_envs.py:NeedsArgs' cannot be called with no "
                                  "arguments (signature (size))"),
    ("envs/my_envs.py:VALUE", "data.env: environment 'envs/my_envs.py:VALUE' is not a class but a value of type int"),
])
def test_a_name_that_does_not_resolve_is_one_error_naming_the_key(user_envs, name, error):
    with pytest.raises(ValueError) as raised:
        resolve_env(name)
    assert str(raised.value).startswith(error), raised.value


def test_an_environment_scores_alone_and_its_limits_are_checked():
    config = load_config(None, ["data.task=guessing", "data.env=guessing", "data.max_turns=6"])
    assert config.data.reward is None and config.data.max_turns == 6 and config.data.truncated == "score"
    for override, error in [("data.reward=math", "set data.reward to null"), ("data.max_turns=0", "data.max_turns"),
                            ("data.truncated=drop", "data.truncated"), ("data.env=a b", "neither a built-in"),
                            ("train.overlong_buffer_tokens=2", "data.max_episode_tokens")]:
        with pytest.raises(ValueError, match=error):
            load_config(None, ["data.task=guessing", "data.env=guessing", override])
