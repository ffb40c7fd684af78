"""How a prompt becomes the token ids a policy completes, and where its completion ends.

Two formats (data.prompt_format): 'chat' renders the prompt's messages through the tokenizer's chat
template, for instruct models; 'text' puts the prompt into a plain-text template
(data.prompt_template) with the special tokens the tokenizer adds on its own (e.g. Gemma's <bos>),
for base models, which have no template and were never trained on chat markup: R1-Zero-style
("zero-RL") runs start that way, TRL calls it the "standard" format. 'auto' picks chat where the
tokenizer has a template. The ids are made once, here, and both the engine that samples and the
trainer that scores log-probs get those same ids, so nothing downstream depends on the format.

Stop strings (data.stop) end a completion where they appear: the engines stop there (the token that
completed one stays in the sampled ids, as vLLM keeps it), and rewards see the text before the first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from transformers import PreTrainedTokenizerBase

from graft.config import DataConfig, GraftConfig
from graft.config.data import PROMPT_PLACEHOLDER
from graft.tasks.examples import Example, render_prompt_ids, shorten


@dataclass(frozen=True)
class PromptFormat:
    """A resolved data.prompt_format: `kind` is never 'auto' here.

    Attributes:
        kind: 'chat' or 'text'.
        template: text prompts: the text around each prompt, `PROMPT_PLACEHOLDER` where it goes.
        stop: strings that end a completion (data.stop).
    """

    kind: Literal["chat", "text"] = "chat"
    template: str = PROMPT_PLACEHOLDER
    stop: tuple[str, ...] = ()

    def ids(self, tokenizer: PreTrainedTokenizerBase, example: Example) -> list[int]:
        """The prompt's token ids as the policy sees them."""
        if self.kind == "chat":
            return render_prompt_ids(tokenizer, example)
        # add_special_tokens: the tokenizer's own bos (Gemma 3 270M is lost without it: perplexity 208 on
        # tests/models' English text, 7.6 with it); a chat template writes its own instead.
        text = self.template.replace(PROMPT_PLACEHOLDER, prompt_text(example))
        return tokenizer.encode(text, add_special_tokens=True)

    def completion_text(self, tokenizer: PreTrainedTokenizerBase, token_ids) -> str:
        """A completion's text as rewards see it: decoded without special tokens, cut before the
        first stop string (the engine stopped at it, but its last token may carry more text)."""
        text = tokenizer.decode(token_ids, skip_special_tokens=True)
        ends = [at for stop in self.stop if (at := text.find(stop)) != -1]
        return text[: min(ends)] if ends else text


LENGTH_CHECKED = 64  # prompts, the longest by characters, whose ids `run_prompt_format` checks fit the context
CHAT = PromptFormat()  # what every caller without a data config (benches, warm-up) renders


def prompt_format(data: DataConfig, tokenizer: PreTrainedTokenizerBase) -> PromptFormat:
    """data.prompt_format resolved against `tokenizer` ('auto': chat where it has a chat template)."""
    kind = data.prompt_format
    if kind == "auto":
        kind = "chat" if getattr(tokenizer, "chat_template", None) else "text"
    return PromptFormat(kind, data.prompt_template or PROMPT_PLACEHOLDER, tuple(data.stop))


def prompt_text(example: Example) -> str:
    """A text prompt: the string, or the content of a prompt that is one user message.

    Raises:
        ValueError: the prompt holds other messages (a system message, several turns): plain text
            has no place for them.
    """
    if isinstance(example.prompt, str):
        return example.prompt
    if len(example.prompt) == 1 and example.prompt[0]["role"] == "user":
        return example.prompt[0]["content"]
    roles = [m["role"] for m in example.prompt]
    raise ValueError(f"text prompts (data.prompt_format) take a string or one user message, and a prompt holds "
                     f"the messages {roles} (data.system_prompt adds a system one): put their text in "
                     "data.prompt_template, or use data.prompt_format: chat with a model that has a chat template")


def check_prompts(tokenizer: PreTrainedTokenizerBase, prompts: PromptFormat, examples: list[Example],
                  model_path, *, episodes: bool = False) -> None:
    """One clear error, before any server starts, when `examples` cannot be rendered: chat prompts on
    a tokenizer without a chat template (a base model; transformers' own message used to end a run
    ~4 minutes in, once vLLM was up) or with one that fails on the first prompt; text prompts that
    are chat messages; multi-turn `episodes` (data.env) without chat.

    Raises:
        ValueError: naming the setting to change.
    """
    if prompts.kind == "text":
        if episodes:
            raise ValueError(f"model.path {model_path}: its tokenizer has no chat template (a base model?), and "
                             "data.env talks to the model in chat turns: use a model that has one, or add a "
                             "'chat_template' to its tokenizer_config.json")
        for example in examples:
            prompt_text(example)
        return
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"model.path {model_path}: its tokenizer has no chat template (a base model?), and "
                         "data.prompt_format is chat: set data.prompt_format to text (or auto) to prompt it in "
                         "plain text, or add a 'chat_template' to its tokenizer_config.json")
    if not examples:
        return
    try:
        render_prompt_ids(tokenizer, examples[0])
    except Exception as error:  # a template's own error (jinja's, or one it raises): told as one line
        raise ValueError(f"model.path {model_path}: its chat template fails to render a prompt "
                         f"({type(error).__name__}: {shorten(str(error), 200)})") from None


def check_model_fits(model_path, tokenizer: PreTrainedTokenizerBase, prompt_ids: dict[int, list[int]],
                     max_new_tokens: int, max_model_len: int | None) -> None:
    """One clear error, before any server starts, when the model cannot take the run's sequences: a
    tokenizer with more tokens than the model has embedding rows (ids past them crash the engine, or
    read another token's row), or a prompt that leaves no room for `max_new_tokens` in the context
    (`max_model_len`, a launched server's, else the model's own). `prompt_ids`: example index -> ids.

    Raises:
        ValueError: naming the numbers and the setting to change.
    """
    from transformers import AutoConfig

    from graft.models.loading import require_model_dir

    model_config = AutoConfig.from_pretrained(require_model_dir(model_path)).get_text_config()
    vocab, tokens = getattr(model_config, "vocab_size", None), len(tokenizer)
    if vocab is not None and tokens > vocab:
        raise ValueError(f"model.path {model_path}: its tokenizer has {tokens} tokens and the model {vocab} "
                         "embedding rows: they are not one model's (a tokenizer from another model?)")
    limits = [n for n in (max_model_len, getattr(model_config, "max_position_embeddings", None)) if n]
    longest = max(prompt_ids, key=lambda i: len(prompt_ids[i]), default=None)
    if not limits or longest is None or len(prompt_ids[longest]) + max_new_tokens <= min(limits):
        return
    raise ValueError(f"model.path {model_path}: the longest prompt ({len(prompt_ids[longest])} tokens, example "
                     f"{longest}) and rollout.max_new_tokens ({max_new_tokens}) exceed the context of "
                     f"{min(limits)} tokens (rollout.max_model_len, or the model's own): lower "
                     "rollout.max_new_tokens, raise rollout.max_model_len up to the model's limit, or shorten prompts")


def run_prompt_format(config: GraftConfig, tokenizer: PreTrainedTokenizerBase,
                      examples: list[Example]) -> PromptFormat:
    """The prompt format of a run on `examples` (train and held-out), checked against the model
    before any server starts (`check_prompts`, and for single-turn runs `check_model_fits`)."""
    prompts = prompt_format(config.data, tokenizer)
    episodes = config.data.env is not None
    check_prompts(tokenizer, prompts, examples, config.model.path, episodes=episodes)
    if not episodes:
        launched = config.rollout.engine != "reference" and not config.rollout.urls
        # The longest prompts by characters, rendered: all of 2,200 arithmetic prompts took 0.4 s
        # through SmolLM2's template, and a user's 100k would take 20 s before a run could start.
        longest = sorted(range(len(examples)), key=lambda i: len(str(examples[i].prompt)))[-LENGTH_CHECKED:]
        check_model_fits(config.model.path, tokenizer, {i: prompts.ids(tokenizer, examples[i]) for i in longest},
                         config.rollout.max_new_tokens, config.rollout.max_model_len if launched else None)
    return prompts
