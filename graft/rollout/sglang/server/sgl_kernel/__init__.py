"""Stand-in for SGLang's CPU kernel package `sgl_kernel`, which PyPI does not ship: its wheels
there are CUDA builds, and it has no source distribution (see docs/sglang-cpu.md).

SGLang imports CPU kernels by name at module level (`from sgl_kernel import ...` under
`if _is_cpu:`) but calls them only on CPUs with AMX (`cpu_has_amx_support()`); elsewhere it runs
its torch-native code. Every name here is therefore a function that fails loudly when called, with
the marker `GRAFT_SGL_KERNEL_STUB_CALLED` in the server log, so a code path that does need a kernel
cannot pass silently. Submodules (`sgl_kernel.scalar_type`, ...) do not exist: SGLang already
falls back when importing those raises ImportError.
"""

from __future__ import annotations

import sys

__version__ = "0.0.0+graft.stub"
MARKER = "GRAFT_SGL_KERNEL_STUB_CALLED"


def _missing(name: str):
    def op(*args, **kwargs):
        sys.stderr.write(f"{MARKER} {name}\n")
        raise NotImplementedError(f"sgl_kernel.{name}: SGLang's CPU kernels are not installed "
                                  "(graft's stand-in; see docs/sglang-cpu.md)")
    op.__name__ = op.__qualname__ = name
    return op


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(name)
