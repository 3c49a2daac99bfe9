"""Benchmark any OpenAI-compatible server (radixlora, SGLang, vLLM) with streaming completions.

Arrivals are Poisson (--rate R, exponential gaps) or fixed-rate (--arrival fixed); each request
picks an adapter by popularity (uniform, zipf, distinct = round-robin so neighbours differ) and
draws prompt and output lengths from a distribution (fixed, uniform, lognormal). Reports request
and token throughput, TTFT / ITL / end-to-end latency P50 and P99, and per-adapter counts.

    python scripts/bench_serving.py --base-url http://127.0.0.1:30000 --num-requests 200 \
        --rate 8 --popularity zipf --input-len 128 --output-len 64 --ignore-eos
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import numpy as np

WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "many",
         "adapters", "share", "one", "base")


@dataclass
class Result:
    adapter: str
    ok: bool
    output_tokens: int = 0
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    # [time.monotonic() at the chunk, seconds since the previous one] of gaps >= LONG_GAP_S
    long_gaps: list[list[float]] = field(default_factory=list)
    latency: float = 0.0
    error: str | None = None


def draw_length(rng: random.Random, mean: int, dist: str) -> int:
    if dist == "fixed":
        return mean
    if dist == "uniform":
        return rng.randint(max(1, mean // 2), mean * 3 // 2)
    return max(1, int(rng.lognormvariate(np.log(mean) - 0.125, 0.5)))


SHAREGPT_SIGMA = 1.0
LONG_GAP_S = 0.05  # a stream's chunk gaps this long are kept with their times (bench_e2e g)
SHAREGPT_PROMPT = (270, 2048)  # mean before the cap, cap
SHAREGPT_OUTPUT = (210, 1024)


def sharegpt_lengths(rng: random.Random, scale: float = 1.0) -> tuple[int, int]:
    """(prompt, output) tokens of one ShareGPT-like request: each lognormal with sigma 1 and
    the mean of SHAREGPT_PROMPT / SHAREGPT_OUTPUT (times `scale`), then capped."""

    def draw(mean: float, cap: int) -> int:
        mu = np.log(mean * scale) - SHAREGPT_SIGMA**2 / 2
        return int(min(max(1, round(rng.lognormvariate(mu, SHAREGPT_SIGMA))), cap * scale))

    return max(4, draw(*SHAREGPT_PROMPT)), draw(*SHAREGPT_OUTPUT)


def adapter_picker(adapters: list[str], popularity: str, rng: random.Random, zipf_s: float):
    if popularity == "distinct":
        counter = iter(range(10**12))
        return lambda: adapters[next(counter) % len(adapters)]
    if popularity == "zipf":
        weights = [1.0 / (rank + 1) ** zipf_s for rank in range(len(adapters))]
        return lambda: rng.choices(adapters, weights)[0]
    return lambda: rng.choice(adapters)


def arrival_gaps(n: int, rate: float, kind: str, rng: random.Random) -> list[float]:
    if rate <= 0:
        return [0.0] * n
    if kind == "fixed":
        return [1.0 / rate] * n
    return [rng.expovariate(rate) for _ in range(n)]


async def one_request(client: httpx.AsyncClient, args, adapter: str, prompt, max_tokens: int):
    body = {"model": adapter, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": args.temperature, "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True
    body.update(getattr(args, "extra_body", None) or {})
    result = Result(adapter, ok=False)
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                result.error = f"{resp.status_code}: {(await resp.aread())[:200]!r}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = str(chunk["error"])
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):
                    continue
                now = time.perf_counter()
                if result.ttft is None:
                    result.ttft = now - start
                else:
                    result.itls.append(now - last)
                    if now - last >= LONG_GAP_S:
                        result.long_gaps.append([time.monotonic(), now - last])
                last = now
        result.ok = True
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
    result.latency = time.perf_counter() - start
    return result


def make_prompt(rng: random.Random, length: int, kind: str, vocab: int):
    if kind == "ids":
        return [rng.randrange(3, vocab) for _ in range(length)]
    return " ".join(rng.choice(WORDS) for _ in range(length))


async def list_adapters(client: httpx.AsyncClient) -> list[str]:
    models = (await client.get("/v1/models")).json()["data"]
    return [m["id"] for m in models]


@dataclass
class RequestSpec:
    """One request to send: the model (adapter or base name), its prompt and max_tokens."""

    adapter: str
    prompt: str | list[int]
    max_tokens: int


def plan_requests(args, adapters: list[str], rng: random.Random
                  ) -> tuple[list[float], list[RequestSpec]]:
    """The arrival gaps and the requests of a run, drawn from `rng` in the order `run` has
    always drawn them (gaps, then per request: prompt, output length, adapter)."""
    pick = adapter_picker(adapters, args.popularity, rng, args.zipf_s)
    gaps = arrival_gaps(args.num_requests, args.rate, args.arrival, rng)
    specs = []
    for _ in gaps:
        prompt = make_prompt(rng, draw_length(rng, args.input_len, args.len_dist),
                             args.prompt_kind, args.vocab_size)
        max_tokens = draw_length(rng, args.output_len, args.len_dist)
        specs.append(RequestSpec(pick(), prompt, max_tokens))
    return gaps, specs


def make_client(args) -> httpx.AsyncClient:
    """An HTTP client with at most args.max_concurrency connections (None: no cap, so every
    request is sent when it arrives)."""
    limits = httpx.Limits(max_connections=args.max_concurrency,
                          max_keepalive_connections=args.max_concurrency)
    return httpx.AsyncClient(base_url=args.base_url, timeout=args.timeout, limits=limits)


async def send_requests(client: httpx.AsyncClient, args, gaps: list[float],
                        specs: list[RequestSpec]) -> tuple[list[Result], float]:
    """Send specs[i] gaps[i] seconds after the previous one; (results, wall seconds)."""
    tasks = []
    start = time.perf_counter()
    for gap, spec in zip(gaps, specs):
        await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(one_request(client, args, spec.adapter, spec.prompt,
                                                     spec.max_tokens)))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


async def run(args) -> dict:
    rng = random.Random(args.seed)
    async with make_client(args) as client:
        adapters = args.adapters.split(",") if args.adapters else await list_adapters(client)
        gaps, specs = plan_requests(args, adapters, rng)
        results, duration = await send_requests(client, args, gaps, specs)
        return summarize(results, duration)


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) * 1000 if values else None


def summarize(results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [x for r in ok for x in r.itls]  # gaps between streamed chunks
    lat = [r.latency for r in ok]
    tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "errors": Counter(r.error for r in results if not r.ok).most_common(5),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": tokens / duration,
        "ttft_ms": {"p50": _pct(ttfts, 50), "p90": _pct(ttfts, 90), "p99": _pct(ttfts, 99)},
        "itl_ms": {"p50": _pct(itls, 50), "p90": _pct(itls, 90), "p99": _pct(itls, 99)},
        "e2e_ms": {"p50": _pct(lat, 50), "p99": _pct(lat, 99)},
        "output_tokens": tokens,
        "mean_e2e_s": float(np.mean(lat)) if lat else None,
        "per_adapter": dict(Counter(r.adapter for r in results)),
        "ttft_ms_by_popularity": ttft_by_popularity(ok),
    }


def ttft_by_popularity(ok: list[Result]) -> dict:
    """TTFT P50 / P99 of the requests on the most-requested adapters that together hold half
    of the requests ("popular"), and of the rest ("rare"): a tail that only the rare ones have
    points at adapter residency rather than at the steps."""
    counts = Counter(r.adapter for r in ok)
    popular, held = set(), 0
    for name, n in counts.most_common():
        if held * 2 >= len(ok):
            break
        popular.add(name)
        held += n
    out = {}
    for label, keep in (("popular", True), ("rare", False)):
        ttfts = [r.ttft for r in ok if r.ttft is not None and (r.adapter in popular) == keep]
        out[label] = {"adapters": len(popular) if keep else len(counts) - len(popular),
                      "requests": len(ttfts), "p50": _pct(ttfts, 50), "p99": _pct(ttfts, 99)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--adapters", default=None,
                   help="comma-separated model names (default: every id of /v1/models)")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--rate", type=float, default=0.0, help="requests/s; 0 = all at once")
    p.add_argument("--arrival", choices=["poisson", "fixed"], default="poisson")
    p.add_argument("--popularity", choices=["uniform", "zipf", "distinct"], default="uniform")
    p.add_argument("--zipf-s", type=float, default=1.1)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--len-dist", choices=["fixed", "uniform", "lognormal"], default="fixed")
    p.add_argument("--prompt-kind", choices=["text", "ids"], default="text")
    p.add_argument("--vocab-size", type=int, default=500, help="for --prompt-kind ids")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="cap on requests in flight (default: none, every request is sent "
                        "when it arrives)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = p.parse_args()
    summary = asyncio.run(run(args))
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    for key, value in summary.items():
        print(f"{key:>24}: {value}")


if __name__ == "__main__":
    main()
