"""`graft train` with data and rewards of the user's own: each bad input is one `graft: error:` line and
rc 2 before any engine starts; a reward module in a file outside the package trains on real vLLM."""

import asyncio
import json
import shutil
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from graft.cli import main

REWARDS = textwrap.dedent('''
    import asyncio
    import json

    def topic_words(completion, example):
        """Per completion: logs what it saw, scores the share of words that are the topic's first letter."""
        with open("calls.jsonl", "a") as f:
            f.write(json.dumps({"topic": example.metadata["topic"], "answer": example.answer}) + "\\n")
        words = completion.split()
        return sum(w[:1].lower() == example.metadata["topic"][0] for w in words) / max(len(words), 1)

    async def brevity(completions, examples):
        """Batched and async, as a verifier calling a service would be."""
        await asyncio.sleep(0)
        return [-len(c) / 100 for c in completions]

    def three(completion, example, extra):
        return 0.0
''')


def _data(tmp_path, n=6):
    rows = [{"question": [{"role": "user", "content": f"Count to {i}."}], "target": str(i),
             "topic": ["apples", "boats"][i % 2]} for i in range(n)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:2]), tmp_path / "eval.parquet")
    (tmp_path / "my_reward.py").write_text(REWARDS)


def _train(tmp_path, base_dir, *overrides):
    args = ["train", "-o", f"model.path={base_dir}", "-o", "data.path=train.parquet", "-o",
            "data.eval_path=eval.parquet", "-o", "data.prompt_key=question", "-o", "data.answer_key=target",
            "--run-dir", str(tmp_path / "run")]
    for override in overrides:
        args += ["-o", override]
    return main(args)


@pytest.mark.parametrize("override, error", [
    ("data.reward=no_such_package.rewards:score",
     "data.reward: cannot import 'no_such_package.rewards' (No module named 'no_such_package'); is it installed or "
     "on PYTHONPATH? A file is named as 'path/to/file.py:function'"),
    ("data.reward=my_reward.py:three",
     "data.reward: reward 'my_reward.py:three' has the signature (completion, example, extra); graft calls "
     "fn(completion: str, example: Example) -> float, or batched fn(completions: list[str], examples: "
     "list[Example]) -> list[float] (first parameter named 'completions'); either may be async"),
    ("data.prompt_key=prompt",
     "train.parquet has no column 'prompt' (data.prompt_key); its columns: ['question', 'target', 'topic']"),
    ("data.eval_path=broken.parquet", "broken.parquet: not a readable Parquet file ("),
])
def test_bad_input_is_one_line_and_rc_2_before_any_engine_starts(base_dir, tmp_path, monkeypatch, capsys, override,
                                                                   error):
    monkeypatch.chdir(tmp_path)
    _data(tmp_path)
    (tmp_path / "broken.parquet").write_bytes((tmp_path / "train.parquet").read_bytes()[:-30])
    # The default engine is a vLLM server graft launches: reaching it would take a minute and write RUN_DIR/logs.
    code = _train(tmp_path, base_dir, "data.reward=my_reward.py:topic_words", override)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("graft: error: " + error), err
    assert not (tmp_path / "run" / "logs").exists()


def test_graft_config_resolves_the_rewards_too(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _data(tmp_path)
    assert main(["config", "-o", "data.rewards=[{name: math}, {name: 'my_reward.py:brevity'}]"]) == 0
    assert main(["config", "-o", "data.rewards=[{name: math}, {name: 'my_reward.py:missing'}]"]) == 2
    assert capsys.readouterr().err.strip() == ("graft: error: data.rewards[1].name: my_reward.py has no function "
                                               "'missing' (its functions: ['brevity', 'three', 'topic_words'])")


@pytest.mark.vllm
def test_a_reward_module_outside_the_package_trains_on_real_vllm(vllm_server, base_dir, tmp_path, monkeypatch):
    from graft.rollout.vllm.client import VllmClient

    monkeypatch.chdir(tmp_path)
    _data(tmp_path)
    rewards = "[{name: 'my_reward.py:topic_words', weight: 1.0}, {name: 'my_reward.py:brevity', weight: 0.5}]"
    code = _train(tmp_path, base_dir, f"rollout.urls=[{vllm_server.url}]", f"data.rewards={rewards}",
                  "data.system_prompt=Answer briefly.", "train.steps=2", "train.batch_prompts=2",
                  "rollout.n_samples=4", "rollout.max_new_tokens=6", "lora.rank=8", "rollout.max_lora_rank=8",
                  "train.eval_examples=2")

    async def adapters_left():
        async with VllmClient(vllm_server.url) as client:
            return await client.list_adapters()
    assert asyncio.run(adapters_left()) == []  # the run unloaded every adapter it loaded
    assert code == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["reward_errors"] == 0
        weighted = row["reward/my_reward.py:topic_words"] + 0.5 * row["reward/my_reward.py:brevity"]
        assert row["reward_mean"] == pytest.approx(weighted, abs=1e-6)
        assert row["reward/my_reward.py:brevity"] < 0  # every completion has some text
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    # 2 steps x 2 prompts x 4 samples, plus 2 greedy held-out answers before and after: the eval uses the rewards too.
    assert len(calls) == 2 * 2 * 4 + 2 * 2
    assert {c["topic"] for c in calls} <= {"apples", "boats"} and all(c["answer"].isdigit() for c in calls)


def _template_removed(base_dir, tmp_path, template: str | None):
    """A copy of the tiny model whose tokenizer has no chat template, or `template`."""
    model = Path(shutil.copytree(base_dir, tmp_path / "base-model"))
    (model / "chat_template.jinja").unlink()
    if template is not None:
        (model / "chat_template.jinja").write_text(template)
    return model


@pytest.mark.parametrize("template, error", [
    (None, "its tokenizer has no chat template (a base model?), and data.prompt_format is chat: set "
     "data.prompt_format to text (or auto)"),
    ("{{ raise_exception('roles must alternate') }}",
     "its chat template fails to render a prompt (TemplateError: roles must alternate)"),
])
@pytest.mark.parametrize("command", ["train", "eval"])
def test_a_tokenizer_that_cannot_render_prompts_is_one_line_before_any_engine_starts(base_dir, tmp_path, capsys,
                                                                                      template, error, command):
    model = _template_removed(base_dir, tmp_path, template)
    code = main([command, "-o", f"model.path={model}", "-o", "data.prompt_format=chat",
                 "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(f"graft: error: model.path {model}: " + error), err
    assert not (tmp_path / "run" / "logs").exists()


def test_graft_config_refuses_a_local_model_that_cannot_render_prompts(base_dir, tmp_path, capsys):
    model = _template_removed(base_dir, tmp_path, None)
    assert main(["config", "-o", f"model.path={model}", "-o", "data.prompt_format=chat"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"graft: error: model.path {model}: its tokenizer has no chat"), err
    assert main(["config", "-o", f"model.path={model}"]) == 0  # auto: text prompts
    assert main(["config", "-o", f"model.path={base_dir}", "-o", "rollout.max_new_tokens=2040"]) == 2
    assert "exceed the context of 2048 tokens" in capsys.readouterr().err


@pytest.mark.vllm
def test_a_base_model_trains_on_text_prompts_on_real_vllm(vllm_server, base_dir, tmp_path, monkeypatch):
    """A tokenizer without a chat template, data.prompt_format auto: the same served weights, prompts
    as plain text; the engine and the trainer score the same ids, completions end at the stop string."""
    model = _template_removed(base_dir, tmp_path, None)
    code = main(["train", "-o", f"model.path={model}", "-o", f"rollout.urls=[{vllm_server.url}]",
                 "-o", 'data.prompt_template="Question: {prompt}\\nAnswer:"', "-o", "data.stop=[' ', 'e']",
                 "-o", "train.steps=2", "-o", "train.batch_prompts=2", "-o", "rollout.n_samples=4",
                 "-o", "rollout.max_new_tokens=12", "-o", "lora.rank=8", "-o", "rollout.max_lora_rank=8",
                 "-o", "train.eval_examples=4", "--run-dir", str(tmp_path / "run")])
    assert code == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "logprob_abs_diff_max" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["logprob_abs_diff_max"] < 1e-3 for r in steps), steps  # fp32 both sides: the same ids
    # Stop strings end samples: with a space and 'e' stops, few of the 8 samples a step run to 12 tokens.
    assert all(r["truncated_fraction"] <= 0.5 and r["rollout_tokens"] < 8 * 12 / 2 for r in steps), steps
