"""Compiled Triton kernels kept across starts, and compiled in parallel.

Kernels compile into a directory that outlives the process (EngineConfig.compile_cache_dir,
`--compile-cache-dir`; Triton's own cache format under triton/). Beside it, a manifest per
model and kernel-relevant fields (manifest_key: dtypes, backends, device, versions) lists
every kernel variant (Triton's specialization data) the configurations of that kind launched,
and which configurations (config_key: every flag the worker reads) it covers. A start has the
manifest's variants compiled, or read back from the cache, by several processes while the
weights load, then loads them into this process before the first forward. A start whose
configuration the manifest does not cover runs every CUDA graph's forward once dry (variants not
loaded are recorded, not launched), has those compiled the same way, and adds them and its
configuration to the manifest when it is ready. Either way no variant is compiled twice, and
none is compiled on the thread that launches steps after warm-up.

The compile processes are `python -m radixlora.worker.compile_cache`, one JSON line per variant on
stdin; nothing is unpickled."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import py_compile
import queue
import subprocess
import sys
import threading
from pathlib import Path

log = logging.getLogger(__spec__.name)  # the module's name also when run with -m

MANIFESTS = "manifests"
MANIFEST_VERSION = 1
MAX_COMPILE_PROCESSES = 16


def default_cache_dir() -> Path:
    """Under the user's cache directory ($XDG_CACHE_HOME, else ~/.cache)."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "radixlora" / "compile"


def use_cache_dir(path: str | Path | None) -> Path:
    """Make `path` (None: the default) the compile cache of this process and of the processes
    it starts; returns it. Triton's TRITON_CACHE_DIR, when set and no path is given, stays
    Triton's, with the manifests in the default directory."""
    root = Path(path).expanduser() if path else default_cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    if path or not os.environ.get("TRITON_CACHE_DIR"):
        os.environ["TRITON_CACHE_DIR"] = str(root / "triton")
    return root


def bytecode_env(root: Path) -> dict[str, str]:
    """PYTHONPYCACHEPREFIX=root/pycache for the processes a server starts, where the installed
    torch has no bytecode beside its sources (a read-only install, or one made with pip's
    --no-compile): each process would otherwise compile torch's Python sources at every
    start, seconds of CPU each. Empty where the bytecode exists, where writing bytecode is
    turned off, or where a prefix is set already."""
    if sys.pycache_prefix or sys.dont_write_bytecode:
        return {}
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return {}
    if os.path.exists(importlib.util.cache_from_source(spec.origin)):
        return {}
    return {"PYTHONPYCACHEPREFIX": str(root / "pycache")}


def write_bytecode(root: Path, modules=None) -> int:
    """The bytecode of `modules` (default: every module this process imported), written where
    bytecode_env points the server's processes (`radixlora warmup`: an image whose torch has
    no bytecode then starts without compiling Python sources); returns how many were
    written."""
    prefix = bytecode_env(root).get("PYTHONPYCACHEPREFIX")
    if prefix is None:
        return 0
    previous, sys.pycache_prefix = sys.pycache_prefix, prefix
    written = 0
    try:
        for module in list(sys.modules.values()) if modules is None else modules:
            source = getattr(module, "__file__", None)
            if isinstance(source, str) and source.endswith(".py"):
                with contextlib.suppress(py_compile.PyCompileError, OSError):
                    py_compile.compile(source, doraise=True)
                    written += 1
    finally:
        sys.pycache_prefix = previous
    return written


# the engine config's fields that the kernels' code depends on; the others (limits, pool sizes,
# switches) only choose among variants of that code, so every configuration of one model, these
# fields and one device shares one manifest, the union of the variants each one launched
KERNEL_FIELDS = ("dtype", "lora_dtype", "kv_cache_dtype", "quantization", "lora_backend",
                 "attention_backend")
# read by the scheduler alone (no worker, model or kernel code reads them): a launch that
# changes only these launches the same variants, so it needs no dry run
SCHEDULER_FIELDS = ("enable_radix_cache", "itl_target_ms", "max_adapter_sets_per_batch",
                    "grammar_compile_timeout", "grammar_compile_memory_mb")


def manifest_key(model_cfg, config, device_name: str) -> str:
    """The name of the manifest a configuration shares: a digest of the model's shape and
    weight format, the KERNEL_FIELDS, the device and the Triton and torch versions."""
    kernel_fields = {f: getattr(config, f) for f in KERNEL_FIELDS}
    return _digest((_model_key(model_cfg), kernel_fields, device_name))


def config_key(model_cfg, config, device_name: str) -> str:
    """A digest of the configuration the worker runs (the same for `radixlora warmup`,
    `radixlora serve` and the Engine given the same flags; the SCHEDULER_FIELDS left out):
    whether a dry run has found its variants yet."""
    # the target modules, start rows and start rank (inferred from the start-up adapters, which
    # `radixlora warmup` is not given) only set pool row counts and which graphs wait for ready
    config = dataclasses.replace(config, host_adapter_bytes=None, compile_cache_dir=None, seed=0,
                                 qlora_mismatch="refuse", lora_target_modules=None,
                                 start_adapter_rows=None, start_adapter_rank=None,
                                 **{f.name: f.default for f in dataclasses.fields(config)
                                    if f.name in SCHEDULER_FIELDS})
    return _digest((_model_key(model_cfg), config, device_name))


def _model_key(model_cfg):
    return dataclasses.replace(model_cfg, base_roots=None, qlora_mismatch="refuse")


def _digest(parts) -> str:
    import torch
    import triton

    return hashlib.sha256(repr((*parts, triton.__version__, torch.__version__)).encode()
                          ).hexdigest()[:24]


Entry = tuple[str, str, str]  # (module, qualified name, Triton's specialization data)


class KernelCache:
    """The variants one ModelRunner launches: recorded from start_recording() to
    stop_recording(), compiled ahead by start() (the manifest's) and in dry runs (those found),
    loaded into this process by finish(), and kept in the manifest by save(), with the
    configurations (config_key) whose variants it holds."""

    def __init__(self, root: Path, key: str, processes: int, config: str = ""):
        self.path = root / MANIFESTS / f"{key}.json"
        self.triton_dir = Path(os.environ.get("TRITON_CACHE_DIR") or root / "triton")
        self.processes = max(1, min(processes, MAX_COMPILE_PROCESSES))
        self.config = config
        self.known, self.configs = _read_manifest(self.path)
        self.seen: dict[str, Entry] = {}
        self.ahead: dict[str, Entry] = {}  # sent to the compile processes, loaded by finish()
        self.dry = False
        self.compilers: list[_Compiler] = []
        self._sent = 0
        self._loader: threading.Thread | None = None
        self.loaded = 0

    @property
    def covers_config(self) -> bool:
        """The manifest holds every variant this configuration launches (a start with it
        recorded them): no dry run is needed."""
        return self.config in self.configs

    def start(self) -> None:
        """Begin what finish() waits for, while the caller loads the weights: with a manifest
        whose variants the cache directory seems to hold, load them on a thread (reads, no
        compile); otherwise start the compile processes (their imports take seconds) and send
        them the manifest's variants, if any."""
        if self.known and _cache_entries(self.triton_dir) >= len(self.known):
            self.ahead = dict(self.known)
            self._loader = threading.Thread(target=self._load_ahead, name="kernel-preload",
                                            daemon=True)
            self._loader.start()
            return
        self.compilers = [_Compiler() for _ in range(self.processes)]
        self.compile_ahead(self.known)

    def compile_ahead(self, entries: dict[str, Entry]) -> None:
        """Send `entries` to the compile processes (each variant once)."""
        for ident, entry in entries.items():
            if ident in self.ahead:
                continue
            self.ahead[ident] = entry
            self.compilers[self._sent % len(self.compilers)].send(entry)
            self._sent += 1

    def finish(self) -> int:
        """Wait for the variants sent to the compile processes, then load them into this
        process (from the cache directory: no compile here unless a process failed on it).
        Returns how many variants were loaded."""
        for compiler in self.compilers:
            compiler.wait()
        if self._loader is not None:
            self._loader.join()
            self._loader = None
        else:
            self._load_ahead()
        loaded, self.loaded = self.loaded, 0
        self.ahead = {}
        return loaded

    def _load_ahead(self) -> None:
        for ident, entry in self.ahead.items():
            try:
                _jit_function(entry[0], entry[1]).preload(entry[2])
                self.loaded += 1
            except Exception as e:  # a stale manifest entry: compiled on first use instead
                log.debug("kernel %s.%s not preloaded: %s", entry[0], entry[1], e)
            self.seen.setdefault(ident, entry)

    def start_recording(self) -> None:
        """Record every variant this process compiles or loads from now on."""
        from triton import knobs

        knobs.runtime.jit_cache_hook = self._hook

    def stop_recording(self, warn_late: bool) -> None:
        """Stop recording and the compile processes (without waiting for them to exit); with
        warn_late, each variant compiled from now on is logged as a warning (warm-up should
        have compiled them all)."""
        from triton import knobs

        knobs.runtime.jit_cache_hook = _late_compile if warn_late else None
        compilers, self.compilers = self.compilers, []
        for compiler in compilers:
            compiler.end_input()
        if compilers:  # each takes about half a second to exit; nothing here needs that
            threading.Thread(target=_wait_exits, args=(compilers,), name="compile-exits",
                             daemon=True).start()

    @contextlib.contextmanager
    def dry_run(self):
        """Inside, kernel launches of variants not loaded yet are recorded and sent to the
        compile processes instead of compiled and launched (their outputs are not written);
        finish() then waits for them and loads them."""
        if not self.compilers:
            self.compilers = [_Compiler() for _ in range(self.processes)]
        self.dry = True
        try:
            yield self
        finally:
            self.dry = False

    def _hook(self, *, fn, compile, **_) -> bool | None:
        data = compile["specialization_data"]
        ident = hashlib.sha256(data.encode()).hexdigest()
        entry = (getattr(fn.module, "__name__", fn.module), fn.name, data)
        if not self.dry:
            self.seen.setdefault(ident, entry)
            return None
        self.compile_ahead({ident: entry})
        return True

    def save(self) -> None:
        """Write the manifest: the variants of this start (with the earlier ones kept) and this
        configuration among those it covers, when that changes what was read."""
        entries = {**self.known, **self.seen}
        configs = sorted({*self.configs, self.config} - {""})
        if entries.keys() == self.known.keys() and configs == self.configs:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"version": MANIFEST_VERSION, "configs": configs,
                                   "kernels": [list(e) for e in entries.values()]}))
        os.replace(tmp, self.path)
        self.known, self.configs = entries, configs


def _late_compile(*, fn, compile, **_) -> None:
    log.warning("a kernel variant compiled after warm-up: %s(%s)", fn.name,
                _variant_args(compile["specialization_data"]))


def _variant_args(data: str) -> str:
    """What sets a variant apart, by argument name: its constants and the specializations Triton
    made (divisibility by 16, a value of 1), from the JSON of triton's
    serialize_specialization_data; the JSON itself where it has another form."""
    try:
        spec = json.loads(data)
        names = list(spec["signature"])
        constants = {names[k[0]]: v for k, v in zip(spec["constant_keys"], spec["constant_vals"])}
        attrs = {names[k[0]]: v for k, v in zip(spec["attrs_keys"], spec["attrs_vals"])}
    except (ValueError, KeyError, IndexError, TypeError):
        return " ".join(data.split())
    return f"constants {constants}; specialized {attrs}"


def _cache_entries(path: Path) -> int:
    try:
        return sum(1 for _ in os.scandir(path))
    except OSError:
        return 0


def _read_manifest(path: Path) -> tuple[dict[str, Entry], list[str]]:
    """(the variants, the configurations they cover); nothing from a damaged manifest."""
    try:
        data = json.loads(path.read_text())
        if data.get("version") != MANIFEST_VERSION:
            return {}, []
        entries = {hashlib.sha256(e[2].encode()).hexdigest(): (e[0], e[1], e[2])
                   for e in data["kernels"]}
        configs = data.get("configs", [])
        if not all(isinstance(c, str) for c in configs):
            return {}, []
        return entries, sorted(configs)
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError):
        return {}, []


def _jit_function(module: str, qualname: str):
    """The JITFunction a manifest entry names (under any autotuner or heuristics wrapper)."""
    from triton.runtime.jit import JITFunction

    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    while not isinstance(obj, JITFunction):
        obj = obj.fn
    return obj


class _Compiler:
    """One compile process: variants go to it as JSON lines; it compiles each into the cache
    directory (inherited through TRITON_CACHE_DIR) and answers a line for each."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-m", "radixlora.worker.compile_cache"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.pending = 0

    def send(self, entry: Entry) -> None:
        self.proc.stdin.write(json.dumps(entry) + "\n")
        self.proc.stdin.flush()
        self.pending += 1

    def wait(self) -> None:
        """Until every variant sent is compiled (or the process is gone)."""
        while self.pending and self.proc.stdout.readline():
            self.pending -= 1
        self.pending = 0

    def end_input(self) -> None:
        """No more variants: the process exits once it has answered those sent."""
        self.proc.stdin.close()


def _wait_exits(compilers: list[_Compiler]) -> None:
    for compiler in compilers:
        compiler.proc.wait()


def compile_lines(lines) -> tuple[int, int]:
    """Compile every variant of `lines` (JSON entries) into the cache, answering a line on
    stdout for each; (compiled, failed)."""
    done = failed = 0
    for line in lines:
        module, qualname, data = json.loads(line)
        try:
            _jit_function(module, qualname).preload(data)
            done += 1
        except Exception as e:
            failed += 1
            print(f"radixlora.worker.compile_cache: {module}.{qualname}: {e}", file=sys.stderr)
        print("done", flush=True)
    return done, failed


def _stdin_lines():
    """Lines of stdin read on a thread, so the sender never waits while a variant compiles."""
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in sys.stdin:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    while (line := lines.get()) is not None:
        yield line


def _import_kernels() -> None:
    """What compiling needs, imported before the first variant arrives: the kernel modules,
    Triton and the device's target."""
    import pkgutil

    from triton.runtime import driver

    import radixlora_kernels

    for module in pkgutil.iter_modules(radixlora_kernels.__path__):
        importlib.import_module(f"radixlora_kernels.{module.name}")
    with contextlib.suppress(RuntimeError):  # no GPU driver: every variant fails, answered
        driver.active.get_current_target()


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    _import_kernels()
    compile_lines(_stdin_lines())
