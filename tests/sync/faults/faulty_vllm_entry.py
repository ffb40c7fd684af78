"""A vLLM API server entry with graft's own patches plus test faults: delivery failures that real
engines have shown, reproduced inside the server by a patched hook, so that graft's delivery check
meets them as it would in production (no mocked engine).

`python -m tests.sync.faults.faulty_vllm_entry <vLLM's arguments>` runs as graft's entry module
(graft.rollout.vllm.server.entry) runs: the owner watchdog first, graft's `PATCHES` in the API server
and in every child vLLM spawns (which imports this module as `__mp_main__`), then vLLM's `main`.
After graft's patches, the faults named in `FAULT_ENV` (comma-separated names of `FAULTS`) go in,
in vLLM's children (engine core and worker): in each spawned child, or, where graft forks them
(`fork_start`), in the API server before they fork from it. Each process that installed them says so
in the log. An unknown name, or a fault that cannot go in, stops the server at start-up.

Faults that change an adapter's weights apply only to adapters whose name starts with
`FAULTY_PREFIX`, and vLLM's own prefix-cache key only to those whose name starts with `PLAIN_PREFIX`,
so that one server can carry several faults that do not interfere.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable

FAULT_ENV = "GRAFT_TEST_FAULT"
FAULTY_PREFIX = "faulty"
PLAIN_PREFIX = "plain"

if __name__ == "__main__":  # before vLLM's imports, as graft's entry module does
    from graft.rollout.vllm.server.entry import watch_owner

    watch_owner()


def _scale_lora_b_again() -> bool:
    """SkyRL #2250: vLLM folds the LoRA scaling into lora_B in place (`LoRALayerWeights.optimize`), so
    a LoRA rebuilt from tensors an earlier build already scaled is scaled twice. Here every build of an
    adapter named `FAULTY_PREFIX...` (from disk, or from graft's memory route) hands vLLM lora_B
    times the adapter's scaling, which `optimize` then multiplies by the scaling once more."""
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager

    from graft.rollout.vllm.server import lora_memory

    def scaled_again(lora, request):
        if request.lora_name.startswith(FAULTY_PREFIX):
            for weights in lora.loras.values():
                weights.lora_b = weights.lora_b * weights.scaling
        return lora

    load_from_disk, build_from_memory = LRUCacheWorkerLoRAManager._load_adapter, lora_memory.build_lora
    LRUCacheWorkerLoRAManager._load_adapter = lambda self, request: scaled_again(load_from_disk(self, request),
                                                                                 request)
    lora_memory.build_lora = lambda manager, request, blob: scaled_again(build_from_memory(manager, request, blob),
                                                                         request)
    return True


def _no_lora_reads_the_last_slot() -> bool:
    """graft's grouped LoRA ops before they gave tokens without an adapter (index -1) no LoRA: such a
    token read slot -1, the last one, so a base-model request decoded with the adapter held in slot
    `max_loras - 1`. Needs graft's ops installed (vLLM-CPU, `GRAFT_VLLM_LORA_OPS` not "vllm")."""
    import torch
    from vllm.lora.ops.torch_ops import lora_ops

    from graft.rollout.vllm.server import lora_cpu

    if lora_ops.bgmv_shrink is not lora_cpu.bgmv_shrink:  # graft's ops are not in place: nothing to undo
        return False

    def lora_matvec(inputs_NI, weights_SOI, indices_N, dtype):
        if weights_SOI.dim() == 4:
            weights_SOI = weights_SOI.squeeze(1)
        inputs_NI = inputs_NI.to(dtype)
        slots = torch.unique(indices_N)
        if slots.numel() == 1:
            return inputs_NI @ weights_SOI[slots[0]].to(dtype).T
        outputs_NO = inputs_NI.new_empty(inputs_NI.shape[0], weights_SOI.shape[1])
        for slot in slots:
            rows = indices_N == slot
            outputs_NO[rows] = inputs_NI[rows] @ weights_SOI[slot].to(dtype).T
        return outputs_NO

    lora_cpu.lora_matvec = lora_matvec  # the bgmv ops look it up in their module at each call
    # The linear layers' one-shrink-one-expand path (lora_cpu_linear) never calls the ops: put vLLM's
    # own add_lora_linear back, which reaches the ops above slice by slice, as before that path.
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    from graft.rollout.vllm.server import lora_cpu_linear

    PunicaWrapperCPU.add_lora_linear = lora_cpu_linear.VLLM_ADD_LORA_LINEAR
    return True


def _prompt_logprobs_without_lm_head_lora() -> bool:
    """vLLM #51594: prompt log-probs are computed without the lm_head LoRA delta, while sampled tokens'
    log-probs keep it. Here the model runner's prompt-logprob pass projects through the base lm_head."""
    from vllm.lora.layers.logits_processor import LogitsProcessorWithLoRA
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    in_prompt_pass = threading.local()
    with_lora, prompt_logprobs = LogitsProcessorWithLoRA._get_logits, GPUModelRunner._get_prompt_logprobs_dict

    def get_logits(self, hidden_states, lm_head, *args, **kwargs):  # vLLM 0.32 added `skip_gather`
        if not getattr(in_prompt_pass, "on", False):
            return with_lora(self, hidden_states, lm_head, *args, **kwargs)
        return self.base_layer._get_logits(hidden_states, getattr(lm_head, "base_layer", lm_head), *args, **kwargs)

    def prompt_logprobs_dict(self, *args, **kwargs):
        in_prompt_pass.on = True
        try:
            return prompt_logprobs(self, *args, **kwargs)
        finally:
            in_prompt_pass.on = False

    LogitsProcessorWithLoRA._get_logits = get_logits
    GPUModelRunner._get_prompt_logprobs_dict = prompt_logprobs_dict
    return True


def _vllm_block_keys() -> bool:
    """A server graft did not start: the prefix-cache blocks of adapters named `PLAIN_PREFIX...` keyed
    as the vLLM itself keys them (by name and path on vLLM 0.32), not by the load (graft's
    `lora_block_keys` patch), so that tests meet what `vllm serve` does."""
    from vllm.v1.core import kv_cache_utils

    graft_keys = kv_cache_utils._gen_lora_extra_hash_keys
    vllm_keys = getattr(graft_keys, "vllm_keys", None)
    if vllm_keys is None:  # graft's patch is not in place
        return False

    def keys(request) -> list:
        lora = request.lora_request
        return (vllm_keys if lora and lora.lora_name.startswith(PLAIN_PREFIX) else graft_keys)(request)

    kv_cache_utils._gen_lora_extra_hash_keys = keys
    return True


# name -> installer, run in each of vLLM's children (engine core and worker: every fault here is in
# the engine's LoRA build, model runner or prefix cache); False where it cannot go in (a vLLM without the
# hooked code).
FAULTS: dict[str, Callable[[], bool]] = {
    "lora_b_scaled_twice": _scale_lora_b_again,
    "no_lora_reads_last_slot": _no_lora_reads_the_last_slot,
    "prompt_logprobs_without_lm_head_lora": _prompt_logprobs_without_lm_head_lora,
    "vllm_block_keys": _vllm_block_keys,
}


def requested_faults() -> list[str]:
    """The fault names in `FAULT_ENV`, in order.

    Raises:
        SystemExit: a name that is not in `FAULTS`.
    """
    names = [name.strip() for name in os.environ.get(FAULT_ENV, "").split(",") if name.strip()]
    unknown = [name for name in names if name not in FAULTS]
    if unknown:
        raise SystemExit(f"{FAULT_ENV}: unknown fault(s) {unknown}; known: {sorted(FAULTS)}")
    return names


def install_faults() -> list[str]:
    """Install the requested faults in this process; their names.

    Raises:
        SystemExit: a requested fault could not be installed (the test would otherwise pass vacuously).
    """
    for name in (names := requested_faults()):
        if not FAULTS[name]():
            raise SystemExit(f"test fault {name!r} could not be installed in this vLLM")
    return names


def faults_line(installed: list[str], *, forked: bool = False) -> str:
    """The log line saying which faults a process of the engine got (`forked`: the processes that
    fork from this one)."""
    where = f"engine processes forked from {os.getpid()}" if forked else f"engine process {os.getpid()}"
    return f"graft test faults installed in {where}: {', '.join(installed) or 'none'}"


if __name__ in ("__main__", "__mp_main__"):  # the server and its spawned children, not an import
    from graft.rollout.vllm.server.entry import install_patches, patches_line, serving_device

    _DEVICE = serving_device()
    _INSTALLED = install_patches(_DEVICE, api_server=False)

if __name__ == "__mp_main__":
    print(faults_line(install_faults()), file=sys.stderr, flush=True)

if __name__ == "__main__":
    from graft.rollout.vllm.server.versions import run_api_server

    _INSTALLED += install_patches(_DEVICE, api_server=True)
    print(patches_line(_DEVICE, _INSTALLED), file=sys.stderr, flush=True)
    print(f"graft test faults requested: {', '.join(requested_faults()) or 'none'}", file=sys.stderr, flush=True)
    if "fork_start" in _INSTALLED:  # the engine core and worker fork from here: they inherit the faults
        print(faults_line(install_faults(), forked=True), file=sys.stderr, flush=True)
    run_api_server()
