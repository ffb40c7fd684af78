"""The RL objective's variants in `train`: ratio level, clipping, KL estimator and placement, mismatch
correction, advantage baseline, DAPO's sampling filters and overlong shaping. Each name is a
registered variant in `graft.rl` (docs/objective.md says what each does and which TRL/verl
setting it corresponds to). The defaults are plain GRPO: none of these keys changes a run that
leaves them out.

`TrainConfig` inherits these fields, so they are set as `train.<key>`.
"""

from typing import Literal

from pydantic import Field, model_validator

from graft.config.base import ConfigError, Section


class ObjectiveFields(Section):
    ratio_level: Literal["token", "sequence"] = Field(
        "token", description="Level of the PPO importance ratio to the old policy: 'token' (PPO/GRPO, each token's "
        "ratio) or 'sequence' (GSPO: exp of the mean token log-ratio of the completion, one ratio per completion, "
        "clipped as a whole; TRL importance_sampling_level=sequence, verl policy_loss.loss_mode=gspo). graft "
        "writes it as GSPO-token: each token's ratio carries that token's own log-prob gradient, where TRL's "
        "carries the completion's mean; with tis_cap or kl_bias_correction (per-token weights) the gradient at "
        "each token's log-prob therefore differs from TRL's, while the loss and each completion's total agree.")
    clip_eps_low: float | None = Field(
        None, gt=0, lt=1, description="Lower clip range: the ratio is clipped below at 1 - clip_eps_low; null = "
        "clip_eps (TRL epsilon, verl clip_ratio_low).")
    clip_eps_high: float | None = Field(
        None, gt=0, description="Upper clip range: the ratio is clipped above at 1 + clip_eps_high; null = clip_eps. "
        "DAPO's clip-higher raises it (0.28 with clip_eps 0.2) so unlikely tokens can grow (TRL epsilon_high, "
        "verl clip_ratio_high).")
    dual_clip_c: float | None = Field(
        None, gt=1, description="Dual-clip PPO: for negative advantages the per-token loss is capped at -c * A, so "
        "a ratio far above 1 cannot blow it up; null = off (verl clip_ratio_c, 3.0 there).")
    kl_estimator: Literal["k1", "k2", "k3", "k3-clamped"] = Field(
        "k3", description="Estimator of the per-token KL to the frozen base when kl_coef > 0: k1 = logp - ref, "
        "k2 = (logp - ref)^2 / 2, k3 = exp(ref - logp) - (ref - logp) - 1, k3-clamped = k3 with the log-ratio in "
        "[-20, 20] and the estimate in [-10, 10]. TRL's k3 is graft's k3; verl's kl_loss_type k1 / k2 are graft's "
        "k1 / k2, and verl's k3 and low_var_kl are both graft's k3-clamped (verl clamps k3 too).")
    kl_bias_correction: bool = Field(
        False, description="Multiply the KL term by the ratio to the old policy, which sampled the tokens "
        "(TRL use_bias_correction_kl); matters with several optimizer steps per batch. Needs kl_coef > 0.")
    loss_norm_tokens: int | None = Field(
        None, ge=1, description="The constant length of loss_agg=seq-mean-token-sum-norm (Dr. GRPO divides each "
        "completion's token sum by it); null = rollout.max_new_tokens (times data.max_turns with data.env).")
    tis_mode: Literal["token-truncate", "token-mask", "sequence-truncate", "sequence-mask"] = Field(
        "token-truncate", description="How tis_cap corrects engine samples: the ratio exp(trainer - engine) of a "
        "token, or of a sequence (geometric mean over its tokens), is truncated at the cap or, over the cap, "
        "masked out of the policy loss (TRL vllm_importance_sampling_mode, whose sequence ratio is the product). "
        "Needs tis_cap.")
    kl_in: Literal["loss", "reward"] = Field(
        "loss", description="Where the KL to the frozen base (kl_coef, kl_estimator) acts: 'loss' (a per-token term of "
        "the loss, GRPO/TRL beta, verl use_kl_loss) or 'reward' (each completion's reward loses kl_coef times the sum "
        "of its tokens' KL estimates between the policy that sampled it and the base, before advantages: PPO/RLHF's "
        "KL penalty, verl algorithm.use_kl_in_reward with a fixed kl_coef). Needs kl_coef > 0.")
    overlong_filter: bool = Field(
        False, description="Leave completions that hit rollout.max_new_tokens (truncated, no end of sequence) out "
        "of the loss; their rewards still count in their group's baseline (DAPO overlong filtering, TRL "
        "mask_truncated_completions).")
    overlong_buffer_tokens: int | None = Field(
        None, ge=1, description="DAPO's soft overlong punishment: a completion longer than rollout.max_new_tokens "
        "minus this many tokens gets overlong_penalty x (excess / buffer) subtracted from its reward, growing "
        "linearly to overlong_penalty at max_new_tokens (verl reward_model.overlong_buffer.len, TRL "
        "get_soft_overlong_punishment's soft_punish_cache); null = off.")
    overlong_penalty: float = Field(
        1.0, gt=0, description="The largest soft overlong punishment (verl overlong_buffer.penalty_factor). Needs "
        "overlong_buffer_tokens.")
    filter_groups: bool = Field(
        False, description="DAPO dynamic sampling: a prompt group whose task rewards are all equal (all right or all "
        "wrong: zero advantage, no learning signal) is dropped and more prompts are sampled with the same policy "
        "version until the batch has train.batch_prompts groups with signal, or max_sampling_rounds rollouts "
        "were made; then the batch is filled with dropped groups (verl algorithm.filter_groups).")
    max_sampling_rounds: int = Field(
        3, ge=1, description="Rollouts of train.batch_prompts prompts per step at most with filter_groups (the first "
        "and the refills; verl max_num_gen_batches). Needs filter_groups.")
    adv_baseline: Literal["mean", "leave-one-out"] = Field(
        "mean", description="Baseline subtracted from each reward: the group mean (GRPO) or the mean of the other "
        "completions of the prompt (RLOO; G/(G-1) times the centred reward; verl adv_estimator=rloo). Combine "
        "leave-one-out with normalize_adv_std false for RLOO proper.")

    @model_validator(mode="after")
    def _check_objective_combinations(self) -> "ObjectiveFields":
        """A variant whose switch is off would be silently ignored: refuse it, naming both keys. (The
        switches, tis_cap, kl_coef and loss_agg, are `TrainConfig`'s own fields.)"""
        # Checked against the defaults, not the keys set: a saved config spells out every default.
        if self.tis_mode != "token-truncate" and self.tis_cap is None:
            raise ConfigError(f"train.tis_mode ({self.tis_mode!r}) has no effect while train.tis_cap is null: "
                              "set train.tis_cap (e.g. 2.0)", keys=("train.tis_mode", "train.tis_cap"))
        for key, default in (("kl_estimator", "k3"), ("kl_bias_correction", False), ("kl_in", "loss")):
            if getattr(self, key) != default and not self.kl_coef:
                raise ConfigError(f"train.{key} has no effect while train.kl_coef is 0 (no KL term): set "
                                  "train.kl_coef > 0", keys=(f"train.{key}", "train.kl_coef"))
        if self.kl_bias_correction and self.kl_in == "reward":
            raise ConfigError("train.kl_bias_correction weighs the KL term of the loss, which train.kl_in=reward "
                              "moves into the reward", keys=("train.kl_bias_correction", "train.kl_in"))
        if self.overlong_penalty != 1.0 and self.overlong_buffer_tokens is None:
            raise ConfigError("train.overlong_penalty has no effect while train.overlong_buffer_tokens is null",
                              keys=("train.overlong_penalty", "train.overlong_buffer_tokens"))
        if self.max_sampling_rounds != 3 and not self.filter_groups:
            raise ConfigError("train.max_sampling_rounds has no effect while train.filter_groups is false",
                              keys=("train.max_sampling_rounds", "train.filter_groups"))
        if self.loss_norm_tokens is not None and self.loss_agg != "seq-mean-token-sum-norm":
            raise ConfigError(f"train.loss_norm_tokens is only used by train.loss_agg=seq-mean-token-sum-norm "
                              f"(got {self.loss_agg!r})", keys=("train.loss_norm_tokens", "train.loss_agg"))
        return self
