"""A published version read after the model moved on (graft.sync.source.SnapshotSource): its reads see
the version's LoRA values, run as jobs of the model's owner, and leave the live values bit-exact."""

import asyncio

import torch

from graft.lora.attach import lora_parameters
from graft.sync.source import ModelSource, SnapshotSource
from tests.helpers import trained_like_peft_model

PROMPT, COMPLETION = [5, 6, 7, 8], [9, 10, 11]


def test_a_snapshot_reads_the_published_version_and_restores_the_live_one(base_dir):
    model = trained_like_peft_model(base_dir, rank=8, seed=6)
    published = ModelSource(model).logprobs(PROMPT, COMPLETION)
    jobs = []

    async def run(job):  # the model's owner: here, a record of each job it ran
        jobs.append(job)
        return job()

    snapshot = SnapshotSource(model, run)
    with torch.no_grad():  # the next update
        for param in lora_parameters(model).values():
            param.mul_(1.5).add_(0.01)
    live = {name: param.detach().clone() for name, param in lora_parameters(model).items()}
    moved = ModelSource(model).logprobs(PROMPT, COMPLETION)
    assert max(abs(a - b) for a, b in zip(moved, published)) > 1e-3

    read = asyncio.run(snapshot.read(lambda: snapshot.logprobs(PROMPT, COMPLETION)))
    assert read == published and len(jobs) == 1
    assert all(torch.equal(param, live[name]) for name, param in lora_parameters(model).items())
    assert ModelSource(model).logprobs(PROMPT, COMPLETION) == moved
