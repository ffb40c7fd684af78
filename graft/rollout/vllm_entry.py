"""The module graft starts vLLM's OpenAI API server through: vLLM's own entry point, without the
one-second busy-wait its processes do after every engine step.

vLLM's shared-memory queue readers (engine core <-> worker) spin in a sched_yield loop for 1 s
after each read before they sleep on a socket (`shm_broadcast.SpinCondition`, busy_loop_s=1). On
a machine with few cores that takes a whole core from the trainer right after every rollout, sync
and verification: measured on 2 cores, a 2-thread matmul started right after a request ran 4x
slower than one started a second later. Here readers sleep on the socket at once; the writer
notifies on every write, so no message waits longer than a socket wake-up.

The patch sits at module top level because vLLM starts its engine core and workers with the
`spawn` method on CPU, which imports the main module (this one) in every child.
"""

from __future__ import annotations


def _readers_sleep_at_once() -> None:
    try:
        from vllm.distributed.device_communicators import shm_broadcast
    except ImportError:  # an engine build without it: nothing to change
        return
    condition = getattr(shm_broadcast, "SpinCondition", None)
    if condition is not None and condition.__init__.__defaults__ == (1,):  # (busy_loop_s=1,): the version we know
        condition.__init__.__defaults__ = (0,)


_readers_sleep_at_once()

if __name__ == "__main__":
    from vllm.entrypoints.launchers.api_server.entry import main

    main()
