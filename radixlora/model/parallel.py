"""Tensor-parallel modules and the transform that puts them into a model built for one rank's
shape (radixlora.distributed.Shard.local): the model file itself is never forked. Column-
parallel projections need no module of their own (a plain Linear, NF4Linear or Fp8Linear of
the rank's rows, whose output the rank's attention heads or MLP slice consume); row-parallel
ones all-reduce, the vocabulary-parallel ones mask and reduce (embedding) or gather (LM
head)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixlora.distributed import TensorParallel
from radixlora.model.decoder import CausalLM, SparseMoE
from radixlora.model.quant import NF4Linear
from radixlora.model.quant_fp8 import Fp8Linear

ROW_PARALLEL = (("self_attn", "o_proj"), ("mlp", "down_proj"))


class RowParallelLinear(nn.Module):
    """A projection whose input features are split over the ranks: each rank's partial product
    is all-reduced, then the (whole) bias added once. LoraContext adds each rank's partial LoRA
    delta to its partial product before the all-reduce (`partial`, then `reduce`), so the
    deltas ride on the all-reduce the base output needs anyway. Dense, NF4 and FP8 weights:
    the subclasses below."""

    tp: TensorParallel
    bias: nn.Parameter | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.partial(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output: x (its input columns) times its weight columns."""
        raise NotImplementedError

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        """The output from every rank's partial output (in place)."""
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


class RowParallelDense(RowParallelLinear, nn.Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel):
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class RowParallelNF4(RowParallelLinear, NF4Linear):
    """Each row's input columns of this rank: whole blocks of the row (NF4Weight.columns)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, blocksize: int,
                 tp: TensorParallel):
        super().__init__(in_features, out_features, bias, blocksize, torch.float32)
        self.tp = tp

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, None)


class RowParallelFp8(RowParallelLinear, Fp8Linear):
    """This rank's input columns with every row's whole scale (with blocks: the scales of its
    columns' blocks, whole blocks): scaling is linear, so the scaled partial products add up
    to the whole product."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel,
                 block: tuple[int, int] | None = None):
        super().__init__(in_features, out_features, bias, torch.float32, block)
        self.tp = tp

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, None)


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + shard) of the embedding: ids outside them embed as zeros here, and
    the all-reduce takes each id's row from the rank that holds it."""

    def __init__(self, hidden_size: int, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.start = tp.shard.vocab_rows().start
        self.weight = nn.Parameter(torch.empty(tp.shard.vocab_shard, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(h.masked_fill(outside[:, None], 0))


class ParallelLMHead(nn.Module):
    """The LM head's vocabulary rows of this rank; the logits of every rank are gathered, so
    each rank samples from the whole vocabulary (padding rows cut off)."""

    def __init__(self, hidden_size: int, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(tp.shard.vocab_shard, hidden_size))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.tp.gather_vocab(F.linear(h, self.weight))


def shard_model(model: CausalLM, tp: TensorParallel) -> CausalLM:
    """Swap in the parallel modules (on the meta device, before the weights load, after the
    projections are dense, NF4 or FP8 and in their dtype), on a model built with
    tp.shard.local's shape."""
    hidden, dtype = model.cfg.hidden_size, model.embed_tokens.weight.dtype
    model.embed_tokens = VocabParallelEmbedding(hidden, tp).to(dtype)
    model.lm_head = ParallelLMHead(hidden, tp).to(dtype)
    return row_parallel_projections(model, tp)


def row_parallel_projections(model: CausalLM, tp: TensorParallel) -> CausalLM:
    """o and down of every layer made row-parallel, keeping their tensors (this rank's input
    columns): dense, NF4 or FP8 alike."""
    for layer in model.layers:
        for block, name in ROW_PARALLEL:
            owner = getattr(layer, block)
            if isinstance(owner, SparseMoE):
                owner.tp = tp  # every expert's share of channels: its output all-reduced
                continue
            setattr(owner, name, _row_parallel(getattr(owner, name), tp))
    return model


def _row_parallel(module: nn.Module, tp: TensorParallel) -> RowParallelLinear:
    """`module` as the RowParallelLinear of its kind, holding its very tensors (their dtypes and
    devices: the twin is built on the meta device, then given them)."""
    shape, bias = (module.in_features, module.out_features), module.bias is not None
    with torch.device("meta"):
        if isinstance(module, NF4Linear):
            twin = RowParallelNF4(*shape, bias, module.blocksize, tp)
        elif isinstance(module, Fp8Linear):
            twin = RowParallelFp8(*shape, bias, tp, module.block)
        else:
            twin = RowParallelDense(*shape, bias, tp)
    twin.load_state_dict(module.state_dict(), assign=True)
    return twin


def whole_row_absmax(linear: nn.Linear) -> torch.Tensor:
    """The absolute maxima (float32) of a dense projection's whole rows, for --quantization fp8
    under tensor parallel: a row-parallel rank holds only some of each row's columns, so the
    ranks max-reduce theirs, and every rank scales each row as one device does."""
    absmax = linear.weight.detach().abs().amax(dim=1).float()
    return linear.tp.all_reduce_max(absmax) if isinstance(linear, RowParallelLinear) else absmax
