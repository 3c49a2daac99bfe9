"""A CUDA graph's step inputs travel packed: one host-to-device copy and one scatter kernel
(kernels/radixlora_kernels/scatter_words.py) fill every static buffer. The kernel runs under
TRITON_INTERPRET=1 against its torch reference; PackedInputs must leave each buffer exactly as a
copy per buffer would have (the values at the start, the rest untouched)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from radixlora.worker.cuda_graph import PackedInputs  # noqa: E402
from radixlora_kernels.scatter_words import scatter_words, scatter_words_ref  # noqa: E402


def _packed(parts: list[tuple[int, np.ndarray]]) -> torch.Tensor:
    table, src = [], 3 * len(parts)
    for dst, values in parts:
        table += [src, dst, len(values)]
        src += len(values)
    return torch.from_numpy(
        np.concatenate([np.array(table), *(v for _, v in parts)]).astype(np.int32)
    )


def test_scatter_words_matches_reference():
    """Empty, one-word and multi-block parts (2500 words: three blocks of 1024), in any order."""
    rng = np.random.default_rng(0)
    parts = [(3000, rng.integers(-(2**31), 2**31, 2500)), (5, np.array([7])), (40, np.zeros(0)),
             (10, rng.integers(0, 100, 30))]
    packed = _packed(parts)
    ref = torch.full((5600,), -5, dtype=torch.int32)
    got = ref.clone()
    scatter_words_ref(packed, ref, len(parts))
    scatter_words(packed, got, len(parts), max_part=2500)
    assert torch.equal(got, ref)
    for dst, values in parts:
        assert got[dst : dst + len(values)].tolist() == values.tolist()
    untouched = torch.cat([got[:5], got[6:10], got[40:3000], got[5500:]])
    assert untouched.eq(-5).all()
    one_program = torch.full_like(ref, -5)  # a grid of one program per part strides over blocks
    scatter_words(packed, one_program, len(parts), max_part=1)
    assert torch.equal(one_program, ref)


def test_scatter_words_rejects_bad_args():
    words = torch.zeros(8, dtype=torch.int32)
    with pytest.raises(ValueError, match="packed must be a contiguous int32"):
        scatter_words(torch.zeros(6, dtype=torch.int64), words, 1, 1)
    with pytest.raises(ValueError, match="words must be a contiguous int32"):
        scatter_words(torch.zeros(6, dtype=torch.int32), words[::2], 1, 1)
    with pytest.raises(ValueError, match="does not fit"):
        scatter_words(torch.zeros(5, dtype=torch.int32), words, 2, 1)
    scatter_words(torch.zeros(0, dtype=torch.int32), words, 0, 0)
    assert words.eq(0).all()


def test_packed_inputs_fill_views_of_every_dtype():
    inputs = PackedInputs(
        {"ids": (5, torch.int64), "indptr": (3, torch.int32), "scales": (6, torch.float32)},
        "cpu",
    )
    ids, indptr, scales = (inputs.views[k] for k in ("ids", "indptr", "scales"))
    assert ids.dtype == torch.int64 and indptr.dtype == torch.int32
    assert scales.dtype == torch.float32 and inputs.words.numel() == 12 + 4 + 8
    scales.fill_(-1.0)
    inputs.send({"ids": np.array([2**40 + 3, -7, 0]), "scales": np.array([0.5, 1e-3]),
                 "indptr": np.array([0, 1, 2])})
    assert ids[:3].tolist() == [2**40 + 3, -7, 0] and indptr.tolist() == [0, 1, 2]
    assert scales.tolist() == pytest.approx([0.5, 1e-3, -1, -1, -1, -1])
    inputs.send({"ids": np.zeros(0), "scales": np.array([2.0])})  # parts sent are the only ones
    assert ids[:3].tolist() == [2**40 + 3, -7, 0]
    assert scales[:2].tolist() == pytest.approx([2.0, 1e-3])
    with pytest.raises(ValueError, match="indptr: 4 words exceed its buffer"):
        inputs.send({"indptr": np.arange(4)})
