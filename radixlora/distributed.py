"""Tensor parallel over torch.distributed: which slice of each weight a rank holds, the model's
collectives, and the control plane that hands rank 0's StepPlans to the other ranks.

Megatron's layout: q/k/v and gate/up are column-parallel (each rank holds its heads' rows and
its share of the intermediate rows), o and down row-parallel (the matching input columns; each
rank's output is a partial sum, all-reduced), the embedding and the LM head vocab-parallel
(rows [rank * shard, (rank + 1) * shard) of a vocabulary padded to size * shard; logits are
gathered before sampling, so sampling is the single-device code). KV heads are sharded like
the query heads that read them: a rank holds num_kv_heads / size of them, or, when there are
fewer KV heads than ranks, the one KV head its query heads use (replicated).

LoRA: for a column-parallel module A is replicated and B sliced by output rows as the base
weight is, so the shrink runs in full on every rank and the expand writes only the rank's
columns, no communication. For a row-parallel module A is sliced by input columns and B
replicated: the rank's shrink is a partial sum of the rank-space activations, and since the
expand is linear, its expand with the whole B is the rank's partial delta, added to the rank's
partial base output before the all-reduce that output needs anyway: no collective of its own.
Every rank lays its slices out at the same pool rows, so the scheduler sees one pool.

The process group is gloo on the CPU and NCCL on CUDA (model collectives on the device); the
plan broadcast always runs on a gloo group, as msgpack bytes (never pickled). The ranks may span
nodes (radixlora.topology): their collectives and that broadcast are the only traffic between
hosts."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist

from radixlora.config import FUSED_MODULES, ModelConfig
from radixlora.errors import ModelLoadError
from radixlora.step_plan import StepMasks, StepPlan

COLUMN_MODULES = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # rank 0 ticks the others far more often


def check_shardable(cfg: ModelConfig, size: int) -> None:
    """Raise ModelLoadError unless the model splits evenly over `size` ranks."""
    kv = cfg.num_kv_heads
    problems = [f"{what} ({n}) is not a multiple of {size}"
                for what, n in (("num_attention_heads", cfg.num_heads),
                                ("intermediate_size", cfg.intermediate_size),
                                ("moe_intermediate_size", cfg.moe_intermediate_size))
                if n % size]
    if kv % size and size % kv:
        problems.append(f"num_key_value_heads ({kv}) neither divides nor is a multiple of {size}")
    if problems:
        raise ModelLoadError(f"--tensor-parallel-size {size}: " + "; ".join(problems))


@dataclasses.dataclass(frozen=True)
class Shard:
    """Rank `rank` of `size`: the slices of the full model `full` it holds. Pure arithmetic, no
    process group (the loader and the adapter pool use it)."""

    rank: int
    size: int
    full: ModelConfig

    @property
    def local(self) -> ModelConfig:
        """The shape this rank's modules, KV pool and adapter pool have (full vocabulary: the
        vocab-parallel modules shard it themselves)."""
        return dataclasses.replace(self.full, num_heads=self.full.num_heads // self.size,
                                   num_kv_heads=len(self.kv_heads()),
                                   intermediate_size=self.full.intermediate_size // self.size,
                                   moe_intermediate_size=self.full.moe_intermediate_size
                                   // self.size)

    def q_heads(self) -> range:
        n = self.full.num_heads // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    def kv_heads(self) -> range:
        kv = self.full.num_kv_heads
        if kv >= self.size:
            n = kv // self.size
            return range(self.rank * n, (self.rank + 1) * n)
        first = self.rank * kv // self.size  # the KV head of this rank's query heads
        return range(first, first + 1)

    def features(self, module: str) -> slice:
        """This rank's slice of a module's sharded dimension (output rows of a column-parallel
        module, input columns of a row-parallel one)."""
        d = self.full.head_dim
        if module in ("q_proj", "o_proj"):
            heads = self.q_heads()
            return slice(heads.start * d, heads.stop * d)
        if module in ("k_proj", "v_proj"):
            heads = self.kv_heads()
            return slice(heads.start * d, heads.stop * d)
        n = self.full.intermediate_size // self.size
        return slice(self.rank * n, (self.rank + 1) * n)

    def expert_features(self) -> slice:
        """This rank's slice of every expert's intermediate channels (the experts' gate and up
        rows, their down columns): each rank computes every expert's share, all-reduced."""
        n = self.full.moe_intermediate_size // self.size
        return slice(self.rank * n, (self.rank + 1) * n)

    def expert_weight(self, proj: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of one expert's gate / up ([I, H]: rows) or down ([H, I]: columns)
        tensor, or of transformers 5's stacked experts.gate_up_proj ([E, 2I, H]: each half's
        rows) and experts.down_proj ([E, H, I]: columns)."""
        cut, size = self.expert_features(), self.full.moe_intermediate_size
        if proj in ("gate", "up"):
            return tensor[cut]
        if proj == "down":
            return tensor[:, cut]
        if proj == "gate_up_proj":
            return torch.cat([tensor[:, cut], tensor[:, size + cut.start:size + cut.stop]], 1)
        return tensor[:, :, cut]

    def weight(self, module: str, kind: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a checkpoint projection tensor (kind: weight or bias; a tensor or
        a safetensors slice, read by the indexing). A row-parallel bias is added once, after the
        all-reduce, so every rank keeps it whole. A fused tensor (Phi-3's qkv_proj, gate_up_proj)
        gives each of its modules' parts."""
        if module in FUSED_MODULES:
            parts, start = [], 0
            for part in FUSED_MODULES[module]:
                cut = self.features(part)
                parts.append(tensor[start + cut.start:start + cut.stop])
                start += self.full.module_shape(part)[1]
            return torch.cat(parts)
        if module in COLUMN_MODULES:
            return tensor[self.features(module)]
        if kind == "bias":
            return tensor[:]
        return tensor[:, self.features(module)]

    def lora(self, module: str, a: torch.Tensor, b: torch.Tensor):
        """(A [r, in], B [out, r]) sliced for this rank: B's output rows of a column-parallel
        module, A's input columns of a row-parallel one; of the stacked experts, every expert's
        share of its intermediate channels (gate and up outputs, down inputs); the router's
        whole."""
        if module.startswith("experts."):
            return self._expert_lora(module, a, b)
        if module == "router":  # every rank routes every token: the router is whole
            return a, b
        if module in COLUMN_MODULES:
            return a, b[self.features(module)]
        return a[:, self.features(module)], b

    def _expert_lora(self, module: str, a: torch.Tensor, b: torch.Tensor):
        """A [r, E * in] and B [E * out, r] of experts.gate_up_proj (out: gate then up, each
        moe_intermediate_size) or experts.down_proj (in: moe_intermediate_size)."""
        experts, size, cut = (self.full.num_experts, self.full.moe_intermediate_size,
                              self.expert_features())
        if module == "experts.gate_up_proj":
            return a, b.reshape(experts, 2, size, -1)[:, :, cut].reshape(-1, b.shape[-1])
        return a.reshape(a.shape[0], experts, size)[:, :, cut].reshape(a.shape[0], -1), b

    @property
    def vocab_shard(self) -> int:
        return -(-self.full.vocab_size // self.size)

    def vocab_rows(self) -> slice:
        """This rank's rows of the (unpadded) vocabulary."""
        start = self.rank * self.vocab_shard
        return slice(min(start, self.full.vocab_size),
                     min(start + self.vocab_shard, self.full.vocab_size))


class TensorParallel:
    """A rank's Shard with its process groups: `group` for the model's collectives (NCCL on
    CUDA, gloo on the CPU), `control` (gloo) for the plan broadcast."""

    def __init__(self, shard: Shard, group, control):
        self.shard = shard
        self.rank, self.size = shard.rank, shard.size
        self.group = group
        self.control = control
        self._plans = msgspec.msgpack.Decoder(list[StepPlan | StepMasks])

    @classmethod
    def init(cls, rank: int, size: int, full: ModelConfig, rendezvous: str,
             device: torch.device) -> TensorParallel:
        """Join the group of `size` ranks meeting at `rendezvous` (a file:// or tcp:// URL);
        on CUDA each rank drives the device given."""
        check_shardable(full, size)
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo", init_method=rendezvous, rank=rank,
                                world_size=size, timeout=COLLECTIVE_TIMEOUT,
                                device_id=device if cuda else None)
        group = dist.group.WORLD
        control = dist.new_group(backend="gloo") if cuda else group
        return cls(Shard(rank, size, full), group, control)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=self.group)
        return t

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        """The elementwise maximum over every rank's `t` (in place)."""
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[T, vocab_shard] per rank -> [T, vocab] (the padding rows cut off)."""
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        dist.all_gather(parts, logits.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[:, : self.shard.full.vocab_size]

    def any_rank(self, flag: bool) -> bool:
        """Whether any rank's flag is set."""
        t = torch.tensor([int(flag)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control)
        return bool(t.item())

    def min_int(self, value: int) -> int:
        """The smallest of every rank's value (pool sizes all ranks must share)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def send_plans(self, plans: list[StepPlan | StepMasks]) -> None:
        """Rank 0: hand a batch of plans and late masks (possibly none: a tick) to every other
        rank."""
        self._broadcast(msgspec.msgpack.encode(plans))

    def recv_plans(self) -> list[StepPlan | StepMasks]:
        """Other ranks: the next batch rank 0 sends (blocks until it does)."""
        return self._plans.decode(self._broadcast(None))

    def _broadcast(self, data: bytes | None) -> bytes:
        length = torch.tensor([0 if data is None else len(data)], dtype=torch.int64)
        dist.broadcast(length, src=0, group=self.control)
        if length.item() == 0:
            return b""
        if data is None:
            buf = torch.empty(int(length.item()), dtype=torch.uint8)
        else:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.control)
        return data if data is not None else buf.numpy().tobytes()

    def close(self) -> None:
        """Leave the group together (a rank destroying its gloo pairs while a peer still uses
        them aborts that peer), then drop this object's references to the groups: a group
        still referenced outlives destroy_process_group and is torn down with the interpreter,
        threads running, which aborts the process ("terminate called without an active
        exception")."""
        if dist.is_initialized():
            dist.barrier(group=self.control)
            self.group = self.control = None
            dist.destroy_process_group()


def local_device(device: torch.device, rank: int, size: int, nnodes: int) -> torch.device:
    """The device rank `rank` drives: on CUDA its node's cuda:<local rank>."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", rank % (size // nnodes))
