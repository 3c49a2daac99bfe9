"""ServerArgs: everything `radixlora serve` was asked for, frozen, handed to every child process
as JSON on its stdin (its only start-up input besides the environment; never on a command line,
since it holds the keys)."""

from __future__ import annotations

import dataclasses
import ipaddress
from pathlib import Path

import msgspec

from radixlora.config import EngineConfig, ModelConfig

ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)} - {"extra"}


class Endpoints(msgspec.Struct, frozen=True, kw_only=True):
    """ZeroMQ addresses (ipc:// in a private directory, or tcp://127.0.0.1)."""

    launcher: str
    api: str
    tokenizer: str
    scheduler: str
    worker: str
    client: str
    registry: str = ""  # the registry's PUB socket (AdapterEvents)
    registry_wants: str = ""  # the registry's PULL socket (AdapterWanted)
    # data-parallel replicas (none: one, on scheduler, worker and api): replica i's scheduler
    # and worker, and the api socket its scheduler answers on
    schedulers: list[str] = []
    workers: list[str] = []
    replica_apis: list[str] = []

    @classmethod
    def in_dir(cls, directory: str | Path, client: str | None = None,
               replicas: int = 1) -> Endpoints:
        def ipc(name: str) -> str:
            return f"ipc://{Path(directory) / name}"

        def each(name: str) -> list[str]:
            return [ipc(f"{name}-dp{i}") for i in range(replicas)] if replicas > 1 else []

        return cls(
            launcher=ipc("launcher"),
            api=ipc("api"),
            tokenizer=ipc("tokenizer"),
            scheduler=ipc("scheduler"),
            worker=ipc("worker"),
            client=client or ipc("client"),
            registry=ipc("registry"),
            registry_wants=ipc("registry-wants"),
            schedulers=each("scheduler"),
            workers=each("worker"),
            replica_apis=each("api"),
        )

    @property
    def scheduler_list(self) -> list[str]:
        return self.schedulers or [self.scheduler]

    def replica(self, i: int) -> Endpoints:
        """What replica i's scheduler and worker use: its own scheduler, worker and api."""
        if not self.schedulers:
            return self
        return msgspec.structs.replace(self, scheduler=self.schedulers[i],
                                       worker=self.workers[i], api=self.replica_apis[i])


class ServerArgs(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    adapters: dict[str, str] = {}
    served_model_name: str | None = None
    tokenizer: str = ""  # --tokenizer: a directory with tokenizer.json (else the model's)
    chat_template: str = ""  # --chat-template's template text (else the tokenizer's)
    host: str = "127.0.0.1"
    port: int = 30000
    zmq_client_port: int | None = None
    engine: dict[str, object] = {}  # EngineConfig overrides
    tensor_parallel_size: int = 1  # worker ranks (processes), each holding a shard of the model
    nnodes: int = 1  # hosts the tensor-parallel ranks span, tensor_parallel_size / nnodes each
    node_rank: int = 0  # 0: the head (HTTP, scheduler, rank 0); others: only their worker ranks
    dist_init_addr: str | None = None  # HOST:PORT where every node's ranks meet (a TCPStore)
    dist_init_method: str = ""  # the rendezvous URL the launcher hands its worker ranks
    data_parallel_size: int = 1  # replicas: scheduler + worker groups behind one api
    dp_rank: int = 0  # the replica a scheduler or worker child serves
    router_policy: str = "cache_aware"  # how the replicas share requests (server/procs/router.py)
    vllm_metric_names: bool = False  # /metrics also under vLLM's names (the endpoint picker's)
    drain_timeout_s: float = 30.0
    step_timeout_s: float = 600.0  # a worker step running longer is a hung worker
    watchdog_timeout_s: float = 30.0  # a child silent this long (no heartbeat) is dead
    ready_timeout_s: float = 600.0  # --ready-timeout: to Sized, then again to Ready
    max_body_bytes: int = 8 << 20
    # logprob entries (a token's logprob, or one of its top alternatives) one client request
    # may return; None: one full context with the most top logprobs (context x 21)
    max_logprob_entries: int | None = None
    # stored /v1/responses (radixlora.server.http.response_store): JSON bytes, seconds
    responses_store_bytes: int = 256 << 20
    responses_store_ttl_s: float = 3600.0
    log_level: str = "info"
    log_requests: bool = False  # one INFO line per finished request (counts and times, no text)
    otlp_traces_endpoint: str | None = None  # OTLP/HTTP collector URL: one span per request
    stats_interval_s: float = 5.0  # the INFO stats line while busy; 0: off
    endpoints: Endpoints | None = None
    launcher_pid: int = 0
    state_dir: str = ""  # private to this server: adapter snapshots, registry state
    state_root: str | None = None  # --state-dir: where the launcher makes state_dir
    # hot-swap (docs/server.md, "Hot-swap")
    adapter_dir: str | None = None  # watched by the registry process
    tool_call_parser: str | None = None  # radixlora.protocol.tools.PARSERS: tool_choice "auto"
    adapter_rate: float = 1.0  # new adapters admitted per second (token bucket)
    adapter_burst: int = 1
    adapter_quiet_s: float = 0.5  # a changed adapter directory must be quiet this long
    max_swaps_per_s: float = 10.0  # adapter loads into the device pool, hard cap
    adapter_failure_policy: str = "reject"  # or "base": serve base-only, say so
    enable_admin: bool = False
    admin_api_key: str | None = None
    api_key: str = ""  # --api-key: Bearer key of every endpoint but /health and /metrics
    zmq_client_key: str = ""  # --zmq-client-key: the ZeroMQ client endpoint's (else api_key)
    allowed_adapter_roots: list[str] = []

    @property
    def tokenizer_dir(self) -> str:
        return self.tokenizer or self.model

    def __post_init__(self):
        if self.adapter_failure_policy not in ("reject", "base"):
            raise ValueError("adapter_failure_policy must be 'reject' or 'base'")
        if self.enable_admin and not self.admin_api_key:
            raise ValueError("--enable-admin needs --admin-api-key")
        if not self.watchdog_timeout_s > 0:
            raise ValueError("--watchdog-timeout must be > 0")
        if not self.stats_interval_s >= 0:
            raise ValueError("--stats-interval must be >= 0")
        if not 1 <= self.tensor_parallel_size <= 256:
            raise ValueError("--tensor-parallel-size must be in [1, 256]")
        if not 1 <= self.data_parallel_size <= 256:
            raise ValueError("--data-parallel-size must be in [1, 256]")
        if self.data_parallel_size > 1 and self.tensor_parallel_size > 1:
            raise ValueError("--data-parallel-size with --tensor-parallel-size > 1 is not "
                             "supported yet")
        self._check_nodes()
        if self.router_policy not in ("cache_aware", "round_robin"):
            raise ValueError("--router-policy must be 'cache_aware' or 'round_robin'")

    def _check_nodes(self) -> None:
        """--nnodes, --node-rank and --dist-init-addr make one group of
        --tensor-parallel-size ranks, split evenly over the nodes."""
        n, tp = self.nnodes, self.tensor_parallel_size
        if not 1 <= n <= 256:
            raise ValueError("--nnodes must be in [1, 256]")
        if not 0 <= self.node_rank < n:
            raise ValueError(f"--node-rank {self.node_rank} is out of range: --nnodes {n} "
                             f"numbers the nodes 0 to {n - 1}")
        if tp % n:
            raise ValueError(f"--tensor-parallel-size {tp} does not split over --nnodes {n}: "
                             "every node runs tensor-parallel-size / nnodes ranks")
        if n > 1 and not self.dist_init_addr:
            raise ValueError(f"--nnodes {n} needs --dist-init-addr HOST:PORT, an address of "
                             "node 0 every node can reach (the ranks meet there)")
        if self.dist_init_addr is None:
            return
        host, _ = split_host_port(self.dist_init_addr)
        if n == 1 and not is_loopback(host):
            raise ValueError(f"--dist-init-addr {self.dist_init_addr} is not a loopback address "
                             "but --nnodes is 1: one node's ranks meet on this host (give "
                             "--nnodes for a multi-node launch)")

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).resolve().name

    def served_model(self, config: EngineConfig | None = None,
                     confined: bool = False) -> ModelConfig:
        """The base as the server serves it. confined (adapters from --adapter-dir, admin loads
        and the workers' reads, not the launch line's --adapter): their base_model_name_or_path
        is read only inside the model's directory or an --allowed-adapter-root."""
        served = ModelConfig.from_dir(self.model).served(config or self.engine_config())
        if not confined:
            return served
        roots = (str(Path(self.model).resolve()), *(str(Path(r).resolve())
                                                     for r in self.allowed_adapter_roots))
        return dataclasses.replace(served, base_roots=roots)

    def engine_config(self) -> EngineConfig:
        unknown = set(self.engine) - ENGINE_FIELDS
        if unknown:
            raise ValueError(f"unknown engine options: {sorted(unknown)}")
        return EngineConfig(**self.engine)

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_json(cls, raw: str | bytes) -> ServerArgs:
        return msgspec.json.decode(raw, type=cls)


def split_host_port(addr: str) -> tuple[str, int]:
    """("HOST", PORT) of --dist-init-addr HOST:PORT (an IPv6 host in brackets: [::1]:29500)."""
    host, sep, port = addr.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--dist-init-addr expects HOST:PORT (port 1-65535), got {addr!r}")
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return False
