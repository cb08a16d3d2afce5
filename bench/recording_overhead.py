"""What recording a line's traffic costs its users (docs/online.md): the project's server answering the same chat
completions with and without `--record-dir` (each record fsynced before its reply; requests finishing together
share one fsync), in alternating rounds on one server build, through the OpenAI SDK.

    python bench/recording_overhead.py [--requests 256] [--concurrency 32] [--rounds 3] [--max-tokens 8]

The model is the embedded default (configs/tiny_cpu.yaml's warm-started tiny model, built before any clock starts).
Prints each round's requests per second and latency percentiles for both servers; the last line is one JSON object
with `throughput_ratio` (recording / not recording, medians over rounds) and the p50/p99 latency ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def start_server(model: str, log: Path, extra: list[str]):
    from areal_pipeline.config import InferenceConfig
    from areal_pipeline.inference.launcher import launch_servers

    cfg = InferenceConfig(num_servers=1, num_threads=1, max_batch_size=256)
    return launch_servers(model, cfg, seed=1, log_dir=log, extra_args=extra)[0]


async def one_round(address: str, token: str, n: int, concurrency: int, max_tokens: int) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"http://{address}/v1", api_key=token, max_retries=0, timeout=120)
    limit = asyncio.Semaphore(concurrency)
    latencies: list[float] = []

    async def ask(i: int) -> None:
        async with limit:
            started = time.perf_counter()
            await client.chat.completions.create(
                model="m", max_tokens=max_tokens, temperature=1.0,
                messages=[{"role": "user", "content": f"What is {i % 50}+{i % 7}? Answer with the number."}])
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(ask(i) for i in range(n)))
    seconds = time.perf_counter() - started
    await client.close()
    latencies.sort()
    return {"requests_per_s": n / seconds, "p50_s": latencies[len(latencies) // 2],
            "p99_s": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=8)
    args = p.parse_args()

    from areal_pipeline import auth
    from areal_pipeline.model import resolve_model_path
    from areal_pipeline.online.traffic_log import read_records
    from areal_pipeline.run_spec import load_config

    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        cfg = load_config(REPO / "configs" / "tiny_cpu.yaml", [f"output_dir={work}"])
        token = auth.ensure_run_token(work) or "none"
        model = resolve_model_path(cfg.model, cfg.output_dir, cfg.seed)
        record_dir = work / "traffic"
        servers = {"plain": start_server(model, work / "logs-plain", []),
                   "recording": start_server(model, work / "logs-recording", ["--record-dir", str(record_dir)])}
        figures: dict[str, list[dict]] = {name: [] for name in servers}
        try:
            for name, server in servers.items():  # a warm-up round each, not counted
                asyncio.run(one_round(server.address, token, 32, args.concurrency, args.max_tokens))
            for r in range(args.rounds):
                for name in (("plain", "recording") if r % 2 == 0 else ("recording", "plain")):
                    result = asyncio.run(one_round(servers[name].address, token, args.requests, args.concurrency,
                                                   args.max_tokens))
                    figures[name].append(result)
                    print(f"round {r + 1} {name:9s}: {result['requests_per_s']:7.1f} req/s, p50 "
                          f"{result['p50_s'] * 1000:6.1f} ms, p99 {result['p99_s'] * 1000:6.1f} ms", flush=True)
        finally:
            for server in servers.values():
                server.stop()
        recorded, problems = read_records(record_dir, "requests")
    expected = 32 + args.rounds * args.requests
    if len(recorded) != expected or problems:
        raise SystemExit(f"the recording server kept {len(recorded)} records of {expected} ({problems})")

    def median(name: str, key: str) -> float:
        return statistics.median(f[key] for f in figures[name])

    summary = {"requests": args.requests, "concurrency": args.concurrency, "rounds": args.rounds,
               "max_tokens": args.max_tokens, "records_kept": len(recorded),
               "plain_requests_per_s": round(median("plain", "requests_per_s"), 2),
               "recording_requests_per_s": round(median("recording", "requests_per_s"), 2),
               "throughput_ratio": round(median("recording", "requests_per_s") / median("plain", "requests_per_s"),
                                         3),
               "p50_latency_ratio": round(median("recording", "p50_s") / median("plain", "p50_s"), 3),
               "p99_latency_ratio": round(median("recording", "p99_s") / median("plain", "p99_s"), 3)}
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
