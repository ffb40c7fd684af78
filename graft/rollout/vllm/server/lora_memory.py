"""Adapters that reach vLLM's workers from the trainer's memory, with no file: `POST /v1/graft/load_lora_adapter`.

vLLM loads a LoRA adapter only from a directory (`/v1/load_lora_adapter` -> engine `add_lora` ->
worker `LRUCacheWorkerLoRAManager._load_adapter`, which reads `adapter_config.json` and
`adapter_model.safetensors`), and reads it again from there whenever the adapter was evicted from
its CPU cache and a request names it. This route takes the adapter as one blob
(graft.rollout.adapter_blob: safetensors with the PEFT config in its metadata) in a shared-memory
segment of the same host (`?shm=<segment>`), or in the request body (put into a segment here), and
asks vLLM's own `load_lora_adapter` to load it from `memory_path(label, segment)`. That path names
no file: the label is unique per version (vLLM's prefix-cache key is (name, path)) and the segment
says where the bytes are. In each worker the hooked `_load_adapter` (installed once per server by
`MemoryAdapterWorker.graft_load_from_memory`) opens such a segment at the first load, keeps it open
while the adapter is registered, and builds the LoRA from a fresh copy-on-write map of it, through
vLLM's own config validation, name mapping and module checks; any other path loads from disk as
before. No extra call reaches the engine: the blob travels inside vLLM's own `add_lora`.

So every later step is vLLM's own: the name registry, the API key (the route is under /v1), the
unload route (patched to close the segment too), `/v1/models` (whose `root` shows the path). A
reload after an LRU eviction maps the segment again: the tensors are never the ones an earlier load
scaled in place (`LoRALayerWeights.optimize`), so any number of evictions serves the same weights.

The workers get the methods through vLLM's `--worker-extension-cls` (the launcher passes
`WORKER_EXTENSION`); a server without it answers this route with 501, and clients fall back to disk.

(No `from __future__ import annotations` here: FastAPI resolves the route's `Request` annotation at
registration, and the name lives inside `add_memory_route`, not in this module's globals.)
"""

import asyncio
import os
import re

from graft.rollout.adapter_blob import (
    SEGMENT_RE,
    BlobError,
    blob_config,
    blob_tensors,
    map_copy_on_write,
    new_segment,
    open_segment,
)
from graft.rollout.vllm.server.versions import error_response_class

ROUTE = "/v1/graft/load_lora_adapter"
WORKER_EXTENSION = "graft.rollout.vllm.server.lora_memory.MemoryAdapterWorker"
_MEMORY_PATH_RE = re.compile(rf"(?P<label>.*)#(?P<segment>{SEGMENT_RE.pattern})")


def memory_path(label: str, segment: str) -> str:
    """The `lora_path` vLLM registers a memory adapter under: `<label>#<segment>`."""
    return f"{label}#{segment}"


def memory_segment(path: str) -> str | None:
    """The segment a `memory_path` names; None for any other path (a directory to load from disk)."""
    match = _MEMORY_PATH_RE.fullmatch(path)
    return match["segment"] if match else None


# -- worker side ----------------------------------------------------------------------------------

class StagedAdapters:
    """One worker's open segments (memory path -> descriptor), and the hook that loads from them,
    installed on its LoRA manager instance once: `_load_adapter` builds a memory path's LoRA from its
    segment (opened at the first load, kept open while the adapter is registered: a one-off segment's
    name is gone by then), and loads any other path from disk as vLLM does."""

    def __init__(self, manager) -> None:
        self.segments: dict[str, int] = {}
        load_from_disk = manager._load_adapter

        def load_adapter(request):
            segment = memory_segment(request.lora_path)
            if segment is None:
                return load_from_disk(request)
            fd = self.segments.get(request.lora_path)
            if fd is None:
                fd = self.segments[request.lora_path] = open_segment(segment)
            return build_lora(manager, request, map_copy_on_write(fd))

        manager._load_adapter = load_adapter

    @classmethod
    def of(cls, manager) -> "StagedAdapters":
        staged = getattr(manager, "_graft_staged", None)
        if staged is None:
            staged = manager._graft_staged = cls(manager)
        return staged

    def drop(self, path: str) -> bool:
        fd = self.segments.pop(path, None)
        if fd is not None:
            os.close(fd)
        return fd is not None


def expected_modules(adapters) -> set[str]:
    """The module names an adapter may target on this model (as vLLM's `_load_adapter` computes them)."""
    expected: set[str] = set()
    for module in adapters.supported_lora_modules:
        expected.update(adapters.packed_modules_mapping.get(module, [module]))
        if module == "experts":
            expected.add(module)
    return expected


def check_modules(names, expected: set[str], modules_to_save, mapper, skip_prefixes, label: str) -> None:
    """vLLM's check of a checkpoint's tensor names against the model's LoRA modules (the one in
    `LoRAModel.from_local_checkpoint`): an adapter for another architecture is refused by name."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.utils import is_base_embedding_weights, parse_fine_tuned_lora_name

    unexpected = []
    for name in names:
        if is_base_embedding_weights(name) or "base_layer" in name or \
                (skip_prefixes and LoRAModel._should_skip_module(name, skip_prefixes)):
            continue
        module, _ = parse_fine_tuned_lora_name(name, mapper)
        if ".experts" in module:
            if module[module.find(".experts") + 1:] not in expected:
                unexpected.append(module)
        elif module.rsplit(".", 1)[-1] not in expected and module.rsplit(".", 1)[-1] not in (modules_to_save or ()):
            unexpected.append(module)
    if unexpected:
        raise ValueError(f"While loading {label}, expected target modules in {expected} but received {unexpected}. "
                         "Please verify that the loaded LoRA module is correct")


def build_lora(manager, request, blob):
    """The LoRAModel of a blob, built as vLLM's `_load_adapter` builds one from a directory: same config
    validation (`PEFTHelper.validate_legal`), name mapping, module checks, dtype and device. `blob` is
    this build's own copy-on-write map, so its tensors are views: no copy, and vLLM's in-place scaling
    of `lora_b` lands in the map's private pages, never in the segment a reload maps again."""
    from vllm.lora.peft_helper import PEFTHelper

    peft_helper = PEFTHelper.from_dict(dict(blob_config(blob),
                                            vllm_max_position_embeddings=manager.max_position_embeddings))
    peft_helper.validate_legal(manager.lora_config)
    adapters = manager._adapter_manager
    mapper = getattr(adapters.model, "hf_to_vllm_mapper", None)
    if hasattr(mapper, "get_rename_mapper"):  # vLLM 0.20 takes the whole mapper, later ones its renames
        mapper = mapper.get_rename_mapper()
    skip_prefixes = getattr(adapters.model, "lora_skip_prefixes", None)
    tensors = blob_tensors(blob, copy=False)
    check_modules(tensors, expected_modules(adapters), peft_helper.modules_to_save, mapper, skip_prefixes,
                  request.lora_path)
    lora = manager._lora_model_cls.from_lora_tensors(
        lora_model_id=request.lora_int_id, tensors=tensors, peft_helper=peft_helper, device="cpu",
        dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size, weights_mapper=mapper,
        skip_prefixes=skip_prefixes)
    if hasattr(request, "is_3d_lora_weight"):  # not in vLLM 0.20
        lora.is_3d_lora_weight = request.is_3d_lora_weight
    for check in ("_validate_moe_lora_format", "_validate_modules_to_save", "_validate_token_classification_lora"):
        if hasattr(adapters, check):
            getattr(adapters, check)(lora)
    return lora


class MemoryAdapterWorker:
    """vLLM worker extension (`--worker-extension-cls WORKER_EXTENSION`): methods `collective_rpc` calls
    on every worker of the engine."""

    def graft_load_from_memory(self) -> bool:
        """Install the hook that loads memory paths (once per worker; idempotent)."""
        StagedAdapters.of(self.model_runner.lora_manager)
        return True

    def graft_drop_adapter(self, path: str) -> bool:
        """Close the segment of memory path `path` (unloaded, or its load failed); whether there was one."""
        return StagedAdapters.of(self.model_runner.lora_manager).drop(path)

    def graft_staged_labels(self) -> list[str]:
        """The memory paths whose segments are open now (what a test checks for leaks)."""
        return sorted(StagedAdapters.of(self.model_runner.lora_manager).segments)


# -- API server side ------------------------------------------------------------------------------

_pending_drops: set[asyncio.Task] = set()  # drops sent after an unload answered (kept from the GC)


def _drop_in_workers(engine_client, path: str) -> None:
    """Close `path`'s segment in every worker, without making the caller wait: vLLM's engine core runs its
    calls in order, so no later load or listing can overtake it."""
    task = asyncio.get_running_loop().create_task(engine_client.collective_rpc("graft_drop_adapter", args=(path,)))
    _pending_drops.add(task)
    task.add_done_callback(_pending_drops.discard)


def _registered(models, path: str) -> bool:
    """Whether any adapter name vLLM serves is registered from `path`."""
    return any(r.lora_path == path for r in models.lora_requests.values())


def drop_blobs_on_unload() -> None:
    """Make vLLM's unload (`/v1/unload_lora_adapter`, any client) drop a memory adapter's blobs from
    the workers. vLLM's unload only forgets the name in the API server (the worker's LoRA cache evicts
    the weights when it needs the slot), so without this every version's blob would stay open."""
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    ErrorResponse = error_response_class()

    unload = OpenAIServingModels.unload_lora_adapter
    if getattr(unload, "_graft_drops_blobs", False):
        return

    async def unload_and_drop_blobs(self, request, *args, **kwargs):
        registered = self.lora_requests.get(request.lora_name)
        answer = await unload(self, request, *args, **kwargs)
        path = getattr(registered, "lora_path", "")
        if memory_segment(path) and not isinstance(answer, ErrorResponse) and not _registered(self, path):
            _drop_in_workers(self.engine_client, path)
        return answer

    unload_and_drop_blobs._graft_drops_blobs = True
    OpenAIServingModels.unload_lora_adapter = unload_and_drop_blobs


def add_memory_route(app) -> None:
    """Register `ROUTE` on vLLM's FastAPI `app` (module docstring)."""
    from fastapi import Request
    from fastapi.responses import JSONResponse, Response
    from vllm import envs
    ErrorResponse = error_response_class()
    from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse(status_code=status, content={"error": {"message": message, "code": status,
                                                                   "type": "BadRequestError" if status < 500 else
                                                                   "NotImplementedError"}})

    drop_blobs_on_unload()

    @app.post(ROUTE)
    async def load_lora_adapter_from_memory(raw_request: Request):
        state = raw_request.app.state
        if not envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING:
            return error(400, "runtime LoRA loading is off: start the server with "
                              "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True")
        if state.vllm_config.parallel_config.worker_extension_cls != WORKER_EXTENSION:
            return error(501, f"this server's workers cannot load adapters from memory: start it with "
                              f"--worker-extension-cls {WORKER_EXTENSION} (graft's launcher does)")
        name, label = raw_request.query_params.get("lora_name"), raw_request.query_params.get("lora_path")
        if not name or not label:
            return error(400, "expected query parameters lora_name and lora_path (the version's unique label)")
        segment = raw_request.query_params.get("shm")
        try:
            if segment is not None:
                os.close(open_segment(segment))  # a bad name, or not on this host: refused before vLLM sees it
        except BlobError as bad:
            return error(400, str(bad))
        if not getattr(state, "graft_loads_from_memory", False):  # once per server
            await state.engine_client.collective_rpc("graft_load_from_memory")
            state.graft_loads_from_memory = True
        body_segment = new_segment(await raw_request.body()) if segment is None else None
        path = memory_path(label, segment or body_segment.segment)
        models = state.openai_serving_models

        def refused(response: JSONResponse) -> JSONResponse:  # the workers' blob goes unless a name holds it
            if not _registered(models, path):
                _drop_in_workers(state.engine_client, path)
            return response

        try:
            answer = await models.load_lora_adapter(LoadLoRAAdapterRequest(lora_name=name, lora_path=path))
        except Exception as failed:  # noqa: BLE001 - vLLM 0.20 raises what later versions answer as an
            # ErrorResponse; answered here, as those are (escaping, it made uvicorn drop the connection)
            return refused(error(500, str(failed)))
        finally:
            if body_segment is not None:  # the workers mapped it, or failed
                body_segment.release()
        if isinstance(answer, ErrorResponse):
            return refused(JSONResponse(content=answer.model_dump(), status_code=answer.error.code))
        return Response(status_code=200, content=answer)
