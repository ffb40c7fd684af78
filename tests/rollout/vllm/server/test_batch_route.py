"""graft's batch route (graft.rollout.vllm.server.batch_route) through `VllmClient`: a step's requests in one
call, in order, each prompt with its own seed; on a mock transport, then on the session's real
vLLM server (where it must sample exactly what one `/v1/completions` call per prompt does).

Suffixes: `_P` one entry per prompt.
"""

from __future__ import annotations

import json

import httpx
import pytest

from graft.rollout.engine import GenerateRequest, SamplingParams, UnknownAdapterError
from graft.rollout.http_util import server_message
from graft.rollout.vllm.client import VllmClient, completion_payload
from tests.rollout.vllm.test_client import LOGPROB_ATOL, PROMPTS_P, _choice, _mock_client, run


def test_a_batch_goes_in_one_call_in_order_with_each_prompts_own_seed():
    bodies = []

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/graft/completions"
        payloads = json.loads(request.content)["requests"]
        bodies.append(payloads)
        return httpx.Response(200, json={"responses": [
            {"choices": [_choice(0, [p["prompt"][0], p["seed"]], [-0.1, -0.2])]} for p in payloads]})

    requests = [GenerateRequest((i,), SamplingParams(seed=100 + i)) for i in (7, 3, 5)]
    out_P = run(_mock_client(handler, model="m").generate(requests, adapter="policy-v2"))
    assert [out[0].token_ids for out in out_P] == [(7, 107), (3, 103), (5, 105)]
    assert len(bodies) == 1 and [p["model"] for p in bodies[0]] == ["policy-v2"] * 3
    assert bodies[0] == [completion_payload(r, "policy-v2") for r in requests]


def test_an_error_in_a_batch_is_the_typed_error_of_its_request():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, json={"error": {"message": "The model `gone-v1` does not exist.", "code": 404}})

    with pytest.raises(UnknownAdapterError, match="gone-v1"):
        run(_mock_client(handler, model="m").generate([GenerateRequest((1,)), GenerateRequest((2,))], "gone-v1"))


class _InFlightCounter(httpx.AsyncBaseTransport):
    """A real HTTP transport that records the paths it was asked for and the most requests it had
    in flight at once; with `hide_batch_route` it answers the batch route as a vLLM not started by
    graft does (404 Not Found)."""

    def __init__(self, hide_batch_route: bool = False) -> None:
        self._inner = httpx.AsyncHTTPTransport()
        self.hide_batch_route = hide_batch_route
        self.now = self.peak = 0
        self.paths: list[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(request.url.path)
        if self.hide_batch_route and request.url.path == "/v1/graft/completions":
            return httpx.Response(404, json={"detail": "Not Found"})
        self.now += 1
        self.peak = max(self.peak, self.now)
        try:  # non-streaming completions: the headers come once generation is done
            return await self._inner.handle_async_request(request)
        finally:
            self.now -= 1

    async def aclose(self) -> None:
        await self._inner.aclose()


def _tokens_P(out_P) -> list[list[tuple[int, ...]]]:
    return [[c.token_ids for c in out] for out in out_P]


@pytest.mark.vllm
def test_a_batch_in_one_call_samples_as_one_call_per_prompt_with_its_own_seed(vllm_server):
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=12)
    # Prompt p seeded seed + p * n, as build_rollout_batch does; the last two prompts are equal.
    prompts_P = [*PROMPTS_P, PROMPTS_P[0]]
    requests = [GenerateRequest(tuple(p), SamplingParams(**{**params.__dict__, "seed": 1234 + i * params.n}))
                for i, p in enumerate(prompts_P)]
    batched, per_prompt = _InFlightCounter(), _InFlightCounter(hide_batch_route=True)

    async def main():
        async with VllmClient(vllm_server.url, transport=batched) as client:
            first_P = await client.generate(requests)
            again_P = await client.generate(requests)
        async with VllmClient(vllm_server.url, max_concurrency=2, transport=per_prompt) as client:
            separate_P = await client.generate(requests)
        return first_P, again_P, separate_P

    first_P, again_P, separate_P = run(main())
    assert batched.paths.count("/v1/graft/completions") == 2 and "/v1/completions" not in batched.paths
    assert per_prompt.paths.count("/v1/completions") == len(requests) and per_prompt.peak == 2
    for out in first_P:
        assert len(out) == 4
        for completion in out:
            assert 1 <= len(completion.token_ids) == len(completion.logprobs) <= params.max_new_tokens
            assert completion.finish_reason in {"stop", "length"} and all(lp <= 0 for lp in completion.logprobs)
    assert _tokens_P(first_P) == _tokens_P(again_P), "the same seeds gave different samples"
    assert _tokens_P(first_P) == _tokens_P(separate_P), "the batch route samples differently from /v1/completions"
    for batch_out, separate_out in zip(first_P, separate_P):
        for a, b in zip(batch_out, separate_out):
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= LOGPROB_ATOL
    assert any(len(set(out)) > 1 for out in _tokens_P(first_P)), "the n samples are all identical"
    assert _tokens_P(first_P)[0] != _tokens_P(first_P)[-1], "an equal prompt with other seeds drew the same samples"


@pytest.mark.vllm
def test_the_batch_route_refuses_malformed_batches_with_400(vllm_server):
    for body in ({}, {"requests": []}, {"requests": [{"model": "m", "prompt": [1], "max_tokens": "many"}]},
                 {"requests": [{"model": "m", "prompt": [1], "stream": True}]}):
        response = httpx.post(f"{vllm_server.url}/v1/graft/completions", json=body, timeout=30)
        assert response.status_code == 400, (body, response.text)
        assert server_message(response.text)
