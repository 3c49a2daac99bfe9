"""`triton` and `triton.language`, or, where Triton is not installed (it ships for Linux only),
a stand-in that lets the kernel modules import so that their torch references, the CPU path,
work: its `jit` kernels raise ImportError when launched. `cdiv` and `next_power_of_2` are the
host's launch arithmetic either way."""

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


# The host's launch arithmetic: Triton's cdiv and next_power_of_2 as plain integer functions
# (Triton's own are constexpr functions in newer releases, microseconds a call from Python)
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 0 if n <= 0 else 1 << (int(n) - 1).bit_length()


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

    tl = types.SimpleNamespace(constexpr=int)
    triton = types.SimpleNamespace(jit=_jit, language=tl)
    gdc_launch_dependents = gdc_wait = _Unavailable(None)

__all__ = ["HAVE_TRITON", "cdiv", "gdc_launch_dependents", "gdc_wait", "next_power_of_2", "tl",
           "triton"]
