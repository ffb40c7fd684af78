"""Run at start-up by every Python process of an SGLang server graft launches (this directory is
first on its PYTHONPATH). Three fixes that let SGLang 0.5.23 serve on a CPU-only torch, and the
owner watchdog; docs/sglang-cpu.md has the evidence for each.

1. SGLang's LoRA code allocates host tensors with `pin_memory=True` unconditionally
   (`sglang/srt/lora/layers.py`, `lora/backend/torch_backend.py`), which CPU-only torch refuses
   ("pin_memory=True requires a CUDA or other accelerator backend"). Pinning only speeds up
   host-to-GPU copies, so without an accelerator the flag is dropped.
2. PyPI's torchvision 0.28.0 is a CUDA build whose C++ ops cannot load next to CPU torch; its
   `_meta_registrations` then registers fake kernels for `torchvision::nms` / `qnms` without the
   guard it uses elsewhere and `import torchvision` fails. Defining those two schemas first lets it
   import (SGLang imports it for multimodal configs; text models never call it).
3. The `sgl_kernel` stand-in beside this file (see its docstring).

Owner watchdog: like graft's vLLM entry point, the server process (and only it: the leader of the
group graft started) stops its whole process group once the process that launched it is gone, also
when that happened before this ran.
"""

import os


def _drop_pin_memory() -> None:
    import functools

    import torch

    if torch.cuda.is_available():
        return

    def drop(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            kwargs.pop("pin_memory", None)
            return fn(*args, **kwargs)
        return inner

    for name in ("tensor", "empty", "zeros", "ones", "arange", "full", "as_tensor"):
        setattr(torch, name, drop(getattr(torch, name)))
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self


def _torchvision_schemas() -> None:
    import torch.library

    lib = torch.library.Library("torchvision", "FRAGMENT")
    for op in ("nms", "qnms"):
        try:
            lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        except RuntimeError:  # a CPU torchvision that loaded its own ops already defined it
            pass
    globals()["_TORCHVISION_LIB"] = lib  # a Library object unregisters its ops when collected


def _watch_owner() -> None:
    import signal
    import subprocess
    import threading
    import time

    owner = os.environ.get("GRAFT_OWNER_PID", "")
    # Only the launched server, leader of its own group (SGLang's processes inherit the variable). An
    # owner that is not our parent already died (SIGKILL during start-up): the loop below ends at once.
    if not owner.isdigit() or os.getpgrp() != os.getpid():
        return

    def watch() -> None:
        while os.getppid() == int(owner):
            time.sleep(0.5)
        group = os.getpgrp()
        subprocess.Popen(["sh", "-c", f"sleep 10; kill -KILL -{group} 2>/dev/null"], start_new_session=True,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.killpg(group, signal.SIGTERM)

    threading.Thread(target=watch, name="graft-owner-watchdog", daemon=True).start()


if os.environ.get("GRAFT_SGLANG_CPU_FIXES") == "1":
    _watch_owner()  # first: the other two import torch, seconds in which the owner may die
    _drop_pin_memory()
    _torchvision_schemas()
