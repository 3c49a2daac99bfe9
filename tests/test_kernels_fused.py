"""Fused elementwise kernels (RMSNorm, add + RMSNorm, rotary, SiLU-and-mul) vs pure-torch
references that are checked against the model's own code. The consumers of projection outputs
also add a deferred float32 LoRA delta as they load: that must equal adding it first.

The Triton kernels run under TRITON_INTERPRET=1 on the CPU, in fp32 and fp16 only: the
interpreter truncates fp32 -> bf16 instead of rounding to nearest even, so bf16 is checked on
the GPU by scripts/bench_fused.py.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from radixlora.config import RopeConfig  # noqa: E402
from radixlora.model.decoder import RMSNorm  # noqa: E402
from radixlora.model.rope import inv_frequencies  # noqa: E402
from radixlora_kernels.activation import (  # noqa: E402
    gelu_tanh_and_mul_ref,
    silu_and_mul,
    silu_and_mul_ref,
)
from radixlora_kernels.rmsnorm import (  # noqa: E402
    MAX_HIDDEN,
    add_delta_ref,
    fused_add_rmsnorm,
    fused_add_rmsnorm_ref,
    rmsnorm,
    rmsnorm_ref,
)
from radixlora_kernels.rotary import apply_rotary_, apply_rotary_ref  # noqa: E402
from radixlora_kernels.rotary_kv import rotary_store_kv_, rotary_store_kv_ref  # noqa: E402

DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
EPS = 1e-6
LLAMA3_ROPE = RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0,
                         original_max_position=64)
POSITIONS = {0: [], 1: [100], 7: [0, 5, 100, 3, 2047, 1, 70000]}


def randn(*shape: int, dtype=torch.float32, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tol = TOL[torch.float16 if expected.dtype == torch.float16 else torch.float32]
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


def norm_weight(hidden: int, dtype: torch.dtype) -> torch.Tensor:
    return (1 + 0.2 * randn(hidden, seed=9)).to(dtype)


# --- the references are HF Llama's formulas -------------------------------------------------


def _hf_rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rotate_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None].to(x.dtype) + rotate_half * sin[:, None].to(x.dtype)


def test_references_match_hf_formulas():
    x, gate_up = randn(5, 96), randn(5, 2 * 48, seed=1)
    weight = norm_weight(96, torch.float32)
    h = x.float()
    want = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)
    assert torch.equal(rmsnorm_ref(x, weight, EPS), want)
    norm = RMSNorm(96, EPS)
    with torch.no_grad():
        norm.weight.copy_(weight)
        assert torch.equal(norm(x)[0], want)  # the model's CPU path is the reference
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(silu_and_mul_ref(gate_up), F.silu(gate) * up)

    inv_freq, positions = inv_frequencies(16, LLAMA3_ROPE), torch.tensor(POSITIONS[7])
    emb = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((emb, emb), dim=-1)
    q, k = randn(7, 4, 16, dtype=torch.float16), randn(7, 2, 16, dtype=torch.float16, seed=1)
    q_ref, k_ref = apply_rotary_ref(q, k, positions, inv_freq)
    assert torch.equal(q_ref, _hf_rotate(q, emb.cos(), emb.sin()))
    assert torch.equal(k_ref, _hf_rotate(k, emb.cos(), emb.sin()))


# --- rmsnorm --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [0, 1, 7])
@pytest.mark.parametrize("hidden", [96, 128])
def test_rmsnorm(dtype, num_tokens, hidden):
    x, weight = randn(num_tokens, hidden, dtype=dtype, scale=3.0), norm_weight(hidden, dtype)
    assert_close(rmsnorm(x, weight, EPS), rmsnorm_ref(x, weight, EPS))


def test_rmsnorm_fp32_weight_promotes():
    x, weight = randn(7, 96, dtype=torch.float16), norm_weight(96, torch.float32)
    out = rmsnorm(x, weight, EPS)
    assert out.dtype == torch.float32
    assert_close(out, rmsnorm_ref(x, weight, EPS))


def test_rmsnorm_max_hidden():
    x, weight = randn(1, MAX_HIDDEN), norm_weight(MAX_HIDDEN, torch.float32)
    assert_close(rmsnorm(x, weight, EPS), rmsnorm_ref(x, weight, EPS))


def test_rmsnorm_strided_rows_and_in_place():
    wide = randn(7, 128)
    x, weight = wide[:, :96], norm_weight(96, torch.float32)
    expected, tail = rmsnorm_ref(x, weight, EPS), wide[:, 96:].clone()
    assert rmsnorm(x, weight, EPS, out=x) is x
    assert_close(x, expected)
    assert torch.equal(wide[:, 96:], tail)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [0, 1, 7])
def test_fused_add_rmsnorm(dtype, num_tokens):
    x, residual = randn(num_tokens, 96, dtype=dtype), randn(num_tokens, 96, dtype=dtype, seed=1)
    weight = norm_weight(96, dtype)
    normed, new_residual = fused_add_rmsnorm(x, residual, weight, EPS)
    normed_ref, residual_ref = fused_add_rmsnorm_ref(x, residual, weight, EPS)
    assert torch.equal(new_residual, residual_ref)
    assert_close(normed, normed_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 7])
def test_fused_add_rmsnorm_adds_a_deferred_delta(dtype, num_tokens):
    x, residual = randn(num_tokens, 96, dtype=dtype), randn(num_tokens, 96, dtype=dtype, seed=1)
    delta, weight = randn(num_tokens, 96, seed=2, scale=0.1), norm_weight(96, dtype)
    normed, new_residual = fused_add_rmsnorm(x, residual, weight, EPS, delta=delta)
    want = fused_add_rmsnorm(add_delta_ref(x, delta), residual, weight, EPS)
    assert torch.equal(normed, want[0]) and torch.equal(new_residual, want[1])
    normed_ref, residual_ref = fused_add_rmsnorm_ref(x, residual, weight, EPS, delta)
    assert torch.equal(new_residual, residual_ref)
    assert_close(normed, normed_ref)
    assert not torch.equal(new_residual, x + residual)


def test_fused_add_rmsnorm_in_place():
    x, residual, weight = randn(7, 96), randn(7, 96, seed=1), norm_weight(96, torch.float32)
    normed_ref, residual_ref = fused_add_rmsnorm_ref(x, residual, weight, EPS)
    normed, new_residual = fused_add_rmsnorm(x, residual, weight, EPS, out=x,
                                             residual_out=residual)
    assert normed is x and new_residual is residual
    assert torch.equal(residual, residual_ref)
    assert_close(x, normed_ref)


# --- rotary ---------------------------------------------------------------------------------


def fused_qkv(num_tokens: int, hq: int, hk: int, head_dim: int, dtype: torch.dtype):
    """(qkv, q, k): q [T, hq, D] and k [T, hk, D] are strided views of qkv, as the model's."""
    qkv = randn(num_tokens, (hq + 2 * hk) * head_dim, dtype=dtype, scale=2.0)
    q, k, _ = qkv.split((hq * head_dim, hk * head_dim, hk * head_dim), dim=-1)
    return qkv, q.view(-1, hq, head_dim), k.view(-1, hk, head_dim)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [0, 1, 7])
@pytest.mark.parametrize("head_dim", [16, 12])
def test_rotary_gqa_views_of_fused_qkv(dtype, num_tokens, head_dim):
    qkv, q, k = fused_qkv(num_tokens, 4, 2, head_dim, dtype)
    positions = torch.tensor(POSITIONS[num_tokens], dtype=torch.int64)
    inv_freq = inv_frequencies(head_dim, LLAMA3_ROPE)
    q_ref, k_ref = apply_rotary_ref(q, k, positions, inv_freq)
    v_before = qkv[:, 6 * head_dim :].clone()

    assert apply_rotary_(q, k, positions, inv_freq) is None
    assert_close(q, q_ref)
    assert_close(k, k_ref)
    assert torch.equal(qkv[:, 6 * head_dim :], v_before)
    if dtype == torch.float16 and num_tokens:  # rounded op by op as eager torch rounds
        assert (q == q_ref).float().mean() > 0.98 and (k == k_ref).float().mean() > 0.98


def test_rotary_int32_positions_and_contiguous_heads():
    q, k = randn(7, 4, 16), randn(7, 1, 16, seed=1)
    positions = torch.tensor(POSITIONS[7], dtype=torch.int32)
    inv_freq = inv_frequencies(16, RopeConfig())
    q_ref, k_ref = apply_rotary_ref(q, k, positions, inv_freq)
    apply_rotary_(q, k, positions, inv_freq)
    assert_close(q, q_ref)
    assert_close(k, k_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [0, 1, 7])
@pytest.mark.parametrize("head_dim", [16, 12])
def test_rotary_store_kv_equals_rotary_then_index_store(dtype, num_tokens, head_dim):
    qkv, q, k = fused_qkv(num_tokens, 4, 2, head_dim, dtype)
    v = qkv[:, 6 * head_dim :].view(-1, 2, head_dim)
    positions = torch.tensor(POSITIONS[num_tokens], dtype=torch.int64)
    inv_freq = inv_frequencies(head_dim, LLAMA3_ROPE)
    k_cache, v_cache = randn(20, 2, head_dim, dtype=dtype, seed=3), randn(20, 2, head_dim, seed=4)
    v_cache = v_cache.to(dtype)
    loc = torch.randperm(20, generator=torch.Generator().manual_seed(5))[:num_tokens]
    qkv_before, k_cache0, v_cache0 = qkv.clone(), k_cache.clone(), v_cache.clone()
    q2, k2 = q.clone(), k.clone()
    apply_rotary_(q2, k2, positions, inv_freq)  # the unfused kernels: rotary, then index stores
    k_want, v_want = k_cache.clone(), v_cache.clone()
    k_want[loc], v_want[loc] = k2, v

    assert rotary_store_kv_(q, k, v, positions, inv_freq, k_cache, v_cache, loc) is None
    assert torch.equal(q, q2)
    assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)
    assert torch.equal(qkv[:, 4 * head_dim :], qkv_before[:, 4 * head_dim :])  # k, v untouched
    q_ref, k_ref, v_ref = qkv_before[:, : 4 * head_dim].view(-1, 4, head_dim), k_cache0, v_cache0
    rotary_store_kv_ref(q_ref, qkv_before[:, 4 * head_dim : 6 * head_dim].view(-1, 2, head_dim),
                        v, positions, inv_freq, k_ref, v_ref, loc)
    assert_close(q, q_ref)
    assert_close(k_cache, k_ref)
    assert torch.equal(v_cache, v_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 7])
def test_rotary_store_kv_adds_deferred_deltas(dtype, num_tokens):
    """Deltas are views of one fused qkv delta, as the model passes them."""
    head_dim, split = 16, (64, 32, 32)
    qkv, q, k = fused_qkv(num_tokens, 4, 2, head_dim, dtype)
    v = qkv[:, 96:].view(-1, 2, head_dim)
    fused_delta = randn(num_tokens, 128, seed=6, scale=0.1)
    dq, dk, dv = (d.view(num_tokens, -1, head_dim) for d in fused_delta.split(split, dim=-1))
    positions = torch.tensor(POSITIONS[num_tokens], dtype=torch.int64)
    inv_freq = inv_frequencies(head_dim, LLAMA3_ROPE)
    k_cache, v_cache = (torch.zeros(9, 2, head_dim, dtype=dtype) for _ in range(2))
    loc = torch.arange(num_tokens) + 1
    q_in, k_in, v_in = (add_delta_ref(t, d) for t, d in ((q, dq), (k, dk), (v, dv)))
    kc_want, vc_want = k_cache.clone(), v_cache.clone()
    rotary_store_kv_(q_in, k_in, v_in, positions, inv_freq, kc_want, vc_want, loc)
    qkv_before = qkv.clone()

    rotary_store_kv_(q, k, v, positions, inv_freq, k_cache, v_cache, loc, (dq, dk, dv))
    assert torch.equal(q, q_in)
    assert torch.equal(k_cache, kc_want) and torch.equal(v_cache, vc_want)
    assert torch.equal(qkv[:, 64:], qkv_before[:, 64:])  # k, v themselves untouched
    q_ref = qkv_before[:, :64].view(-1, 4, head_dim)
    kc_ref, vc_ref = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    rotary_store_kv_ref(q_ref, qkv_before[:, 64:96].view(-1, 2, head_dim), v, positions,
                        inv_freq, kc_ref, vc_ref, loc, (dq, dk, dv))
    assert_close(q, q_ref)
    assert_close(k_cache, kc_ref)
    assert torch.equal(v_cache, vc_ref)


# --- silu_and_mul ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [0, 1, 7])
def test_silu_and_mul(dtype, num_tokens):
    gate_up = randn(num_tokens, 2 * 48, dtype=dtype, scale=3.0)
    out, expected = silu_and_mul(gate_up), silu_and_mul_ref(gate_up)
    assert_close(out, expected)
    if dtype == torch.float16 and num_tokens:
        assert (out == expected).float().mean() > 0.98


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_adds_a_deferred_delta(dtype):
    gate_up, delta = randn(7, 2 * 48, dtype=dtype, scale=3.0), randn(7, 2 * 48, seed=1)
    out = silu_and_mul(gate_up, delta=delta)
    assert torch.equal(out, silu_and_mul(add_delta_ref(gate_up, delta)))
    assert_close(out, silu_and_mul_ref(gate_up, delta))


def test_silu_and_mul_strided_rows_into_out():
    gate_up = randn(7, 2 * 48 + 32, scale=3.0)[:, : 2 * 48]
    out = torch.empty(7, 48)
    assert silu_and_mul(gate_up, out=out) is out
    assert_close(out, silu_and_mul_ref(gate_up))


# --- launcher checks ------------------------------------------------------------------------

X, W = randn(3, 8), norm_weight(8, torch.float32)
X_WIDE, W_WIDE = torch.zeros(1, MAX_HIDDEN + 1), torch.ones(MAX_HIDDEN + 1)
Q, K, POS, INV = randn(3, 4, 8), randn(3, 2, 8), torch.arange(3), torch.ones(4)
KC = torch.zeros(5, 2, 8)
BAD_CALLS = {
    "rms x 1-D": lambda: rmsnorm(X[0], W, EPS),
    "rms x int": lambda: rmsnorm(X.long(), W, EPS),
    "rms weight shape": lambda: rmsnorm(X, W[:4], EPS),
    "rms H too large": lambda: rmsnorm(X_WIDE, W_WIDE, EPS),
    "rms x column-strided": lambda: rmsnorm(randn(8, 3).t(), W, EPS),
    "rms out dtype": lambda: rmsnorm(X, W, EPS, out=torch.empty(3, 8, dtype=torch.float16)),
    "rms out shape": lambda: rmsnorm(X, W, EPS, out=torch.empty(4, 8)),
    "add residual dtype": lambda: fused_add_rmsnorm(X, X.half(), W, EPS),
    "add residual shape": lambda: fused_add_rmsnorm(X, X[:2], W, EPS),
    "add delta fp16": lambda: fused_add_rmsnorm(X, X, W, EPS, delta=X.half()),
    "add delta shape": lambda: fused_add_rmsnorm(X, X, W, EPS, delta=X[:2]),
    "rot q 2-D": lambda: apply_rotary_(Q.flatten(1), K, POS, INV),
    "rot k head_dim": lambda: apply_rotary_(Q, randn(3, 2, 6), POS, torch.ones(3)),
    "rot k dtype": lambda: apply_rotary_(Q, K.half(), POS, INV),
    "rot k tokens": lambda: apply_rotary_(Q, K[:2], POS, INV),
    "rot odd head_dim": lambda: apply_rotary_(randn(3, 4, 7), randn(3, 2, 7), POS, torch.ones(3)),
    "rot positions float": lambda: apply_rotary_(Q, K, POS.float(), INV),
    "rot positions length": lambda: apply_rotary_(Q, K, POS[:2], INV),
    "rot inv_freq length": lambda: apply_rotary_(Q, K, POS, torch.ones(8)),
    "rot inv_freq fp64": lambda: apply_rotary_(Q, K, POS, INV.double()),
    "rot q head_dim stride": lambda: apply_rotary_(randn(3, 8, 4).transpose(1, 2), K, POS, INV),
    "kv v shape": lambda: rotary_store_kv_(Q, K, K[:, :1], POS, INV, KC, KC, POS),
    "kv cache dtype": lambda: rotary_store_kv_(Q, K, K, POS, INV, KC.half(), KC, POS),
    "kv cache heads": lambda: rotary_store_kv_(Q, K, K, POS, INV, KC[:, :1], KC, POS),
    "kv loc float": lambda: rotary_store_kv_(Q, K, K, POS, INV, KC, KC, POS.float()),
    "kv loc length": lambda: rotary_store_kv_(Q, K, K, POS, INV, KC, KC, POS[:2]),
    "kv two deltas": lambda: rotary_store_kv_(Q, K, K, POS, INV, KC, KC, POS, (Q, K)),
    "kv delta fp16": lambda: rotary_store_kv_(Q, K, K, POS, INV, KC, KC, POS, (Q.half(), K, K)),
    "kv delta strides": lambda: rotary_store_kv_(Q, K, K, POS, INV, KC, KC, POS,
                                                 (Q, randn(3, 2, 16)[..., :8], K)),
    "kv delta shape": lambda: rotary_store_kv_(Q, K, K, POS, INV, KC, KC, POS, (Q, K[:, :1], K)),
    "silu 1-D": lambda: silu_and_mul(X[0]),
    "silu odd width": lambda: silu_and_mul(randn(3, 7)),
    "silu int": lambda: silu_and_mul(X.long()),
    "silu out shape": lambda: silu_and_mul(X, out=torch.empty(3, 8)),
    "silu out dtype": lambda: silu_and_mul(X, out=torch.empty(3, 4, dtype=torch.float16)),
    "silu delta shape": lambda: silu_and_mul(X, delta=X[:, :4]),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_launcher_rejects(name):
    with pytest.raises(ValueError):
        BAD_CALLS[name]()


# --- Gemma's kernels: the norm's 1 + weight and the GELU-tanh gate ------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_with_an_offset_weight(dtype):
    x, residual = randn(7, 96, dtype=dtype, scale=3.0), randn(7, 96, dtype=dtype, seed=1)
    weight = 0.1 * norm_weight(96, dtype)  # Gemma stores the scale minus one
    assert_close(rmsnorm(x, weight, EPS, offset=1.0), rmsnorm_ref(x, weight, EPS, 1.0))
    normed, new_residual = fused_add_rmsnorm(x, residual, weight, EPS, offset=1.0)
    normed_ref, residual_ref = fused_add_rmsnorm_ref(x, residual, weight, EPS, offset=1.0)
    assert torch.equal(new_residual, residual_ref)
    assert_close(normed, normed_ref)
    assert not torch.allclose(normed_ref.float(), fused_add_rmsnorm_ref(
        x, residual, weight, EPS)[0].float())  # the offset matters


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_and_mul(dtype):
    gate_up = randn(7, 2 * 80, dtype=dtype, scale=2.0)
    delta = randn(7, 2 * 80, seed=3, scale=0.1)
    assert_close(silu_and_mul(gate_up, gelu_tanh=True), gelu_tanh_and_mul_ref(gate_up))
    assert_close(silu_and_mul(gate_up, delta=delta, gelu_tanh=True),
                 gelu_tanh_and_mul_ref(gate_up, delta))
