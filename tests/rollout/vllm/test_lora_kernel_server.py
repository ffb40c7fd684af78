"""A bf16 vLLM-CPU server as graft launches it serves two adapters and the base at once through
graft's LoRA kernel (graft.rollout.vllm.server.lora_kernel: bf16, one worker thread): each request's
tokens get the log-probs its own policy gives them in transformers, to bf16's noise, which the base
request measures; the other adapter's policy is far off."""

from __future__ import annotations

import asyncio

import pytest
import torch

from graft.lora.adapter_io import save_adapter
from graft.models.loading import load_model
from graft.rollout.engine import GenerateRequest, SamplingParams
from graft.rollout.vllm.client import VllmClient
from graft.rollout.vllm.launcher import VllmServer, VllmServerConfig
from graft.rollout.vllm.server import lora_kernel
from tests.helpers import trained_like_peft_model

PROMPTS_P = [[5, 17, 200, 33, 9], [1, 2, 3], [(7 * i) % 900 + 3 for i in range(40)], [11, 400, 12, 7, 600, 3]]
GREEDY = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def bf16_server(base_dir, tmp_path_factory):
    if lora_kernel.function(torch.bfloat16) is None:
        pytest.skip("graft's bf16 LoRA kernel does not build on this host")
    config = VllmServerConfig(model=str(base_dir), dtype="bfloat16", max_lora_rank=8, max_loras=3,
                              log_dir=tmp_path_factory.mktemp("vllm-bf16-logs"))
    with VllmServer(config) as server:
        yield server


def _teacher_forced(model: torch.nn.Module, prompt: list[int], tokens_T: list[int]) -> list[float]:
    """The log-probs `model` gives `tokens_T` after `prompt`, in fp32."""
    input_ids = torch.tensor([prompt + tokens_T])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=input_ids).logits[0, len(prompt) - 1:-1].float(), -1)
    return logprobs[torch.arange(len(tokens_T)), torch.tensor(tokens_T)].tolist()


def _gap(model: torch.nn.Module, answers_P) -> float:
    """The largest difference between the server's log-probs and `model`'s for the server's tokens."""
    return max(abs(got - want) for prompt, (tokens_T, logprobs_T) in zip(PROMPTS_P, answers_P)
               for got, want in zip(logprobs_T, _teacher_forced(model, prompt, tokens_T)))


def test_two_adapters_and_the_base_at_once_through_the_kernel_match_transformers(bf16_server, base_dir, tmp_path):
    policies = {"kernel-a-v1": trained_like_peft_model(base_dir, rank=8).eval(),
                "kernel-b-v1": trained_like_peft_model(base_dir, rank=4, seed=7).eval()}

    async def greedy(client, adapter):
        outs_P = await client.generate([GenerateRequest(tuple(p), GREEDY) for p in PROMPTS_P], adapter=adapter)
        return [(list(out[0].token_ids), list(out[0].logprobs)) for out in outs_P]

    async def main():
        async with VllmClient(bf16_server.url) as client:
            for name, model in policies.items():
                await client.load_adapter(name, save_adapter(model, tmp_path / name))
            # Concurrent requests share the engine's steps: one step mixes both slots and base tokens.
            return await asyncio.gather(*(greedy(client, name) for name in ("kernel-a-v1", None, "kernel-b-v1") * 2))

    answers = asyncio.run(main())
    base = load_model(base_dir).eval()
    noise = max(_gap(base, answers[1]), _gap(base, answers[4]))  # bf16 serving vs fp32 transformers, no LoRA
    a_gap = max(_gap(policies["kernel-a-v1"], answers[0]), _gap(policies["kernel-a-v1"], answers[3]))
    b_gap = max(_gap(policies["kernel-b-v1"], answers[2]), _gap(policies["kernel-b-v1"], answers[5]))
    crossed = _gap(policies["kernel-b-v1"], answers[0])
    # Measured: noise 0.0035, the adapters 0.0031 and 0.0028, crossed 0.68; the kernel's scale off by
    # 10% gave 0.028 and 0.046.
    tolerance = 2 * noise + 0.01
    assert max(a_gap, b_gap) < tolerance, f"adapters {a_gap:.4f}, {b_gap:.4f}; the base's bf16 noise {noise:.4f}"
    assert crossed > 10 * tolerance, "the adapters barely differ; the test proves nothing"
