"""Helpers the sync tests against the real vLLM server share."""

from graft.rollout.engine import GenerateRequest, SamplingParams

GREEDY = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
PROMPTS = [(5, 17, 200, 33, 9), tuple(range(10, 50))]  # the second spans several KV blocks
FP32_TOLERANCE = 1e-3


async def greedy(engine, adapter=None):
    out = await engine.generate([GenerateRequest(p, GREEDY) for p in PROMPTS], adapter=adapter)
    return [c[0].token_ids for c in out]
