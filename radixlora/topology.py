"""Which worker ranks a node runs and what they are called: plain arithmetic the launcher, the
supervisor and the workers share, without torch (radixlora.distributed has the process group)."""

from __future__ import annotations

import os

TP_RANK_ENV = "RADIXLORA_TP_RANK"  # set by the launcher on each worker rank's process


def node_ranks(size: int, nnodes: int, node_rank: int) -> range:
    """The ranks node `node_rank` of `nnodes` runs: size / nnodes consecutive ones, so node 0
    holds rank 0 (the one the scheduler talks to)."""
    per_node = size // nnodes
    return range(node_rank * per_node, (node_rank + 1) * per_node)


def rank_from_env() -> int:
    return int(os.environ.get(TP_RANK_ENV, "0"))


def worker_rank_name(rank: int) -> str:
    """The process name of a worker rank: rank 0 is the worker, the others worker-tp<rank>."""
    return "worker" if rank == 0 else f"worker-tp{rank}"
