"""The module graft starts vLLM's OpenAI API server through: vLLM's own entry point, with a
50 ms instead of a 1 s busy-wait in its processes after every engine step.

vLLM's shared-memory queue readers (engine core <-> worker) spin in a sched_yield loop for 1 s
after each read before they sleep on a socket (`shm_broadcast.SpinCondition`, busy_loop_s=1). On
a machine with few cores that takes a whole core from the trainer right after every rollout, sync
and verification: measured on 2 cores, a 2-thread matmul started right after a request ran 4x
slower than one started a second later. A short spin still covers back-to-back decode steps.

A sleeping reader can miss a wake-up; vLLM then rechecks after 5 s (measured: with no spin at all,
steps stalled in multiples of 5 s). The recheck interval drops to 10 ms, so a missed wake-up costs
at most that.

Its LoRA matmuls are grouped by adapter (graft.rollout.vllm.server.lora_cpu), an adapter's
prefix-cache blocks are keyed by its load, not its name and path alone, so that a name loaded again
is never served KV its earlier weights computed (graft.rollout.vllm.server.versions.key_lora_blocks_by_load),
and its API server gets graft's batch route (graft.rollout.vllm.server.batch_route) and its route that loads adapters
from memory (graft.rollout.vllm.server.lora_memory).

Which of these patches a server gets is decided in one place, `PATCHES`, by the platform vLLM
itself reports (`serving_device`: "cpu" or `current_platform.device_type`, "cuda" on a CUDA build):
the busy-wait and the LoRA ops are vLLM-CPU's only; the routes (the HTTP front end's) are installed
everywhere, as is the prefix-cache key where the vLLM needs it. The API server says once in its log
what it installed and what it skipped.

The patches are installed at module top level: a child started with the `spawn` method (vLLM-CPU's
own, and a CUDA vLLM's) imports the main module (this one) again as `__mp_main__`; a forked one
(vLLM-CPU under graft, `fork_start`) inherits them from the API server.

The server also never outlives the process that launched it: `VllmServer` names itself in
`GRAFT_OWNER_PID`, and a watchdog thread in the API server stops the whole process group once that
process is gone (killed with SIGKILL or by the OOM killer, so no `stop()` ran: the server was then
re-parented and went on holding ~3 GB). SIGTERM first, SIGKILL after `OWNER_GONE_GRACE_S` for
whatever is left, from a helper outside the group that the SIGTERM cannot stop.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

BUSY_LOOP_S = 0.05
RECHECK_INTERVAL_MS = 10
OWNER_POLL_S = 0.5
OWNER_GONE_GRACE_S = 10


# Run outside the group: after argv[1] seconds, SIGKILL every process whose environment holds argv[2].
_KILL_CARRIERS_LATER = """
import os, signal, sys, time
time.sleep(float(sys.argv[1]))
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        with open(f"/proc/{pid}/environ", "rb") as environ:
            if sys.argv[2].encode() in environ.read().split(b"\\0"):
                os.kill(int(pid), signal.SIGKILL)
    except OSError:
        pass
"""


def _stop_group_when_owner_exits(owner_pid: int) -> None:
    """Poll our parent; once it is no longer `owner_pid` (it died and we were re-parented), stop
    this process group: SIGTERM now, SIGKILL after the grace period, from outside the group, to
    whatever carries this launch's `SERVER_ID_ENV` token — by then the group's id may belong to
    another group (pid reuse; see `VllmServer._signal_group`)."""
    from graft.rollout.process_group import SERVER_ID_ENV

    while os.getppid() == owner_pid:
        time.sleep(OWNER_POLL_S)
    group, token = os.getpgrp(), os.environ.get(SERVER_ID_ENV)
    if token:
        command = [sys.executable, "-c", _KILL_CARRIERS_LATER, str(OWNER_GONE_GRACE_S), f"{SERVER_ID_ENV}={token}"]
    else:  # not launched by VllmServer: the group as a whole
        command = ["sh", "-c", f"sleep {OWNER_GONE_GRACE_S}; kill -KILL -{group} 2>/dev/null"]
    subprocess.Popen(command, start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, env={k: v for k, v in os.environ.items() if k != SERVER_ID_ENV})
    os.killpg(group, signal.SIGTERM)


def watch_owner() -> threading.Thread | None:
    """Start the owner watchdog in the server a launcher started: the leader of its own process group
    (`start_new_session`), named owner in `OWNER_ENV`. An owner that is no longer our parent died
    before the watch began (a SIGKILL in the first seconds of start-up): the group stops at once.
    vLLM's own processes inherit the variable but lead no group, and never watch."""
    from graft.rollout.process_group import OWNER_ENV

    owner = os.environ.get(OWNER_ENV, "")
    if not owner.isdigit() or os.getpgrp() != os.getpid():
        return None
    thread = threading.Thread(target=_stop_group_when_owner_exits, args=(int(owner),), name="graft-owner-watchdog",
                              daemon=True)
    thread.start()
    return thread


# Before anything heavy: vLLM's imports take > 6 s on 2 loaded cores, a window in which a launcher
# killed by SIGKILL would otherwise leave a server that finishes starting and serves on, unowned.
if __name__ == "__main__":
    watch_owner()

from graft.rollout.vllm.server import fork_start, lora_cpu  # noqa: E402  (imports torch: after the watch starts)
from graft.rollout.vllm.server.batch_route import add_batch_route, patch_build_app  # noqa: E402
from graft.rollout.vllm.server.lora_memory import add_memory_route  # noqa: E402
from graft.rollout.vllm.server.versions import key_lora_blocks_by_load, run_api_server  # noqa: E402


def _shorter_busy_wait() -> bool:
    try:
        from vllm.distributed.device_communicators import shm_broadcast
    except ImportError:  # an engine build without it: nothing to change
        return False
    condition = getattr(shm_broadcast, "SpinCondition", None)
    # Only the version we measured: (busy_loop_s=1,) and a module-level recheck interval.
    if condition is None or condition.__init__.__defaults__ != (1,) or \
            not hasattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS"):
        return False
    condition.__init__.__defaults__ = (BUSY_LOOP_S,)
    shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = RECHECK_INTERVAL_MS
    return True


@dataclass(frozen=True)
class Patch:
    """One change graft makes to the vLLM it launches.

    Attributes:
        devices: The vLLM platforms (`serving_device()`) it is installed on: where its reason holds.
        install: Installs it; False where it stays out (another vLLM version, turned off).
        api_server_only: Installed in the API server alone, not in the engine core and workers.
    """

    devices: tuple[str, ...]
    install: Callable[[], bool]
    api_server_only: bool = False


def _batch_route() -> bool:
    patch_build_app(add_batch_route)
    return True


def _memory_adapters() -> bool:
    patch_build_app(add_memory_route)
    return True


PATCHES: dict[str, Patch] = {
    # vLLM-CPU always runs its worker in its own process behind the shared-memory queue (it turns the
    # "uni" executor into "mp", vllm/platforms/cpu.py), and its spin costs one of a few cores. On
    # CUDA one GPU runs the in-process "uni" executor (vllm/config/parallel.py) and GPU machines have
    # cores to spare: vLLM's own 1 s spin stays, as vLLM tuned it.
    "short_busy_wait": Patch(("cpu",), _shorter_busy_wait),
    # Replaces vLLM's PyTorch-native punica ops, which only vLLM-CPU runs (CpuPlatform's punica
    # wrapper, vllm/lora/punica_wrapper/punica_cpu.py); CUDA's is punica_gpu.py, Triton kernels
    # that never call them (vllm/platforms/cuda.py, get_punica_wrapper).
    "lora_cpu": Patch(("cpu",), lora_cpu.install),
    # The prefix cache's key (engine core): an adapter's blocks keyed by its load (name, path, load id),
    # not its name alone (vLLM 0.20) or name and path (0.32), on every device; where vLLM's key holds the
    # load already, not installed.
    "lora_block_keys": Patch(("cpu", "cuda"), key_lora_blocks_by_load),
    # vLLM-CPU spawns its engine core and worker; forked, a start takes 11 s instead of 24 on 2 cores
    # (graft.rollout.vllm.server.fork_start). In the API server, whose children inherit the patches.
    "fork_start": Patch(("cpu",), fork_start.install, api_server_only=True),
    # The HTTP front end only (FastAPI app, CompletionRequest, the completion handler): no device code.
    "batch_route": Patch(("cpu", "cuda"), _batch_route, api_server_only=True),
    # The route that loads an adapter from a blob instead of a directory (graft.rollout.vllm.server.lora_memory):
    # HTTP front end plus vLLM's worker-extension hook, both device-independent (the LoRA is built
    # on the CPU, as vLLM's own disk load builds it, then copied into the device's slots).
    "memory_adapters": Patch(("cpu", "cuda"), _memory_adapters, api_server_only=True),
}


def serving_device() -> str:
    """The platform this vLLM build runs on, as vLLM reports it: "cpu" for vLLM-CPU (any of its CPU
    platforms), else `current_platform.device_type` ("cuda" for a CUDA or ROCm build)."""
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else current_platform.device_type


def select_patches(device: str) -> tuple[list[str], list[str]]:
    """The names of `PATCHES` installed on `device`, and those skipped there."""
    chosen = [name for name, patch in PATCHES.items() if device in patch.devices]
    return chosen, [name for name in PATCHES if name not in chosen]


def install_patches(device: str, *, api_server: bool) -> list[str]:
    """Install the patches `device` gets, those of the API server only when `api_server`; the names
    of those that went in."""
    chosen, _ = select_patches(device)
    return [name for name in chosen if PATCHES[name].api_server_only == api_server and PATCHES[name].install()]


def patches_line(device: str, installed: list[str]) -> str:
    """The one log line saying what this server got: installed, kept as vLLM's own, skipped on `device`."""
    chosen, skipped = select_patches(device)
    kept = [name for name in chosen if name not in installed]
    line = f"graft patches applied: {', '.join(installed) or 'none'}"
    if kept:
        line += f"; not installed (another vLLM version, or turned off): {', '.join(kept)}"
    return line + f"; skipped on {device}: {', '.join(skipped) or 'none'}"


def graft_modules_line() -> str:
    """The one log line naming the graft modules this process has imported (this one is `__main__`):
    its own package, the adapter blob format, the process-group names and the kernel cache's
    directory. Through the launcher's environment-variable names it once imported graft.config,
    pydantic and 28 graft modules; the test suite counts them here, in a real server
    (tests/rollout/vllm/server/test_entry.py)."""
    loaded = sorted(name for name in sys.modules if name == "graft" or name.startswith("graft."))
    return f"graft modules loaded: {len(loaded)} ({', '.join(loaded)})"


if __name__ in ("__main__", "__mp_main__"):  # the server and its spawned children, not an import
    _DEVICE = serving_device()
    _INSTALLED = install_patches(_DEVICE, api_server=False)

if __name__ == "__main__":
    _INSTALLED += install_patches(_DEVICE, api_server=True)
    print(patches_line(_DEVICE, _INSTALLED), file=sys.stderr, flush=True)
    print(graft_modules_line(), file=sys.stderr, flush=True)  # vLLM's processes are forked or spawned from here
    run_api_server()
