"""Tensor-parallel modules and the transform that puts them into a model built for one rank's
shape (radixlora.distributed.Shard.local): the model file itself is never forked. Column-
parallel projections need no module of their own (a plain Linear of the rank's rows, whose
output the rank's attention heads or MLP slice consume); row-parallel ones all-reduce, the
vocabulary-parallel ones mask and reduce (embedding) or gather (LM head)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixlora.distributed import TensorParallel
from radixlora.model.llama import LlamaForCausalLM


class RowParallelLinear(nn.Linear):
    """A projection whose input features are split over the ranks: each rank's partial product
    is all-reduced, then the (whole) bias added once. LoraContext adds each rank's partial LoRA
    delta to its partial product before the all-reduce (`partial`, then `reduce`), so the
    deltas ride on the all-reduce the base output needs anyway."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel):
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.partial(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output: x (its input columns) times its weight columns."""
        return F.linear(x, self.weight)

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        """The output from every rank's partial output (in place)."""
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


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


def shard_model(model: LlamaForCausalLM, tp: TensorParallel) -> LlamaForCausalLM:
    """Swap in the parallel modules (on the meta device, before the weights load), on a model
    built with tp.shard.local's shape."""
    hidden = model.cfg.hidden_size
    model.embed_tokens = VocabParallelEmbedding(hidden, tp)
    model.lm_head = ParallelLMHead(hidden, tp)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.o_proj = _row_parallel(attn.o_proj, tp)
        mlp.down_proj = _row_parallel(mlp.down_proj, tp)
    return model


def _row_parallel(linear: nn.Linear, tp: TensorParallel) -> RowParallelLinear:
    return RowParallelLinear(linear.in_features, linear.out_features, linear.bias is not None, tp)
