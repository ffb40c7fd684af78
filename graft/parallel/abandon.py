"""Cutting a policy's forward and backward passes short at a decoder layer's edge, for a run that stops.

Why: a stopped run must be gone within seconds (Slurm sends SIGKILL 30 s after SIGTERM, docker 10 s),
and one micro-batch of an update is two long calls into torch. Measured on SmolLM2-135M (2 cores,
the smollm2 quickstart's 64 sequences): its forward ran ~15 s and its backward ~10 s, and a
SIGTERM'd `graft train` sat in `ThreadPoolExecutor.shutdown` waiting for the update on its model
thread, exiting 31 s after the signal. With a check at every decoder layer, forward and backward, the
update ends within one layer's work (~0.5 s there).

`stop_points(model)` installs the checks once per model and returns the event that fires them: set it
and the next layer boundary raises `Abandoned`. An update cut short is never used: the run that set
the event publishes and checkpoints nothing after it, so the checkpoint on disk and the served
version stay those of the last whole step. On the main thread (a follower rank, a bench's update) the
same hooks are also where a pending signal handler gets to run: the backward pass is C++ that runs no
Python bytecode otherwise, so Ctrl-C or SIGTERM waited for its end (measured on SmolLM2, 4 x 256
tokens: the handler ran 12.1 s after a signal sent 0.5 s into the backward, 2.0 s with the hooks).
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from graft.parallel.parallelize import decoder_layers

_ATTRIBUTE = "graft_stop_points"


class Abandoned(Exception):
    """A forward or backward pass of a policy whose run is stopping was cut short at a layer's edge."""


def stop_points(model: nn.Module) -> threading.Event:
    """The event that stops `model`'s passes at the next decoder layer (forward or backward), its
    hooks installed on the first call. Once, not per update: `train.compile` compiles each layer's
    call with its hooks, and hooks registered anew would compile it again."""
    event = getattr(model, _ATTRIBUTE, None)
    if event is not None:
        return event
    event = threading.Event()

    # Outside torch.compile's graph: the check must run at every call, not once while tracing.
    @torch._dynamo.disable
    def check(*_) -> None:
        if event.is_set():
            raise Abandoned("the run is stopping: this pass of the policy was cut short")

    @torch._dynamo.disable
    def check_backward(_module, _inputs, output) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(check)  # runs when the backward pass reaches this layer

    for layer in decoder_layers(model) or [model]:
        layer.register_forward_pre_hook(check)
        layer.register_forward_hook(check_backward)
    object.__setattr__(model, _ATTRIBUTE, event)  # a plain attribute: not a submodule, not in the state dict
    return event
