"""GPU check of the quantized-base projections, runnable with torch and Triton alone (no
radixlora install): the NF4 Triton dequantization equals its torch reference bit for bit on
CUDA, the FP8 W8A8 product stays within FP8's error of its reference, and each projection's
time at batch 1 and 32 next to the bf16 GEMM and the weight-read floor.

    python3 scripts/check_quant_gpu.py [--hbm-tb-s 4.8]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from kernels.nf4_dequant import nf4_dequant, nf4_dequant_ref  # noqa: E402


def _module(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fp8 = _module(ROOT / "radixlora/model/quant_fp8.py")
SHAPES = {"qkv (Llama-3-8B)": (6144, 4096), "gate_up (Llama-3-8B)": (28672, 4096)}


def time_us(fn, reps: int = 50) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / reps


def nf4_weights(out_f: int, in_f: int, blocksize: int = 64):
    g = torch.Generator(device="cuda").manual_seed(0)
    packed = torch.randint(0, 256, (out_f * in_f // 2,), dtype=torch.uint8, device="cuda",
                           generator=g)
    absmax = torch.rand(out_f * in_f // blocksize, device="cuda", generator=g) * 0.1
    code = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                         -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                         0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
                         0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                         0.7229568362236023, 1.0], device="cuda")
    return packed, absmax, code


def check_nf4(name: str, shape: tuple[int, int], floor_tb_s: float) -> None:
    packed, absmax, code = nf4_weights(*shape)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        out = torch.empty(shape, dtype=dtype, device="cuda")
        nf4_dequant(packed, absmax, code, 64, out)
        ref = nf4_dequant_ref(packed, absmax, code, 64, shape, dtype)
        assert torch.equal(out, ref), f"NF4 {name} {dtype}: Triton != torch reference"
    out = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
    w = nf4_dequant_ref(packed, absmax, code, 64, shape, torch.bfloat16)
    dequant = time_us(lambda: nf4_dequant(packed, absmax, code, 64, out))
    nf4_bytes = packed.numel() + absmax.numel() * 4
    for batch in (1, 32):
        x = torch.randn(batch, shape[1], dtype=torch.bfloat16, device="cuda")
        gemm = time_us(lambda x=x: torch.nn.functional.linear(x, w))
        total = time_us(lambda x=x: torch.nn.functional.linear(
            x, nf4_dequant(packed, absmax, code, 64, out)))
        print(f"nf4 {name} batch {batch}: dequant {dequant:.1f} us + GEMM = {total:.1f} us; "
              f"bf16 GEMM {gemm:.1f} us; NF4 read floor "
              f"{nf4_bytes / floor_tb_s / 1e6:.1f} us, bf16 {w.numel() * 2 / floor_tb_s / 1e6:.1f}"
              " us")


def check_fp8(name: str, shape: tuple[int, int], floor_tb_s: float) -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    w = torch.randn(shape, device="cuda", generator=g) * 0.02
    scale = w.abs().amax(dim=1) / 448.0
    w8 = (w / scale[:, None]).to(torch.float8_e4m3fn)
    ref_w = (w8.float() * scale[:, None]).to(torch.bfloat16)
    for batch in (1, 32):
        x = torch.randn(batch, shape[1], dtype=torch.bfloat16, device="cuda", generator=g)
        y = fp8.fp8_linear_w8a8(x, w8, scale, None)
        ref = torch.nn.functional.linear(x, ref_w)
        rel = float((y.float() - ref.float()).norm() / ref.float().norm())
        assert rel < 0.03, f"FP8 {name} batch {batch}: relative error {rel:.3f}"
        fast = time_us(lambda x=x: fp8.fp8_linear_w8a8(x, w8, scale, None))
        gemm = time_us(lambda x=x: torch.nn.functional.linear(x, ref_w))
        print(f"fp8 {name} batch {batch}: W8A8 {fast:.1f} us (relative error {rel:.4f}); bf16 "
              f"GEMM {gemm:.1f} us; FP8 read floor {w8.numel() / floor_tb_s / 1e6:.1f} us")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hbm-tb-s", type=float, default=4.8, help="HBM bandwidth for the floors")
    args = p.parse_args()
    print(torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
    for name, shape in SHAPES.items():
        check_nf4(name, shape, args.hbm_tb_s)
        check_fp8(name, shape, args.hbm_tb_s)
    print("ok")


if __name__ == "__main__":
    main()
