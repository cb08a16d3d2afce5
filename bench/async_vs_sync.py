"""Asynchronous vs synchronous training: wall time for the same number of trained samples (the same iterations
of the default config) with max_head_offpolicyness eta = 0 (synchronous), 1 and 2.

    python bench/async_vs_sync.py [--iterations N] [--etas 0 1 2] [--rounds 2] [overrides ...]
    # at scale: 1024 episodes an iteration (128 prompts x 8) against 2 servers
    python bench/async_vs_sync.py --iterations 12 --etas 0 1 rollout.batch_size=128 \
        rollout.max_concurrent_rollouts=1024 inference.num_servers=2 inference.max_batch_size=512

The time is that of the iterations themselves (services started beforehand, for every variant alike), through
`Pipeline.run_iterations`: with eta > 0, iteration k+1's rollout and advantages run during iteration k's update,
as in the train flow. By default a variant runs the config's whole `total_iterations` (100 on the default config):
the first iteration (~1.5 s: first update, first requests) is alike in every variant, so few iterations
understate the speed-up. `steady_speedup_eta<e>` compares the median iteration periods (iteration 2 on).
`generation_idle_eta<e>`: the share of the servers' time (wall x servers) in which they generated nothing (their
`busy_seconds`); `training_idle_eta<e>`: the share in which the trainer ran none of its nodes (weight pushes, which
stall both sides, counted as idle and printed apart). Asynchronous training is worth its staleness where it turns
both sides' idle time into work.
This machine's speed drifts by up to ~30% within minutes, so each variant runs `--rounds` times in ABBA order
(etas, then reversed) and the means are compared: a drift that slowed the later variants would otherwise show
up as a speed-up or a loss.
Target (issue 6): eta=1 at least 1.5x faster than eta=0 on 2 cores. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


# The nodes that occupy the trainer; the weight push (broadcast_weights) stalls both sides and is counted apart.
TRAINER_NODES = ("ref_logprobs", "proximal_logprobs", "ppo_update", "checkpoint")


def servers_busy_seconds(addresses: list[str], inference_cfg) -> float | None:
    """The servers' seconds spent generating, summed (the project's server's `busy_seconds`); None for an engine
    that does not count them."""
    import asyncio

    from areal_pipeline.inference.backend import engine_for

    engine = engine_for(addresses, inference_cfg)

    async def ask() -> list[dict]:
        try:
            return [await engine.get_server_info(a) for a in addresses]
        finally:
            await engine.close()

    states = [(info.get("internal_states") or [{}])[0] for info in asyncio.run(ask())]
    if any("busy_seconds" not in s for s in states):
        return None
    return sum(s["busy_seconds"] for s in states)


def timed_run(config: str, overrides: list[str]) -> tuple[float, list[float], list[dict], dict]:
    """(wall seconds of the iterations, each iteration's period, their metrics records, how idle each side was)."""
    from areal_pipeline.pipeline import Pipeline
    from areal_pipeline.run_dir import run_lock
    from areal_pipeline.run_spec import load_config

    cfg = load_config(config, overrides)
    pipeline = Pipeline(cfg)
    with run_lock(cfg.run_dir):
        try:
            pipeline.start()
            addresses = list(pipeline.services.addresses)
            busy_before = servers_busy_seconds(addresses, cfg.inference)
            started = time.time()
            records = pipeline.run_iterations(1, cfg.total_iterations)
            wall = time.time() - started
            busy_after = servers_busy_seconds(addresses, cfg.inference)
        finally:
            pipeline.close()
            pipeline.services.stop()
    # an iteration ends when it writes its metrics
    ends = [started] + [pipeline.paths.metrics(r["iteration"]).stat().st_mtime for r in records]
    trainer_busy = sum(r.get(f"time_{node}", 0.0) for r in records for node in TRAINER_NODES)
    push = sum(r.get("time_broadcast_weights", 0.0) for r in records)
    idle = {
        # the share of the servers' wall time (all of them) in which they generated nothing
        "generation_idle": (None if busy_before is None else
                            round(1 - (busy_after - busy_before) / (len(addresses) * wall), 3)),
        "training_idle": round(1 - trainer_busy / wall, 3),  # the trainer's, weight pushes counted as idle
        "weight_push_share": round(push / wall, 3),
    }
    return wall, [b - a for a, b in zip(ends, ends[1:])], records, idle


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/tiny_cpu.yaml")
    p.add_argument("--iterations", type=int, default=None, help="default: the config's total_iterations")
    p.add_argument("--etas", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--rounds", type=int, default=2,
                   help="runs of each variant, in the order etas, then reversed, ... (ABBA), averaged")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-async-"))
    walls, periods, rewards, staleness, idles = ({e: [] for e in args.etas} for _ in range(5))
    for round_ in range(args.rounds):
        for eta in args.etas if round_ % 2 == 0 else reversed(args.etas):
            overrides = [f"output_dir={work}", f"run_id=eta{eta}-{round_}", "eval_freq=0",
                         f"rollout.max_head_offpolicyness={eta}",
                         *([f"total_iterations={args.iterations}"] if args.iterations else []), *args.overrides]
            wall, iteration_periods, records, idle = timed_run(args.config, overrides)
            walls[eta].append(wall)
            idles[eta].append(idle)
            periods[eta].append(statistics.median(iteration_periods[1:] or iteration_periods))
            rewards[eta].append(sum(r["reward_mean"] for r in records[-3:]) / min(3, len(records)))
            staleness[eta].append(max(r["staleness"] for r in records))
            later = records[1:] or records
            nodes = {key[5:]: round(statistics.median(r.get(key, 0.0) for r in later), 3)
                     for key in sorted({k for r in later for k in r if k.startswith("time_")})}
            print(f"eta={eta} (round {round_ + 1}): node medians from iteration 2, s: {nodes}", flush=True)
            print(f"eta={eta} (round {round_ + 1}): {wall:.1f}s for {len(records)} iterations (first "
                  f"{iteration_periods[0]:.2f}s, then {periods[eta][-1]:.3f}s median), max staleness "
                  f"{staleness[eta][-1]}, reward of the last iterations {rewards[eta][-1]:.3f}; idle: generation "
                  f"{idle['generation_idle']}, training {idle['training_idle']} (weight pushes "
                  f"{idle['weight_push_share']})", flush=True)
    wall = {e: statistics.mean(w) for e, w in walls.items()}
    period = {e: statistics.mean(p) for e, p in periods.items()}
    base = args.etas[0]
    print(json.dumps({
        "iterations": len(records),
        "rounds": args.rounds,
        **{f"eta{e}_seconds": round(w, 1) for e, w in wall.items()},
        **{f"speedup_eta{e}": round(wall[base] / w, 3) for e, w in wall.items() if e != base},
        **{f"steady_speedup_eta{e}": round(period[base] / p, 3) for e, p in period.items() if e != base},
        **{f"max_staleness_eta{e}": max(s) for e, s in staleness.items()},
        **{f"{side}_eta{e}": mean_or_none([i[side] for i in runs])
           for e, runs in idles.items() for side in ("generation_idle", "training_idle")},
    }))


def mean_or_none(values: list) -> float | None:
    return None if any(v is None for v in values) else round(statistics.mean(values), 3)


if __name__ == "__main__":
    main()
