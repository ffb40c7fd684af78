"""A small byte-level BPE tokenizer trained locally on a built-in corpus.

There is no model hub here, so the tiny models carry their own tokenizer. The corpus is generated in
code from a fixed seed (arithmetic questions and answers, short English sentences, chat turns), so the
same ``vocab_size`` always gives a byte-identical ``tokenizer.json``. Digits are split one per token
before BPE runs, so numbers never merge: the later GRPO task is arithmetic and the policy should see
"168" as "1", "6", "8".

Determinism: the trainer breaks ties between equally frequent pairs by token id, and byte-level BPE
assigns ids in a fixed order (sorted alphabet, then merges). The known non-determinism of the
`tokenizers` trainers (huggingface/tokenizers#1794: ids of continuing-subword tokens taken from
hash-map order) needs a ``continuing_subword_prefix``, which we do not use. Measured: the same
``tokenizer.json`` from 6 processes with different hash seeds, with and without
``TOKENIZERS_PARALLELISM``.
"""

import json
import random
from collections.abc import Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]

# ChatML, as used by Qwen: every turn is "<|im_start|>{role}\n{content}<|im_end|>\n"; the generation
# prompt opens an assistant turn and the model ends its answer with <|im_end|> (the eos token).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

_ADJECTIVES = [
    "red", "green", "blue", "yellow", "small", "large", "old", "young", "happy", "quiet", "bright",
    "dark", "heavy", "light", "warm", "cold", "fresh", "empty", "wooden", "famous", "strange",
    "gentle", "clever", "brave", "careful", "simple", "difficult", "beautiful", "ancient", "modern",
    "friendly", "hungry", "tired", "curious", "purple", "golden", "silver", "narrow", "wide", "busy",
]
_NOUNS = [
    "cat", "dog", "bird", "horse", "mouse", "friend", "teacher", "student", "farmer", "doctor",
    "king", "queen", "child", "robot", "baker", "brother", "sister", "neighbour", "pilot", "writer",
    "box", "apple", "book", "room", "river", "star", "table", "bread", "house", "ball", "garden",
    "letter", "question", "answer", "train", "flower", "village", "coat", "window", "map", "mountain",
    "island", "forest", "bridge", "castle", "kitchen", "market", "library", "computer", "picture",
    "song", "story", "machine", "bottle", "chair", "door", "road", "city", "school", "ocean",
    "engine", "planet", "rocket", "pencil", "paper", "shadow", "cloud", "number", "problem", "lesson",
    "family", "mother", "father", "daughter", "uncle", "captain", "sailor", "painter", "singer",
    "player", "puzzle", "secret", "treasure", "journey", "holiday", "museum", "hospital", "airport",
    "station", "street", "valley", "desert", "lake", "field", "tree", "stone", "mirror", "candle",
    "basket", "blanket", "pocket", "ticket", "button", "kettle", "lantern", "violin", "tower",
]
_ADVERBS = [
    "quickly", "slowly", "carefully", "quietly", "happily", "suddenly", "finally", "always", "never",
    "often", "sometimes", "really", "almost", "together", "already", "probably", "certainly",
    "usually", "rarely", "gently", "proudly", "patiently", "secretly", "loudly", "politely",
]
_VERBS = [
    "found", "likes", "wanted", "carried", "painted", "opened", "counted", "remembered", "bought",
    "cleaned", "watched", "followed", "built", "answered", "explained", "moved", "learned", "helped",
    "visited", "closed", "checked", "wrote", "read", "saw", "made", "gave", "took", "kept", "noticed",
    "described", "forgot", "repaired", "discovered", "measured", "borrowed", "climbed", "crossed",
    "imagined", "protected", "collected", "finished", "started", "studied", "touched", "washed",
]
_ENDINGS = [
    "", " yesterday", " this morning", " after school", " in the park", " near the sea",
    " before dinner", " with great care", " again", " for the first time", " at night",
    " because it was raining", " while everyone slept", " on a sunny day", " without a word",
    " during the winter", " every weekend", " last summer", " in the evening", " once more",
]
_NUMBER_WORDS = [
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
    "twelve", "twenty", "thirty", "forty", "fifty", "hundred", "thousand", "million",
]
_QUESTIONS = [
    "What is {a} {op} {b}?", "Compute {a} {op} {b}.", "Calculate {a} {op} {b}.",
    "What do you get for {a} {op} {b}?", "Please solve {a} {op} {b}.", "{a} {op} {b} = ?",
]
_CHAT_USER = [
    "Hello! Can you help me with a question?", "Thank you very much.", "Please explain your answer.",
    "Is that correct?", "How are you today?", "Tell me a short story.", "What time is it?",
    "Give me the final answer only.", "Why is the sky blue?", "Can you check my work?",
]
_CHAT_ASSISTANT = [
    "Of course, I would be happy to help.", "You are welcome.", "Sure, let me explain step by step.",
    "Yes, that is correct.", "I am doing well, thank you.", "Once upon a time, there was a small cat.",
    "I do not have a clock, sorry.", "The answer is", "Sunlight is scattered by the air.",
    "Let me check it carefully.",
]
_SYSTEM = ["You are a helpful assistant.", "Answer with a single number.", "Think step by step."]


def _arithmetic(rng: random.Random) -> tuple[str, str]:
    op = rng.choice("+-*")
    a = rng.randint(0, 10 ** rng.randint(1, 4))
    b = rng.randint(0, 10 ** rng.randint(1, 3))
    result = {"+": a + b, "-": a - b, "*": a * b}[op]
    return rng.choice(_QUESTIONS).format(a=a, op=op, b=b), str(result)


def _noun_phrase(rng: random.Random) -> str:
    article = rng.choice(["the", "a", "my", "our", "that", "every", rng.choice(_NUMBER_WORDS)])
    return f"{article} {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}"


def _sentence(rng: random.Random) -> str:
    adverb = rng.choice(["", "", rng.choice(_ADVERBS) + " "])
    text = f"{_noun_phrase(rng)} {adverb}{rng.choice(_VERBS)} {_noun_phrase(rng)}{rng.choice(_ENDINGS)}."
    return text[0].upper() + text[1:]


def _corpus(seed: int = 0) -> Iterator[str]:
    """Yields the training texts, always the same ones for a seed.

    Chat turns are yielded as the text between the special tokens: the trainer does not split on
    special tokens, so including them literally would spend merges on pieces like "<|im".
    """
    rng = random.Random(seed)
    for _ in range(3000):
        question, answer = _arithmetic(rng)
        yield f"{question} {answer}"
        yield f"{question}\nThe answer is {answer}."
    for _ in range(3000):
        yield " ".join(_sentence(rng) for _ in range(rng.randint(1, 3)))
    for _ in range(1500):
        question, answer = _arithmetic(rng)
        yield f"system\n{rng.choice(_SYSTEM)}"
        yield f"user\n{rng.choice([question, rng.choice(_CHAT_USER)])}"
        yield f"assistant\n{rng.choice([answer, rng.choice(_CHAT_ASSISTANT) + ' ' + answer])}"
        yield "\n"


def train_tokenizer(vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """Trains the project's byte-level BPE tokenizer on the built-in corpus.

    Args:
        vocab_size: Size of the vocabulary, special tokens included. Must leave room for the 256
            byte tokens and the 3 special tokens.

    Returns:
        A fast tokenizer with pad (and bos) ``<|endoftext|>``, eos ``<|im_end|>`` and a ChatML chat
        template; ``encode`` adds no special tokens. Any text round-trips
        (``decode(encode(text)) == text``). The vocabulary stops growing when the corpus has no
        pairs left to merge (at about 1180 tokens), so a larger ``vocab_size`` gives a smaller
        ``len(tokenizer)``.

    Raises:
        ValueError: If ``vocab_size`` is too small to hold the byte alphabet and special tokens.
    """
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size={vocab_size} is too small: it must be at least "
            f"{len(alphabet) + len(SPECIAL_TOKENS)} (256 bytes + {len(SPECIAL_TOKENS)} special tokens)"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=PAD_TOKEN,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )


def pad_vocabulary(tokenizer: PreTrainedTokenizerFast, size: int) -> PreTrainedTokenizerFast:
    """``tokenizer`` with filler tokens ``<|filler_N|>`` appended until ``len(tokenizer) == size``.

    The built-in corpus stops BPE at about 1180 tokens; a model of a real vocabulary (e.g. 151,936)
    samples every id, and an inference server must decode each one. The fillers are ordinary
    vocabulary entries no merge produces, so encoding is unchanged and every id decodes.

    Raises:
        ValueError: If ``size`` is below the tokenizer's current size.
    """
    if size < len(tokenizer):
        raise ValueError(f"cannot pad a vocabulary of {len(tokenizer)} tokens down to {size}")
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    first = max(vocab.values()) + 1
    assert first == len(tokenizer), "special tokens are expected inside the BPE vocabulary"
    vocab.update({f"<|filler_{i}|>": i for i in range(first, size)})
    padded = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                     **{k: v for k, v in tokenizer.init_kwargs.items() if k != "tokenizer_object"})
    return padded
