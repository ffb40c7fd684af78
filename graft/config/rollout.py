"""`rollout:` the inference servers a run samples from: which engine, where (or launched by graft),
what is sampled, how stale a batch may be, and how a launched CPU server uses the cores."""

from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator

from graft.config.base import VLLM_LORA_RANKS, ConfigError, Section, auto_or_count

# rollout.cpu_reserved_cores "auto": generation gets every core from this model size on (measured on
# 2 cores, on-policy: a 25M model's step 10% shorter with every core, a 0.7M model's 12% longer).
AUTO_ALL_CORES_PARAMETERS = 10_000_000


class RolloutConfig(Section):
    engine: Literal["vllm", "sglang", "reference"] = Field(
        "vllm", description="Inference engine that samples rollouts; 'reference' is the in-process HF sampler."
    )
    reference_device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the in-process reference engine (rollout.engine 'reference') runs: 'auto' = the "
        "GPU when torch sees one, else the CPU; 'cuda' fails at startup without a GPU. Other engines ignore it."
    )
    urls: list[str] = Field(
        default_factory=list, description="Base URLs of running inference servers; empty = graft launches its own."
    )
    launch: bool = Field(True, description="Whether graft may start the inference server itself.")
    max_loras: int = Field(4, ge=1, description="Adapter slots on the server (vLLM --max-loras).")
    max_lora_rank: int = Field(16, description="Largest adapter rank the server accepts (vLLM --max-lora-rank).")
    n_samples: int = Field(8, description="Completions sampled per prompt (the group size G), at least 2: "
                           "the advantages compare a prompt's samples with each other.")
    max_new_tokens: int = Field(32, ge=1, description="Maximum tokens generated per completion.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature; 0 = greedy.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    max_staleness: int = Field(
        0, ge=0, description="How many policy versions rollouts may lag the trainer; 0 = fully on-policy."
    )
    cpu_reserved_cores: Literal["auto"] | int = Field(
        "auto", description="vLLM-CPU servers graft launches: cores vLLM keeps for its front end and scheduler, "
        "off generation (VLLM_CPU_NUM_OF_RESERVED_CPU). 'auto': 0 (generation on every core) on-policy "
        "(max_staleness 0, so the trainer is idle while vLLM generates) with a model of at least "
        "10M parameters, else vLLM's own default (1). Measured on 2 cores, on-policy: 0 cut the rollout "
        "of a 25M model from 11.2 to 7.0 s a step (step 27.6 -> 24.8 s) and made a 0.7M model's step "
        "2.31 -> 2.60 s (its generation is not compute-bound). Ignored with a GPU."
    )
    gpu_memory_utilization: Literal["auto"] | float = Field(
        "auto", description="A vLLM server graft launches on a GPU: the fraction of the GPU's memory "
        "it may take (vLLM --gpu-memory-utilization; vLLM refuses to start when less than that is free). 'auto': "
        "90% of what is free when it starts, since the trainer already holds its model on the same GPU (vLLM's "
        "own default, 0.92 of the whole GPU, cannot start beside it). Ignored on the CPU."
    )
    max_model_len: int | None = Field(
        2048, ge=1, description="Context length (prompt + completion tokens) of the server graft launches "
        "(vLLM --max-model-len, SGLang --context-length); null = the model's own limit from its config.json. "
        "Servers at rollout.urls keep their own."
    )

    tensor_parallel_size: int = Field(
        1, ge=1, description="GPUs each vLLM server graft launches splits the model over (vLLM "
        "--tensor-parallel-size); independent of the trainer's dist.tp. Servers at rollout.urls keep their own."
    )

    min_engines: int = Field(
        1, ge=1, description="Fewest live servers a run goes on with: a server of rollout.urls that dies or "
        "freezes is dropped for the rest of the run (its requests retried on the others) while at least this "
        "many stay; below it the run stops. Set it to the number of URLs to stop at the first failure."
    )
    request_timeout_s: float = Field(
        1800.0, gt=0, description="Seconds one generation request (and a base-weight reload) may take at most; a "
        "vLLM generation unanswered for control_timeout_s has the server's health checked, so a frozen server "
        "fails it well before this ceiling."
    )
    control_timeout_s: float = Field(
        30.0, gt=0, description="Seconds an adapter load/unload, model list or health call may take; also how "
        "long a generation waits unanswered before the server's health is probed. A frozen server is noticed "
        "within it (generation: within twice it). Keep it above 20 for SGLang, whose /health generates a token."
    )
    api_key: SecretStr | None = Field(
        None, description="API key of the servers (vLLM/SGLang --api-key), sent as 'Authorization: Bearer'. "
        "Discouraged: it is then in your config file; prefer rollout.api_key_env. Never printed or saved."
    )
    api_key_env: str | None = Field(
        "VLLM_API_KEY", description="Name of the environment variable holding the servers' API key, read when "
        "the run opens its engines (unset or empty: no key). The default is the variable vLLM itself reads, so "
        "a server graft launches with it set and graft's requests agree."
    )

    @field_validator("n_samples")
    @classmethod
    def _check_n_samples(cls, v: int) -> int:
        if v < 2:  # TRL's GRPOTrainer refuses num_generations < 2 too
            raise ValueError(f"must be at least 2: the advantages compare a prompt's samples with each other, and "
                             f"a group of one gets advantage 0, so the run would learn nothing (got {v})")
        return v

    @field_validator("cpu_reserved_cores", mode="before")
    @classmethod
    def _check_cpu_reserved_cores(cls, v: Any) -> Any:
        return auto_or_count(v)

    @field_validator("gpu_memory_utilization", mode="before")
    @classmethod
    def _check_gpu_memory_utilization(cls, v: Any) -> Any:
        if v == "auto" or (isinstance(v, int | float) and not isinstance(v, bool) and 0 < v <= 1):
            return v
        raise ValueError(f"must be 'auto' or a fraction in (0, 1] (got {v!r})")

    def resolved_cpu_reserved_cores(self, model_parameters: int) -> int | None:
        """Cores a launched vLLM-CPU server keeps off generation; None = vLLM's default (see the field)."""
        if self.cpu_reserved_cores != "auto":
            return self.cpu_reserved_cores
        return 0 if self.max_staleness == 0 and model_parameters >= AUTO_ALL_CORES_PARAMETERS else None

    @model_validator(mode="after")
    def _check_failover(self) -> "RolloutConfig":
        engines = max(len(self.urls), 1)
        if self.min_engines > engines:
            launched = "" if self.urls else ", or the one graft launches"
            raise ConfigError(f"rollout.min_engines ({self.min_engines}) exceeds the number of servers ({engines}: "
                              f"{len(self.urls)} in rollout.urls{launched})",
                              keys=("rollout.min_engines", "rollout.urls"))
        return self

    @model_validator(mode="after")
    def _check_one_key_source(self) -> "RolloutConfig":
        if self.api_key is not None and self.api_key_env is not None and "api_key_env" in self.model_fields_set:
            raise ConfigError("rollout.api_key and rollout.api_key_env are both set: keep one (api_key_env is "
                              "better: the key then stays out of config files)", keys=("rollout.api_key",
                                                                                      "rollout.api_key_env"))
        return self

    @field_validator("max_lora_rank")
    @classmethod
    def _check_max_lora_rank(cls, v: int) -> int:
        if v not in VLLM_LORA_RANKS:
            raise ValueError(f"must be one of {', '.join(map(str, VLLM_LORA_RANKS))} (vLLM's allowed values), got {v}")
        return v

    @field_validator("urls")
    @classmethod
    def _check_urls(cls, v: list[str]) -> list[str]:
        """At config load, not at the first request: a URL without a scheme is a common slip."""
        for url in v:
            parts = urlsplit(url)
            try:
                parts.port  # noqa: B018 -- raises on a port that is not a number
            except ValueError:
                raise ValueError(f"{url!r} has a port that is not a number") from None
            if parts.scheme not in ("http", "https") or not parts.hostname:
                hint = f" (did you mean 'http://{url}'?)" if "://" not in url else ""
                raise ValueError(f"{url!r} is not an http:// or https:// URL with a host{hint}")
        return v

    @model_validator(mode="after")
    def _check_completions_fit(self) -> "RolloutConfig":
        """A completion longer than the launched server's context would fail every request."""
        if self.engine != "reference" and not self.urls and self.max_model_len is not None \
                and self.max_new_tokens >= self.max_model_len:
            raise ConfigError(f"rollout.max_new_tokens ({self.max_new_tokens}) leaves no room for the prompt in "
                              f"rollout.max_model_len ({self.max_model_len}): raise rollout.max_model_len "
                              "(or set it to null for the model's own limit)",
                              keys=("rollout.max_new_tokens", "rollout.max_model_len"))
        return self
