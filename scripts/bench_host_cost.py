"""Host cost of the serving pipeline: CPU seconds each `radixlora serve` process (api,
tokenizer, scheduler, worker) spends per generated token, over a streamed workload sent by
scripts/bench_serving.py. A process whose cost per token is C microseconds saturates one core at
1e6 / C tokens/s, the most the pipeline can deliver through it whatever the GPU does.

    python scripts/bench_host_cost.py                          # the bundled demo on this machine
    python scripts/bench_host_cost.py --model DIR --num-requests 256 --output-len 128

It starts the server itself (default flags plus --serve-args), runs the workload once to warm
up, then again while reading each process's user + system CPU time from /proc (Linux).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

ADMIN_KEY = "bench-host-cost"
SCRIPTS = Path(__file__).resolve().parent


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_server(args) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "radixlora.cli", "serve", "--port", str(args.port),
           "--enable-admin", "--log-level", "warning", *args.serve_args.split()]
    if args.model:
        cmd += ["--model", args.model]
    env = {**os.environ, "RADIXLORA_ADMIN_API_KEY": ADMIN_KEY}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"the server was not ready in {timeout_s:.0f} s")


def workload(url: str, args) -> dict:
    cmd = [sys.executable, str(SCRIPTS / "bench_serving.py"), "--base-url", url, "--json",
           "--num-requests", str(args.num_requests), "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--ignore-eos"]
    if args.adapters:
        cmd += ["--adapters", args.adapters]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: the bundled demo")
    p.add_argument("--adapters", default=None, help="comma-separated model names to request")
    p.add_argument("--serve-args", default="", help="more `radixlora serve` flags")
    p.add_argument("--port", type=int, default=30555)
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--input-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=128)
    args = p.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    proc = start_server(args)
    try:
        wait_ready(url, proc, 600)
        info = httpx.get(url + "/get_server_info",
                         headers={"authorization": f"Bearer {ADMIN_KEY}"}).json()
        pids = {name: pid for name, pid in info["pids"].items()}
        workload(url, args)
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        summary = workload(url, args)
        spent = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    finally:
        proc.terminate()
        proc.wait(60)
    tokens = summary["output_tokens"]
    print(f"{tokens} tokens, {summary['output_token_throughput']:.0f} tok/s")
    for name, seconds in spent.items():
        per_token = 1e6 * seconds / tokens
        print(f"{name:>10}: {seconds:6.2f} CPU s, {per_token:6.1f} us/token "
              f"(one core: {1e6 / max(per_token, 1e-9):,.0f} tok/s)")


if __name__ == "__main__":
    main()
