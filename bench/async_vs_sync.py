"""Asynchronous vs synchronous training: wall time for the same number of trained samples (the same iterations
of the default config) with max_head_offpolicyness eta = 0 (synchronous), 1 and 2.

    python bench/async_vs_sync.py [--iterations 30] [--etas 0 1 2] [overrides ...]

The time is that of the iterations themselves (services started beforehand, for every variant alike), through
`Pipeline.run_iterations`: with eta > 0, iteration k+1's rollout and advantages run during iteration k's update,
as in the train flow. The first iteration (~2 s: worker start-up, first update) is alike in every variant, so
few iterations understate the steady-state speed-up.
Target (issue 6): eta=1 at least 1.5x faster than eta=0 on 2 cores. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def timed_run(config: str, overrides: list[str]) -> tuple[float, list[dict]]:
    from areal_pipeline.config import load_config
    from areal_pipeline.pipeline import Pipeline, run_lock

    cfg = load_config(config, overrides)
    pipeline = Pipeline(cfg)
    with run_lock(cfg.run_dir):
        try:
            pipeline.start()
            started = time.perf_counter()
            records = pipeline.run_iterations(1, cfg.total_iterations)
            return time.perf_counter() - started, records
        finally:
            pipeline.close()
            pipeline.services.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/tiny_cpu.yaml")
    p.add_argument("--iterations", type=int, default=30)
    p.add_argument("--etas", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-async-"))
    walls, rewards, staleness = {}, {}, {}
    for eta in args.etas:
        overrides = [f"output_dir={work}", f"run_id=eta{eta}", f"total_iterations={args.iterations}", "eval_freq=0",
                     f"rollout.max_head_offpolicyness={eta}", *args.overrides]
        walls[eta], records = timed_run(args.config, overrides)
        rewards[eta] = sum(r["reward_mean"] for r in records[-3:]) / min(3, len(records))
        staleness[eta] = max(r["staleness"] for r in records)
        print(f"eta={eta}: {walls[eta]:.1f}s for {args.iterations} iterations, max staleness {staleness[eta]}, "
              f"reward of the last iterations {rewards[eta]:.3f}", flush=True)
    base = walls[args.etas[0]]
    print(json.dumps({
        "iterations": args.iterations,
        **{f"eta{e}_seconds": round(w, 1) for e, w in walls.items()},
        **{f"speedup_eta{e}": round(base / w, 3) for e, w in walls.items() if e != args.etas[0]},
        **{f"max_staleness_eta{e}": s for e, s in staleness.items()},
    }))


if __name__ == "__main__":
    main()
