"""The slot expand (M6): a GEMM against [W; slot A rows] followed by slot_expand_ gives every
token y = x @ W.T + sum over its set's adapters of scale * (x @ A.T) @ B, checked against that
formula and against the loop reference. Runs under TRITON_INTERPRET=1; shapes stay tiny."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated: before any import

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from radixlora.kernels.lora_ops import HostGroups  # noqa: E402
from radixlora.kernels.slot_expand import block_for, slot_expand_, slot_expand_ref  # noqa: E402

WIDTHS = {1: [64], 2: [48, 48], 3: [64, 32, 32]}  # slice boundaries on 16-, 32-wide blocks
IN_DIM = 40


def build(n_slices: int, token_sets: list[list[int]], ranks: list[int], dtype, seed: int = 0):
    """Adapters of the given ranks; token_sets[t] lists the adapters stacked on token t (each
    with scale 0.5 / (position + 1)). Returns (y_aug after the GEMM, the expected y, the slot
    tables)."""
    g = torch.Generator().manual_seed(seed)
    widths = WIDTHS[n_slices]
    off = [0]
    for w in widths:
        off.append(off[-1] + w)
    n_out, T = off[-1], len(token_sets)
    x = torch.randn(T, IN_DIM, generator=g)
    w = torch.randn(n_out, IN_DIM, generator=g) / IN_DIM**0.5
    adapters = [
        ([torch.randn(r, IN_DIM, generator=g) for _ in widths],
         torch.randn(r, n_out, generator=g))
        for r in ranks
    ]  # fmt: skip
    # one slot range per distinct set, in order of first use
    sets = list(dict.fromkeys(tuple(s) for s in token_sets if s))
    a_rows, b_rows, scales, starts = [], [], [], {}
    for s in sets:
        starts[s] = len(scales)
        for pos, k in enumerate(s):
            a, b = adapters[k]
            for r in range(ranks[k]):
                a_rows += [a[i][r] for i in range(n_slices)]  # slot row j's slices in order
                b_rows.append(b[r])
                scales.append(0.5 / (pos + 1))
    num_slots = len(scales) + 3  # unused slots past the last set stay zero
    a_aug = torch.zeros(num_slots * n_slices, IN_DIM)
    if a_rows:
        a_aug[: len(a_rows)] = torch.stack(a_rows)
    b_slots = torch.zeros(num_slots, n_out)
    if b_rows:
        b_slots[: len(b_rows)] = torch.stack(b_rows)
    slot_scales = torch.zeros(num_slots)
    slot_scales[: len(scales)] = torch.tensor(scales)
    y_aug = (x @ torch.cat([w, a_aug]).T).to(dtype)

    expected = x @ w.T
    for t, s in enumerate(token_sets):
        for pos, k in enumerate(s):
            a, b = adapters[k]
            for i in range(n_slices):
                cols = slice(off[i], off[i + 1])
                expected[t, cols] += 0.5 / (pos + 1) * (x[t] @ a[i].T) @ b[:, cols]
    # the kernel's groups: tokens by set, at most GROUP_TOKENS each (a popular set splits)
    host = HostGroups.build([1] * T, [sets.index(tuple(s)) if s else -1 for s in token_sets])
    starts_of_groups = [starts[tuple(token_sets[t])] for t in host.first_seg]
    counts = [sum(ranks[k] for k in token_sets[t]) for t in host.first_seg]

    def i32(values):
        return torch.tensor(np.asarray(values), dtype=torch.int32)

    groups = (i32([host.num_groups]), i32(host.group_indptr), i32(host.token_ids),
              i32(starts_of_groups), i32(counts))  # fmt: skip
    tables = (off, b_slots.to(dtype), slot_scales, *groups)
    return y_aug, expected, tables


CASES = {
    "one_token": ([[0]], [16]),
    "mixed_ranks_and_no_adapter": ([[0], [], [1], [2], [0], []], [4, 8, 64]),
    "stacks_1_to_8": ([[0, 1], list(range(8)), [3], [2, 5, 7]], [4, 16, 8, 4, 8, 16, 4, 8]),
    "nobody": ([[], []], [8]),
    "popular_set_splits": ([[0]] * 20 + [[1], []] * 3, [8, 16]),  # 20 tokens: two groups
}


@pytest.mark.parametrize("n_slices", [1, 2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_slot_expand_matches_the_lora_formula(n_slices, case):
    token_sets, ranks = CASES[case]
    y_aug, expected, tables = build(n_slices, token_sets, ranks, torch.float32)
    ref = y_aug.clone()
    slot_expand_ref(ref, *tables)
    out = slot_expand_(y_aug.clone(), *tables)
    n_out = tables[0][-1]
    torch.testing.assert_close(ref[:, :n_out], expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[:, n_out:], y_aug[:, n_out:])  # v columns are only read


def test_slot_expand_bf16_rounds_once():
    token_sets, ranks = CASES["mixed_ranks_and_no_adapter"]
    y_aug, _, tables = build(3, token_sets, ranks, torch.bfloat16, seed=1)
    ref = y_aug.clone()
    slot_expand_ref(ref, *tables)
    out = slot_expand_(y_aug.clone(), *tables)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=1e-2)
    untouched = [t for t, s in enumerate(token_sets) if not s]
    assert torch.equal(out[untouched], y_aug[untouched])


def test_slot_expand_leaves_a_strided_view_alone_past_its_rows():
    token_sets, ranks = CASES["stacks_1_to_8"]
    y_aug, _, tables = build(2, token_sets, ranks, torch.float32)
    wide = torch.full((y_aug.shape[0], y_aug.shape[1] + 8), 7.0)
    wide[:, : y_aug.shape[1]] = y_aug
    ref = y_aug.clone()
    slot_expand_ref(ref, *tables)
    slot_expand_(wide[:, : y_aug.shape[1]], *tables)
    torch.testing.assert_close(wide[:, : y_aug.shape[1]], ref, atol=1e-4, rtol=1e-4)
    assert torch.all(wide[:, y_aug.shape[1] :] == 7.0)


def test_block_divides_every_slice_boundary():
    assert block_for([0, 4096, 5120, 6144]) == 128
    assert block_for([0, 64, 96, 128]) == 32
    assert block_for([0, 100]) is None


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.update(out_offsets=[0, 32, 16]), "rise strictly"),
        (lambda a: a.update(slot_scales=a["slot_scales"].double()), "float32"),
        (lambda a: a.update(group_count=a["group_count"].long()), "group_count"),
        (lambda a: a.update(out_offsets=[0, 40, 80, 128]), "multiple of 16"),
        (lambda a: a.update(y_aug=a["y_aug"][:, :70]), "fewer than"),
        (lambda a: a.update(b_slots=a["b_slots"][:, :10]), "b_slots"),
    ],
)
def test_slot_expand_rejects_bad_arguments(change, message):
    y_aug, _, (off, b, s, *groups) = build(3, [[0], []], [8], torch.float32)
    names = ("num_groups", "group_indptr", "group_tokens", "group_start", "group_count")
    args = dict(y_aug=y_aug, out_offsets=off, b_slots=b, slot_scales=s, **dict(zip(names, groups)))
    change(args)
    with pytest.raises(ValueError, match=message):
        slot_expand_(**args)
