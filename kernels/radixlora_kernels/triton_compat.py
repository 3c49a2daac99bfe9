"""`triton` and `triton.language`, or, where Triton is not installed (it ships for Linux only),
a stand-in that lets the kernel modules import so that their torch references, the CPU path,
work: its `jit` kernels raise ImportError when launched, and `cdiv` / `next_power_of_2` are the
same integer arithmetic as Triton's."""

from __future__ import annotations

import types

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    HAVE_TRITON = False
else:
    HAVE_TRITON = True

MISSING = "Triton is not installed (it ships for Linux only): this kernel needs it"

if not HAVE_TRITON:

    class _Unavailable:
        """A kernel that cannot run here; its module still imports."""

        def __init__(self, fn):
            self.fn = fn
            self.__name__ = getattr(fn, "__name__", "kernel")

        def __getitem__(self, grid):
            raise ImportError(f"{MISSING} ({self.__name__})")

        def __call__(self, *args, **kwargs):
            raise ImportError(f"{MISSING} ({self.__name__})")

    def _jit(fn=None, **options):
        return _Unavailable(fn) if fn is not None else _Unavailable

    def _cdiv(a: int, b: int) -> int:
        return (a + b - 1) // b

    def _next_power_of_2(n: int) -> int:
        return 1 << max(int(n) - 1, 0).bit_length()

    tl = types.SimpleNamespace(constexpr=int)
    triton = types.SimpleNamespace(jit=_jit, cdiv=_cdiv, next_power_of_2=_next_power_of_2,
                                   language=tl)
    gdc_launch_dependents = gdc_wait = _Unavailable(None)

__all__ = ["HAVE_TRITON", "gdc_launch_dependents", "gdc_wait", "tl", "triton"]
