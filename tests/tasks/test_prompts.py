"""Prompt formats: chat through the template, text through data.prompt_template with the tokenizer's own
special tokens, stop strings that end what a reward sees, and the checks a run makes before any server
starts (a chat run on a base model, chat messages as text, episodes without chat, a tokenizer that is
not the model's, prompts longer than the context)."""

import json
import shutil
from pathlib import Path

import pytest

from graft.config import ConfigError, GraftConfig
from graft.config.data import DataConfig
from graft.models.tokenizer import train_tokenizer
from graft.tasks import Example, render_prompt_ids
from graft.tasks.prompts import (
    PromptFormat,
    check_model_fits,
    check_prompts,
    prompt_format,
    prompt_text,
    run_prompt_format,
)

QUESTION = Example("What is 23 + 58?", "81")


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


@pytest.fixture
def base_tokenizer():
    """The tiny tokenizer as a base model's: no chat template, a bos added on encode (as Gemma's)."""
    tokenizer = train_tokenizer()
    tokenizer.chat_template = None
    tokenizer.add_bos_token = True
    return tokenizer


def test_auto_is_chat_where_the_tokenizer_has_a_template_and_text_where_it_has_none(tokenizer, base_tokenizer):
    data = DataConfig(prompt_template="Q: {prompt}\nA:", stop=["\n"])
    assert prompt_format(data, tokenizer).kind == "chat"
    assert prompt_format(data, base_tokenizer) == PromptFormat("text", "Q: {prompt}\nA:", ("\n",))
    assert prompt_format(DataConfig(prompt_format="chat"), base_tokenizer).kind == "chat"  # as told: checked later
    assert prompt_format(DataConfig(prompt_format="text"), tokenizer) == PromptFormat("text")


def test_text_prompts_are_the_template_with_the_tokenizers_own_special_tokens_and_no_chat_markup(base_tokenizer):
    ids = PromptFormat("text", "Question: {prompt}\nAnswer:").ids(base_tokenizer, QUESTION)
    assert ids[0] == base_tokenizer.bos_token_id and ids.count(base_tokenizer.bos_token_id) == 1
    assert base_tokenizer.decode(ids[1:]) == "Question: What is 23 + 58?\nAnswer:"
    assert base_tokenizer.convert_tokens_to_ids("<|im_start|>") not in ids
    # A prompt of one user message is its text; the default template is the prompt alone.
    one_message = Example([{"role": "user", "content": "What is 23 + 58?"}], "81")
    assert PromptFormat("text").ids(base_tokenizer, one_message) == base_tokenizer.encode("What is 23 + 58?")


def test_chat_prompts_are_the_templates(tokenizer):
    assert PromptFormat().ids(tokenizer, QUESTION) == render_prompt_ids(tokenizer, QUESTION)


def test_a_reward_sees_the_text_before_the_first_stop_string(tokenizer):
    ids = tokenizer.encode(" 81\nQuestion: 2 + 2 END more", add_special_tokens=False)
    assert PromptFormat("text", stop=("END", "\n")).completion_text(tokenizer, ids) == " 81"
    assert PromptFormat("text", stop=("END",)).completion_text(tokenizer, ids) == " 81\nQuestion: 2 + 2 "
    assert PromptFormat("text").completion_text(tokenizer, ids) == " 81\nQuestion: 2 + 2 END more"


def test_chat_messages_beyond_one_user_turn_are_refused_as_text():
    system = Example([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}], "4")
    with pytest.raises(ValueError, match=r"take a string or one user message, and a prompt holds the messages "
                                         r"\['system', 'user'\] \(data.system_prompt adds a system one\)"):
        prompt_text(system)


def test_check_prompts_names_the_setting_to_change(tokenizer, base_tokenizer):
    with pytest.raises(ValueError, match="has no chat template .* and data.prompt_format is chat: set "
                                         "data.prompt_format to text"):
        check_prompts(base_tokenizer, PromptFormat("chat"), [QUESTION], "m")
    with pytest.raises(ValueError, match="data.env talks to the model in chat turns"):
        check_prompts(base_tokenizer, PromptFormat("text"), [QUESTION], "m", episodes=True)
    messages = Example([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], "")
    with pytest.raises(ValueError, match="text prompts"):
        check_prompts(base_tokenizer, PromptFormat("text"), [QUESTION, messages], "m")  # any example, not the first
    check_prompts(tokenizer, PromptFormat("chat"), [QUESTION, messages], "m")
    check_prompts(base_tokenizer, PromptFormat("text"), [QUESTION], "m")


def _with_config(base_dir, tmp_path, **changes) -> Path:
    model = Path(shutil.copytree(base_dir, tmp_path / "model"))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **changes}))
    return model


def test_a_tokenizer_with_more_tokens_than_the_model_has_rows_is_refused(base_dir, tmp_path, tokenizer):
    model = _with_config(base_dir, tmp_path, vocab_size=len(tokenizer) - 1)
    with pytest.raises(ValueError, match=f"its tokenizer has {len(tokenizer)} tokens and the model "
                                         f"{len(tokenizer) - 1} embedding rows"):
        check_model_fits(model, tokenizer, {0: [1, 2]}, 8, None)
    check_model_fits(_with_config(base_dir, tmp_path / "more", vocab_size=len(tokenizer) + 64), tokenizer,
                     {0: [1, 2]}, 8, None)  # padded embeddings, as many models ship them, are fine


def test_a_prompt_leaving_no_room_for_the_completion_is_refused(base_dir, tmp_path, tokenizer):
    model = _with_config(base_dir, tmp_path, max_position_embeddings=64)
    prompts = {0: [1] * 10, 1: [1] * 40, 2: [1] * 20}
    check_model_fits(model, tokenizer, prompts, 24, None)  # 40 + 24 = 64: fits
    with pytest.raises(ValueError, match=r"the longest prompt \(40 tokens, example 1\) and rollout.max_new_tokens "
                                         r"\(25\) exceed the context of 64 tokens"):
        check_model_fits(model, tokenizer, prompts, 25, None)
    with pytest.raises(ValueError, match="exceed the context of 50 tokens"):
        check_model_fits(model, tokenizer, prompts, 11, 50)  # a launched server's smaller limit counts


def test_a_run_resolves_and_checks_its_prompts_in_one_call(base_dir):
    config = GraftConfig.model_validate({"model": {"path": str(base_dir)}, "rollout": {"max_new_tokens": 16}})
    assert run_prompt_format(config, train_tokenizer(), [QUESTION]).kind == "chat"
    long = Example("9 " * 3000, "")
    with pytest.raises(ValueError, match="exceed the context of 2048 tokens"):
        run_prompt_format(config, train_tokenizer(), [QUESTION, long])


@pytest.mark.parametrize("data, error", [
    ({"prompt_template": "Question: {question}"}, "must hold {prompt} once"),
    ({"prompt_template": "{prompt} {prompt}"}, "must hold {prompt} once"),
    ({"prompt_format": "chat", "prompt_template": "Q: {prompt}"}, "data.prompt_template is for text prompts"),
    ({"prompt_format": "text", "env": "calculator", "reward": None}, "data.env ('calculator') talks to the model"),
    ({"stop": ["\n", ""]}, "an empty stop string"),
    ({"prompt_format": "plain"}, "'auto', 'chat' or 'text'"),
])
def test_prompt_settings_are_checked_with_the_config(data, error):
    with pytest.raises((ConfigError, ValueError), match=error.replace("(", r"\(").replace(")", r"\)")):
        GraftConfig.model_validate({"data": data})
