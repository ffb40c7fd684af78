"""What both sides of `graft bench update` measure, the same way: the model each builds, the clock
around each update, its peak memory, its useful FLOPs and the profiler table.

Imported by graft's measurement process and by `graft.bench.trl.update_worker` (in the TRL
virtualenv, or in graft's own python where TRL is installed there), so it needs nothing but torch,
transformers and `graft.bench.memory_shape`.
"""

from __future__ import annotations

import resource
import time
from pathlib import Path

from graft.bench.memory_shape import build_model

DTYPES = ("float32", "bfloat16")
PROFILE_ROWS = 30


def build_base(spec: dict):
    """The random Qwen2 of `spec` (seed 0, as `graft bench memory` builds it) in `spec["dtype"]`. The
    LoRA both sides attach to it stays fp32 (PEFT upcasts a half-precision adapter)."""
    import torch

    return build_model(spec["dims"], spec["layers"]).to(getattr(torch, spec["dtype"]))


def non_embedding_parameters(model) -> int:
    """The base's parameters less the embedding and the LM head (tied or not) and the adapter."""
    return sum(p.numel() for n, p in model.named_parameters()
               if "embed_tokens" not in n and "lm_head" not in n and ".lora_" not in n)


def useful_flops(spec: dict, non_embedding: int) -> int:
    """FLOPs one update needs, whatever the implementation: forward and input-gradient backward (2 + 2
    per weight per token) of every non-embedding weight over all tokens, and of the LM head over the
    completion tokens (the only positions scored). No recomputation, no frozen-weight gradients, no
    attention scores, no LoRA (under 1% of the weights at r16)."""
    sequences = spec["sequences"]
    tokens = sequences * (spec["prompt_tokens"] + spec["completion_tokens"])
    completion_tokens = sequences * spec["completion_tokens"]
    return 4 * non_embedding * tokens + 4 * spec["dims"]["hidden"] * spec["dims"]["vocab"] * completion_tokens


class UpdateClock:
    """Wall-clock and process CPU seconds of each update (the device synchronized at both ends, so a
    GPU's queued kernels count in the update that launched them) and the peak memory of the timed
    ones: CUDA's `max_memory_allocated` (reset after the warm-up), or on the CPU the resident peak
    (`ru_maxrss`, which never resets: the warm-up has already reached it)."""

    def __init__(self, device: str) -> None:
        import torch

        self.torch = torch
        self.cuda = device.startswith("cuda")
        self.seconds: list[float] = []
        self.cpu_seconds: list[float] = []
        self._start = self._cpu_start = 0.0

    def memory_bytes(self) -> int:
        """Allocated CUDA bytes now, or the process's resident peak so far on the CPU."""
        if self.cuda:
            return self.torch.cuda.memory_allocated()
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def start(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()
            if len(self.seconds) == 1:  # the warm-up is done: the peak of the timed updates only
                self.torch.cuda.reset_peak_memory_stats()
        self._start, self._cpu_start = time.perf_counter(), time.process_time()

    def stop(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()
        self.seconds.append(time.perf_counter() - self._start)
        self.cpu_seconds.append(time.process_time() - self._cpu_start)

    def peak_bytes(self) -> int:
        if self.cuda:
            return self.torch.cuda.max_memory_allocated()
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def result(self, model_bytes: int) -> dict:
        """The timed updates (the first, the warm-up, left out): each one's seconds, and the peak."""
        return {"all_seconds": self.seconds[1:], "all_cpu_seconds": self.cpu_seconds[1:],
                "warmup_seconds": self.seconds[0], "model_bytes": model_bytes, "peak_bytes": self.peak_bytes()}


class UpdateProfile:
    """torch.profiler around one update; writes its operators, `PROFILE_ROWS` of them, by self device
    time on CUDA (self CPU time on the CPU), as a text table."""

    def __init__(self, device: str, path: Path) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.cuda = device.startswith("cuda")
        self.path = path
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.profiler = profile(activities=activities)

    def __enter__(self) -> UpdateProfile:
        self.profiler.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        self.profiler.__exit__(*exc)
        if exc[0] is None:
            sort = "self_device_time_total" if self.cuda else "self_cpu_time_total"
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(self.profiler.key_averages().table(sort_by=sort, row_limit=PROFILE_ROWS) + "\n")
