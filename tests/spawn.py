"""`spawn_ranks`: `torch.multiprocessing.spawn` for the tests' CPU process groups, without the
interpreter's native teardown in the ranks.

Measured on a 2-core AVX-512 machine (torch 2.13, gloo): in about 1 of 10 runs of a multi-spawn
test, a rank that had finished (its results written, its process group destroyed) aborted in the
interpreter's native teardown ("terminate called without an active exception", SIGABRT; faulthandler
showed no Python frame left). It happened in tests/parallel/test_parallelize_tp.py and
tests/lora/test_adapter_io_fsdp.py. Each rank here leaves with `os._exit(0)` once its function has
returned. An exception in the function still propagates as before.
"""

import os
import sys

import torch.multiprocessing as mp


def spawn_ranks(fn, args: tuple, nprocs: int) -> None:
    """`fn(rank, *args)` on `nprocs` spawned ranks; waits for all, raises if any failed."""
    mp.spawn(_run_then_exit, args=(fn, *args), nprocs=nprocs, join=True)


def _run_then_exit(rank: int, fn, *args) -> None:
    fn(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
