"""Seconds-long proof that a carried CUDA vLLM can serve graft, before a GPU's minutes go to a launch.

    python3 scripts/gpu_vllm_smoke.py /tmp/gpu-vllm/site    # or no folder: the environment's own vLLM

Run with the Python that will serve (the GPU box's; or, here, a Python 3.12 virtualenv with the box's
torch 2.11.0, transformers 5.17.0 and peft 0.21.0, which is how the parts of `make gpu-vllm` were
checked without a GPU). It imports vLLM's API server and graft's server modules from SITE, and parses
the command line graft's launcher gives a CUDA vLLM with vLLM's own parser (on a stand-in CUDA
platform where no driver is loaded), then lists the patches a CUDA server gets. A missing or
mismatched package fails here, in one line, instead of minutes into a server start: the first
packing lacked pycountry and carried an xgrammar that needs a newer apache-tvm-ffi than vLLM pins.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def stand_in_cuda() -> None:
    """Where no CUDA driver is loaded (vLLM's CUDA platform module needs libcuda.so.1), a platform that
    says "cuda", which is all the argument parser and graft's patch table read of it."""
    import torch
    import vllm.platforms

    if torch.cuda.is_available():
        return
    from vllm.platforms.interface import Platform, PlatformEnum

    class StandInCuda(Platform):
        _enum = PlatformEnum.CUDA
        device_type = device_name = "cuda"
        dispatch_key = "CUDA"

    vllm.platforms._current_platform = StandInCuda()


def parsed_serve_arguments(argv: list[str]):
    """`argv` parsed and validated as `vllm serve` does it."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    except ImportError:  # vLLM 0.20
        from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
    args = make_arg_parser(FlexibleArgumentParser(description="vLLM")).parse_args(argv)
    validate_parsed_serve_args(args)
    return args


def main(site: Path | None) -> int:
    sys.path[:0] = [str(ROOT), *([str(site)] if site else [])]
    import vllm

    from graft.rollout.vllm import launcher
    from graft.rollout.vllm.server import batch_route, entry, lora_memory, versions  # noqa: F401

    stand_in_cuda()
    module = versions.api_server_module()
    server = launcher.VllmServer(launcher.VllmServerConfig(model="/model", dtype="bfloat16", enable_lora=True,
                                                           gpu_memory_utilization=0.3))
    server.port = 8000
    launcher._has_cuda = lambda: True  # the command a CUDA machine gets
    argv = server.command()[3:]
    parsed_serve_arguments(argv)
    chosen, skipped = entry.select_patches(entry.serving_device())
    print(f"gpu-vllm smoke: vLLM {vllm.__version__} from {Path(vllm.__file__).parent.parent}: API server "
          f"{module.__name__}; graft's CUDA command parsed ({' '.join(argv)}); patches {', '.join(chosen)}, "
          f"skipped {', '.join(skipped)}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2:
        sys.exit("usage: gpu_vllm_smoke.py [SITE]")
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) == 2 else None))
