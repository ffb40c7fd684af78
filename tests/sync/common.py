"""Helpers the sync tests share: a recording fake engine and an AdapterSync built on it, and the
greedy probe of the tests against the real vLLM server."""

import asyncio

import httpx

from graft.rollout.engine import (
    AdapterAlreadyLoadedError,
    Completion,
    EngineHealth,
    EngineUnavailableError,
    GenerateRequest,
    SamplingParams,
    UnknownAdapterError,
)
from graft.sync.adapter import AdapterSync, adapter_name, adapter_version
from graft.sync.inflight import InFlightVersions
from graft.sync.publish import WeightPublisher
from tests.helpers import is_peft_adapter

GREEDY = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
PROMPTS = [(5, 17, 200, 33, 9), tuple(range(10, 50))]  # the second spans several KV blocks
FP32_TOLERANCE = 1e-3


async def greedy(engine, adapter=None):
    out = await engine.generate([GenerateRequest(p, GREEDY) for p in PROMPTS], adapter=adapter)
    return [c[0].token_ids for c in out]


def run(coroutine):
    return asyncio.run(coroutine)


class RecordingEngine:
    """A RolloutEngine that keeps adapters in a dict, records the loaded set after every load and
    unload (`history`), fails the next `fail_unloads` unloads with a 500, and serves `generate`
    only while the named adapter stays loaded for the whole request."""

    address = "fake"

    def __init__(self, others: tuple[str, ...] = ()) -> None:
        self.adapters: dict[str, str] = dict.fromkeys(others, "/elsewhere")
        self.history: list[frozenset[str]] = []
        self.calls: list[str] = []
        self.fail_unloads = 0
        self.generate_s = 0.0

    def graft_adapters(self, lora_name: str = "graft") -> set[str]:
        return {n for n in self.adapters if adapter_version(lora_name, n) is not None}

    async def load_adapter(self, name: str, path: str) -> None:
        await asyncio.sleep(0.001)  # an engine call takes time: other tasks run meanwhile
        assert is_peft_adapter(path), path
        if name in self.adapters:
            raise AdapterAlreadyLoadedError(f"The lora adapter '{name}' has already been loaded.", status=400)
        self.adapters[name] = path
        self.calls.append(f"load {name}")
        self.history.append(frozenset(self.adapters))

    async def unload_adapter(self, name: str) -> None:
        await asyncio.sleep(0.001)
        if self.fail_unloads:
            self.fail_unloads -= 1
            raise EngineUnavailableError("Internal Server Error: unload exploded", address=self.address, status=500)
        if name not in self.adapters:
            raise UnknownAdapterError(f"The lora adapter '{name}' cannot be found.", address=self.address, status=404)
        del self.adapters[name]
        self.calls.append(f"unload {name}")
        self.history.append(frozenset(self.adapters))

    async def list_adapters(self) -> list[str]:
        return list(self.adapters)

    async def adapter_paths(self) -> dict[str, str]:
        return dict(self.adapters)

    async def generate(self, requests: list[GenerateRequest], adapter: str | None = None) -> list[list[Completion]]:
        for _ in range(2):  # the adapter must be there when the request starts and when it ends
            if adapter is not None and adapter not in self.adapters:
                raise UnknownAdapterError(f"The model `{adapter}` does not exist.", address=self.address, status=404)
            await asyncio.sleep(self.generate_s)
        return [[Completion((1,), (0.0,), "length")] for _ in requests]

    async def reload_weights(self, path: str) -> None:
        raise NotImplementedError

    async def health(self) -> EngineHealth:
        return EngineHealth(self.address, True, tuple(self.adapters))


def make_sync(engine, tmp_path, *, keep: int, max_loras: int = 4, lora_name: str = "graft", disk_keep: int = 0,
              transport: str = "disk", keep_on_disk: bool = False):
    inflight = InFlightVersions()
    publisher = WeightPublisher(tmp_path / "weights", keep_versions=disk_keep)
    sync = AdapterSync(engine, publisher, lora_name=lora_name, keep_versions=keep, max_loras=max_loras,
                       inflight=inflight, transport=transport, keep_on_disk=keep_on_disk)
    return sync, inflight, publisher


async def served_version(served: list[int], version: int, timeout: float = 60.0) -> None:
    """Wait until a concurrent generate loop has finished a request on `version`.

    Syncing the next version only after that keeps generation running alongside every sync however
    slow the engine's requests are (CI's SGLang once served 11 requests over 12 fast syncs).
    """
    async with asyncio.timeout(timeout):
        while not served or served[-1] < version:
            await asyncio.sleep(0.01)


def current_adapter(sync: AdapterSync) -> str | None:
    """The adapter name requests must use now (None before the first sync and after close)."""
    version = sync.current_version
    return None if version is None else sync.request_adapter(version)


def names(versions, lora_name: str = "graft") -> set[str]:
    return {adapter_name(lora_name, v) for v in versions}


async def staged_labels(url: str) -> list[list[str]]:
    """What each worker of the vLLM server at `url` holds staged for memory loads (graft's worker
    extension; the session server has the dev endpoints that `/collective_rpc` needs)."""
    async with httpx.AsyncClient() as http:
        answer = await http.post(url + "/collective_rpc", json={"method": "graft_staged_labels"})
    return answer.json()["results"]
