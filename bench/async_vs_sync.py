"""Asynchronous vs synchronous training: wall time for the same number of trained samples (the same iterations
of the default config) with max_head_offpolicyness eta = 0 (synchronous), 1 and 2.

    python bench/async_vs_sync.py [--iterations N] [--etas 0 1 2] [--rounds 2] [overrides ...]

The time is that of the iterations themselves (services started beforehand, for every variant alike), through
`Pipeline.run_iterations`: with eta > 0, iteration k+1's rollout and advantages run during iteration k's update,
as in the train flow. By default a variant runs the config's whole `total_iterations` (100 on the default config):
the first iteration (~1.5 s: first update, first requests) is alike in every variant, so few iterations
understate the speed-up. `steady_speedup_eta<e>` compares the median iteration periods (iteration 2 on).
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


def timed_run(config: str, overrides: list[str]) -> tuple[float, list[float], list[dict]]:
    """(wall seconds of the iterations, each iteration's period, their metrics records)."""
    from areal_pipeline.pipeline import Pipeline
    from areal_pipeline.run_dir import run_lock
    from areal_pipeline.run_spec import load_config

    cfg = load_config(config, overrides)
    pipeline = Pipeline(cfg)
    with run_lock(cfg.run_dir):
        try:
            pipeline.start()
            started = time.time()
            records = pipeline.run_iterations(1, cfg.total_iterations)
            wall = time.time() - started
        finally:
            pipeline.close()
            pipeline.services.stop()
    # an iteration ends when it writes its metrics
    ends = [started] + [pipeline.paths.metrics(r["iteration"]).stat().st_mtime for r in records]
    return wall, [b - a for a, b in zip(ends, ends[1:])], records


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
    walls, periods, rewards, staleness = ({e: [] for e in args.etas} for _ in range(4))
    for round_ in range(args.rounds):
        for eta in args.etas if round_ % 2 == 0 else reversed(args.etas):
            overrides = [f"output_dir={work}", f"run_id=eta{eta}-{round_}", "eval_freq=0",
                         f"rollout.max_head_offpolicyness={eta}",
                         *([f"total_iterations={args.iterations}"] if args.iterations else []), *args.overrides]
            wall, iteration_periods, records = timed_run(args.config, overrides)
            walls[eta].append(wall)
            periods[eta].append(statistics.median(iteration_periods[1:] or iteration_periods))
            rewards[eta].append(sum(r["reward_mean"] for r in records[-3:]) / min(3, len(records)))
            staleness[eta].append(max(r["staleness"] for r in records))
            print(f"eta={eta} (round {round_ + 1}): {wall:.1f}s for {len(records)} iterations (first "
                  f"{iteration_periods[0]:.2f}s, then {periods[eta][-1]:.3f}s median), max staleness "
                  f"{staleness[eta][-1]}, reward of the last iterations {rewards[eta][-1]:.3f}", flush=True)
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
    }))


if __name__ == "__main__":
    main()
