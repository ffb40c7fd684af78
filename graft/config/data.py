"""The `data` section: where prompts come from, how records map to prompts and answers, and the
rewards that score completions.

Only the form of a reward is checked here (a built-in name, or `module:function`); whether it
resolves to a function with the right signature is checked by `graft.tasks.reward_loading` when a
run loads its task, before any engine starts (config sits below tasks in the layer order).
"""

import math
import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from graft.config.base import ConfigError, Section

# A built-in name ("exact_numeric+format"), or "target:function" where target is a dotted module
# path or a path to a .py file.
_BUILT_IN_NAME = re.compile(r"^[A-Za-z0-9_.+-]+$")
_FUNCTION_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
PROMPT_PLACEHOLDER = "{prompt}"  # where data.prompt_template puts each prompt


def check_reward_name(name: str) -> str:
    """A built-in reward name, or `package.module:function` / `path/to/file.py:function`.

    Raises:
        ValueError: For anything else (e.g. a missing function after the colon).
    """
    if ":" in name:
        target, _, function = name.rpartition(":")
        if target and _FUNCTION_NAME.match(function):
            return name
    elif _BUILT_IN_NAME.match(name):
        return name
    raise ValueError(f"{name!r} is neither a built-in reward name nor 'package.module:function' or "
                     "'path/to/file.py:function'")


class RewardSpec(Section):
    """One term of the reward: `weight` x the reward named `name`."""

    name: str = Field(description="A built-in reward (exact_numeric, format, exact_numeric+format, math), "
                      "'package.module:function' (imported) or 'path/to/file.py:function' (path relative to the "
                      "current directory). Its mean per step is logged as reward/<name>.")
    weight: float = Field(1.0, description="Weight of this reward in the sum used for advantages; 0 = logged only.")

    @field_validator("name")
    @classmethod
    def _check_name(cls, v: str) -> str:
        return check_reward_name(v)

    @field_validator("weight")
    @classmethod
    def _check_weight(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError(f"must be a finite number, got {v}")
        return v


class DataConfig(Section):
    task: str | None = Field("arithmetic", description="Built-in task name; null when training on data.path.")
    task_options: dict[str, Any] = Field(
        default_factory=dict, description="Settings of the built-in task (data.task), by the names its function "
        "takes, e.g. {max_operand: 9} for one-digit arithmetic (a base model that cannot add two-digit numbers "
        "still learns); empty = the task's defaults. An unknown name is an error that lists the known ones.")
    path: str | None = Field(
        None, description="Training records: a JSONL file, a Parquet file (.parquet) or a directory written by "
        "Hugging Face datasets' save_to_disk (one split; a DatasetDict's splits are its subdirectories); "
        "replaces data.task.")
    eval_path: str | None = Field(
        None, description="Held-out records, in any format data.path takes; null = a deterministic 10% held-out "
        "split of data.path (built-in tasks have their own held-out split).")
    prompt_key: str = Field(
        "prompt", description="Field of each record holding the prompt: a string (one user message) or chat "
        "messages, a list of {role, content}.")
    answer_key: str | None = Field(
        "answer", description="Field holding the reference answer (a string or a number) that rewards compare "
        "with; null = records have none (Example.answer is ''; for rewards that judge without one). Every other "
        "field goes into Example.metadata.")
    system_prompt: str | None = Field(
        None, description="System message put in front of every prompt (train and held-out) that does not start "
        "with a system message of its own; null = none.")
    prompt_format: Literal["auto", "chat", "text"] = Field(
        "auto", description="How a prompt becomes the tokens the model completes: 'chat' through the tokenizer's "
        "chat template (an instruct model); 'text' as plain text in data.prompt_template, with the special tokens "
        "the tokenizer adds (a base model, as R1-Zero-style runs start); 'auto' = chat where the tokenizer has a "
        "chat template, else text. Text takes string prompts (or one user message); data.env needs chat.")
    prompt_template: str | None = Field(
        None, description="Text prompts: the text around each prompt, with '{prompt}' where it goes, e.g. "
        "'Question: {prompt}\\nAnswer:'; null = the prompt alone. Not used with chat prompts.")
    stop: list[str] = Field(
        default_factory=list, description="Strings that end a completion where they appear (sampling and held-out "
        "answers), e.g. ['\\n'] for a one-line answer after a text template; the reward sees the text before the "
        "first one. Empty = the model's end-of-sequence token and rollout.max_new_tokens only.")
    reward: str | None = Field(
        "exact_numeric", description="The reward that scores completions: a built-in name (exact_numeric, format, "
        "exact_numeric+format, math), 'package.module:function' or 'path/to/file.py:function' (relative to the "
        "current directory). A function is fn(completion, example) -> float, or batched fn(completions, examples) "
        "-> list[float] when its first parameter is named 'completions'; async def is awaited. Null when "
        "data.rewards is set.")
    rewards: list[RewardSpec] = Field(
        default_factory=list, description="Several rewards, [{name, weight}]: their weighted sum drives the "
        "advantages and each is logged as reward/<name>. Replaces data.reward.")
    eval_reward: str | None = Field(
        None, description="The reward that scores held-out greedy answers (its mean is reported as accuracy), in "
        "any form data.reward takes, e.g. exact_numeric or math when training on a shaped sum; null = the "
        "training reward (data.reward, or the weighted sum of data.rewards).")
    env: str | None = Field(
        None, description="Multi-turn episodes: the environment the model talks to, a built-in name (calculator, "
        "guessing) or 'package.module:Class' / 'path/to/file.py:Class' (relative to the current directory), a class "
        "whose objects have reset(example) -> chat messages and step(model_text) -> StepResult(messages, reward, "
        "done), sync or async. The episode's reward is the sum of its steps' rewards, so data.reward is not used; "
        "null = single-turn completions scored by data.reward.")
    max_turns: int = Field(4, ge=1, description="Most model turns of an episode (data.env); an episode still "
                           "running after them is cut and marked truncated.")
    max_episode_tokens: int | None = Field(
        None, ge=2, description="Most tokens of an episode (data.env), prompt, model and environment turns "
        "together; each model turn gets min(rollout.max_new_tokens, what is left); an episode that reaches it is "
        "cut and marked truncated. null = rollout.max_model_len (a launched server's limit), else no limit.")
    truncated: Literal["score", "mask"] = Field(
        "score", description="An episode cut by data.max_turns or data.max_episode_tokens: 'score' trains on it with "
        "the reward it earned so far; 'mask' leaves it out of the loss (its reward still counts in its group's "
        "baseline).")
    reward_errors: Literal["raise", "zero"] = Field(
        "raise", description="A reward that raises (or returns a non-number): 'raise' stops the run with one error "
        "naming the reward and the example, with the end of its traceback; 'zero' scores that completion 0 for "
        "that reward and counts it in the metrics (reward_errors).")

    @model_validator(mode="before")
    @classmethod
    def _implicit_defaults_step_aside(cls, data: Any) -> Any:
        # Setting only data.path means "train on this file": the default task steps aside; setting
        # only data.rewards means "score with these": the default data.reward steps aside.
        if isinstance(data, dict) and data.get("path") is not None and "task" not in data:
            data = {**data, "task": None}
        if isinstance(data, dict) and (data.get("rewards") or data.get("env")) and "reward" not in data:
            data = {**data, "reward": None}
        return data

    @field_validator("prompt_template")
    @classmethod
    def _check_template(cls, v: str | None) -> str | None:
        if v is not None and v.count(PROMPT_PLACEHOLDER) != 1:
            raise ValueError(f"must hold {PROMPT_PLACEHOLDER} once (where each prompt goes), got {v!r}")
        return v

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: list[str]) -> list[str]:
        if any(not s for s in v):
            raise ValueError("an empty stop string would end every completion at once")
        return v

    @model_validator(mode="after")
    def _text_prompts_alone(self) -> "DataConfig":
        if self.prompt_format == "chat" and self.prompt_template is not None:
            raise ConfigError("data.prompt_template is for text prompts, and data.prompt_format is chat: set "
                              "data.prompt_format to text (or auto) or data.prompt_template to null",
                              keys=("data.prompt_format", "data.prompt_template"))
        if self.prompt_format == "text" and self.env is not None:
            raise ConfigError(f"data.env ({self.env!r}) talks to the model in chat turns, and data.prompt_format is "
                              "text: set data.prompt_format to chat (or auto, with a model that has a chat template)",
                              keys=("data.prompt_format", "data.env"))
        return self

    @field_validator("reward", "eval_reward")
    @classmethod
    def _check_reward(cls, v: str | None) -> str | None:
        return v if v is None else check_reward_name(v)

    @model_validator(mode="after")
    def _exactly_one_source(self) -> "DataConfig":
        if self.task_options and self.task is None:
            raise ConfigError("data.task_options set the built-in task's settings, and data.task is null: set "
                              "data.task_options to {} to train on data.path", keys=("data.task", "data.task_options"))
        if self.task is not None and self.path is not None:
            raise ConfigError(
                f"data.task ({self.task!r}) and data.path ({self.path!r}) are both set: "
                "set data.task to null to train on the file", keys=("data.task", "data.path"),
            )
        if self.task is None and self.path is None:
            raise ConfigError("data.task and data.path are both null: set one of them", keys=("data.task", "data.path"))
        return self

    @model_validator(mode="after")
    def _exactly_one_reward_form(self) -> "DataConfig":
        if self.env is not None:
            return self._env_scores_alone()
        if self.reward is not None and self.rewards:
            raise ConfigError(f"data.reward ({self.reward!r}) and data.rewards are both set: keep one (data.rewards "
                              "can hold it as {name: ..., weight: 1.0})", keys=("data.reward", "data.rewards"))
        if self.reward is None and not self.rewards:
            raise ConfigError("data.reward is null and data.rewards is empty: set one of them",
                              keys=("data.reward", "data.rewards"))
        names = [spec.name for spec in self.rewards]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ConfigError(f"data.rewards names {repeated} more than once: each reward is logged as "
                              "reward/<name>, so names must differ", keys=("data.rewards",))
        return self

    def _env_scores_alone(self) -> "DataConfig":
        set_ = [k for k in ("reward", "rewards", "eval_reward") if getattr(self, k)]
        if set_:
            raise ConfigError(f"data.env ({self.env!r}) scores its episodes itself: set data.{set_[0]} to null",
                              keys=("data.env", *(f"data.{k}" for k in set_)))
        return self

    @field_validator("env")
    @classmethod
    def _check_env(cls, v: str | None) -> str | None:
        if v is None or (":" not in v and _BUILT_IN_NAME.match(v)):
            return v
        target, _, name = v.rpartition(":")
        if target and _FUNCTION_NAME.match(name):
            return v
        raise ValueError(f"{v!r} is neither a built-in environment name nor 'package.module:Class' or "
                         "'path/to/file.py:Class'")

    def reward_specs(self) -> list[RewardSpec]:
        """The reward terms of the run: data.rewards, or data.reward with weight 1."""
        return list(self.rewards) if self.rewards else [RewardSpec(name=self.reward)]
