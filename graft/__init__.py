"""graft: reinforcement-learning post-training of LLMs with a LoRA adapter on a frozen base model.

Shape suffixes, one legend for the whole package: a tensor's (or nested list's) name ends with its
dimensions in order, so ``logprobs_BT`` is ``[B, T]`` and ``adv_B1`` is ``[B, 1]``.

- ``P`` prompts; ``G`` the samples of one prompt (the GRPO group); ``E`` episodes (multi-turn).
- ``B`` batch rows, one sequence each; ``T`` token positions of a row; ``C`` completion tokens of a
  row (as many as the batch's longest completion); ``K`` the positions the LM head scores.
- ``R`` packed rows, several sequences back to back in each; ``L`` token positions of a packed row;
  ``N`` items flattened into one dimension (packed tokens, rows x positions, measured points); ``M`` a
  subset of them (one adapter's tokens).
- ``V`` vocabulary; ``H`` hidden size; ``I``/``O`` input/output features of a LoRA matrix; ``S`` an
  inference engine's adapter slots.
- A digit is a dimension of that size; a lowercase ``x`` stands for whichever leading dimensions
  (``_xT``: a padded ``[B, T]`` or a packed ``[R, L]`` batch). ``lora_A``/``lora_B`` are PEFT's
  names, not shapes.
"""

__version__ = "0.1.0"
