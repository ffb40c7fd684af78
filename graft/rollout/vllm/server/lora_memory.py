"""Adapters that reach vLLM's workers from the trainer's memory, with no file: `POST /v1/graft/load_lora_adapter`.

vLLM loads a LoRA adapter only from a directory (`/v1/load_lora_adapter` -> engine `add_lora` ->
worker `LRUCacheWorkerLoRAManager._load_adapter`, which reads `adapter_config.json` and
`adapter_model.safetensors`), and reads it again from there whenever the adapter was evicted from
its CPU cache and a request names it. This route takes the adapter as one blob (graft.rollout.adapter_blob:
safetensors with the PEFT config in its metadata), in the request body or in a shared-memory
segment of the same host (`?shm=<segment>`), and:

1. stages the blob in every worker (`MemoryAdapterWorker.graft_stage_adapter`, through vLLM's
   `collective_rpc`; the blob crosses to the workers in a shared-memory segment, never pickled),
   keyed by the request's `lora_path`, which names no file: it is a label, unique per version;
2. asks vLLM's own `load_lora_adapter` to load `lora_name` from that label. The worker's hooked
   `_load_adapter` finds the label staged and builds the LoRA from fresh tensors decoded from the
   blob, through vLLM's own config validation, name mapping and module checks; any other path
   loads from disk as before.

So every later step is vLLM's own: the name registry, the API key (the route is under /v1), the
unload route (patched to drop the staged blobs too), `/v1/models` (whose `root` shows the label). A
reload after an LRU eviction decodes the blob again: the tensors are never the ones an earlier load
scaled in place (`LoRALayerWeights.optimize`), so any number of evictions serves the same weights.
The label must be unique per version: vLLM's prefix-cache key is (name, path).

The workers get the methods through vLLM's `--worker-extension-cls` (the launcher passes
`WORKER_EXTENSION`); a server without it answers this route with 501, and clients fall back to disk.

(No `from __future__ import annotations` here: FastAPI resolves the route's `Request` annotation at
registration, and the name lives inside `add_memory_route`, not in this module's globals.)
"""

import os
import re
import secrets

from graft.rollout.adapter_blob import blob_config

ROUTE = "/v1/graft/load_lora_adapter"
WORKER_EXTENSION = "graft.rollout.vllm.server.lora_memory.MemoryAdapterWorker"
SHM_DIR = "/dev/shm"
_SEGMENT_RE = re.compile(r"^graft-lora-[0-9a-f]{32}$")


class StagingError(ValueError):
    """A segment the route cannot use."""


# -- shared-memory segments (both sides) ------------------------------------------------------------

def new_segment(data: bytes | memoryview) -> str:
    """A new shared-memory segment holding `data`, readable by this user only; its name. The creator
    unlinks it (`drop_segment`) once the load call returned."""
    name = f"graft-lora-{secrets.token_hex(16)}"
    fd = os.open(os.path.join(SHM_DIR, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as segment:
        segment.write(data)
    return name


def read_segment(name: str) -> bytes:
    """The bytes of segment `name` (one copy into this process). Names are checked: the route must
    never read an arbitrary file for a client."""
    if not _SEGMENT_RE.match(name):
        raise StagingError(f"not a graft shared-memory segment name: {name!r}")
    try:
        with open(os.path.join(SHM_DIR, name), "rb") as segment:
            return segment.read()
    except FileNotFoundError:
        raise StagingError(f"no shared-memory segment {name!r} on the server's host (the shm transport "
                           "needs trainer and server on one host)") from None


def drop_segment(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


# -- worker side ----------------------------------------------------------------------------------

class StagedAdapters:
    """One worker's staged blobs (label -> blob), and the hook that loads from them, installed on its
    LoRA manager instance at the first stage: `_load_adapter` builds a staged label's LoRA from its
    blob, and loads any other path from disk as vLLM does."""

    def __init__(self, manager) -> None:
        self.blobs: dict[str, bytes] = {}
        load_from_disk = manager._load_adapter

        def load_adapter(request):
            blob = self.blobs.get(request.lora_path)
            return load_from_disk(request) if blob is None else build_lora(manager, request, blob)

        manager._load_adapter = load_adapter

    @classmethod
    def of(cls, manager) -> "StagedAdapters":
        staged = getattr(manager, "_graft_staged", None)
        if staged is None:
            staged = manager._graft_staged = cls(manager)
        return staged


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


def build_lora(manager, request, blob: bytes):
    """The LoRAModel of a staged blob, built as vLLM's `_load_adapter` builds one from a directory:
    same config validation (`PEFTHelper.validate_legal`), name mapping, module checks, dtype and
    device; the tensors decoded fresh from the blob."""
    import safetensors.torch
    from vllm.lora.peft_helper import PEFTHelper

    peft_helper = PEFTHelper.from_dict(dict(blob_config(blob),
                                            vllm_max_position_embeddings=manager.max_position_embeddings))
    peft_helper.validate_legal(manager.lora_config)
    adapters = manager._adapter_manager
    mapper = getattr(adapters.model, "hf_to_vllm_mapper", None)
    mapper = mapper.get_rename_mapper() if mapper is not None else None
    skip_prefixes = getattr(adapters.model, "lora_skip_prefixes", None)
    tensors = safetensors.torch.load(blob)
    check_modules(tensors, expected_modules(adapters), peft_helper.modules_to_save, mapper, skip_prefixes,
                  request.lora_path)
    lora = manager._lora_model_cls.from_lora_tensors(
        lora_model_id=request.lora_int_id, tensors=tensors, peft_helper=peft_helper, device="cpu",
        dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size, weights_mapper=mapper,
        skip_prefixes=skip_prefixes)
    lora.is_3d_lora_weight = request.is_3d_lora_weight
    for check in ("_validate_moe_lora_format", "_validate_modules_to_save", "_validate_token_classification_lora"):
        if hasattr(adapters, check):
            getattr(adapters, check)(lora)
    return lora


class MemoryAdapterWorker:
    """vLLM worker extension (`--worker-extension-cls WORKER_EXTENSION`): methods `collective_rpc` calls
    on every worker of the engine."""

    def graft_stage_adapter(self, label: str, segment: str) -> int:
        """Stage the blob in `segment` under `label`; its size in bytes."""
        blob = read_segment(segment)
        blob_config(blob)  # a bad blob fails here, before vLLM registers anything
        StagedAdapters.of(self.model_runner.lora_manager).blobs[label] = blob
        return len(blob)

    def graft_drop_adapter(self, label: str) -> bool:
        """Forget the blob staged under `label` (unloaded, or its load failed); whether there was one."""
        return StagedAdapters.of(self.model_runner.lora_manager).blobs.pop(label, None) is not None

    def graft_staged_labels(self) -> list[str]:
        """The labels staged now (what a test checks for leaks)."""
        return sorted(StagedAdapters.of(self.model_runner.lora_manager).blobs)


# -- API server side ------------------------------------------------------------------------------

_memory_labels: set[str] = set()  # the API server's labels staged in the workers, until unloaded


def drop_blobs_on_unload() -> None:
    """Make vLLM's unload (`/v1/unload_lora_adapter`, any client) drop a memory adapter's blobs from
    the workers. vLLM's unload only forgets the name in the API server (the worker's LoRA cache evicts
    the weights when it needs the slot), so without this every staged version would stay in memory."""
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    unload = OpenAIServingModels.unload_lora_adapter
    if getattr(unload, "_graft_drops_blobs", False):
        return

    async def unload_and_drop_blobs(self, request, *args, **kwargs):
        registered = self.lora_requests.get(request.lora_name)
        answer = await unload(self, request, *args, **kwargs)
        label = getattr(registered, "lora_path", None)
        if label in _memory_labels and not isinstance(answer, ErrorResponse) and \
                all(r.lora_path != label for r in self.lora_requests.values()):
            _memory_labels.discard(label)
            await self.engine_client.collective_rpc("graft_drop_adapter", args=(label,))
        return answer

    unload_and_drop_blobs._graft_drops_blobs = True
    OpenAIServingModels.unload_lora_adapter = unload_and_drop_blobs


def add_memory_route(app) -> None:
    """Register `ROUTE` on vLLM's FastAPI `app` (module docstring)."""
    from fastapi import Request
    from fastapi.responses import JSONResponse, Response
    from vllm import envs
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse
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
        created = segment is None
        try:
            if created:
                segment = new_segment(await raw_request.body())
            await state.engine_client.collective_rpc("graft_stage_adapter", args=(label, segment))
            _memory_labels.add(label)
        except Exception as failure:  # the worker's error, relayed by vLLM as text
            return error(400, f"could not stage adapter {name!r}: {failure}")
        finally:
            if created and segment is not None:
                drop_segment(segment)
        models = state.openai_serving_models
        answer = await models.load_lora_adapter(LoadLoRAAdapterRequest(lora_name=name, lora_path=label))
        if isinstance(answer, ErrorResponse):
            if all(r.lora_path != label for r in models.lora_requests.values()):
                _memory_labels.discard(label)
                await state.engine_client.collective_rpc("graft_drop_adapter", args=(label,))
            return JSONResponse(content=answer.model_dump(), status_code=answer.error.code)
        return Response(status_code=200, content=answer)
