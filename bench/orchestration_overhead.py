"""Orchestration overhead: the same RL iterations through the Prefect flows (one child flow run per iteration,
one task per node, artifacts) and through a plain loop calling the same library functions.

    python bench/orchestration_overhead.py [--iterations 10] [overrides ...]

Overhead per iteration = the time from the previous iteration's last node to this one's last node, minus the
library work of its nodes (each node times its own work), so noise in the work itself (sampling, load from other
processes) does not count as overhead. Consecutive iteration runs overlap in their bookkeeping (flows/train.py).
`flow_vs_plain_wall` compares whole wall times instead: it also counts the nodes slowed down by the Prefect
server's and client's work on the same cores.
Prefect's API is the server at PREFECT_API_URL, else a temporary one as `areal-pipeline train` starts it (on the
SQLite database in PREFECT_HOME: a database other processes write to at the same time slows every call).
Targets (issue 4): median overhead <= 150 ms per iteration and < 5% of the iteration on the default config.
The last line is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/tiny_cpu.yaml")
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()

    import flows  # noqa: F401  (the project's Prefect defaults, before Prefect is imported)
    from areal_pipeline.config import load_config
    from areal_pipeline.pipeline import Pipeline
    from areal_pipeline.run_dir import run_lock
    from flows.train import train

    work = Path(tempfile.mkdtemp(prefix="bench-orchestration-"))
    base = [f"output_dir={work}", f"total_iterations={args.iterations}", "eval_freq=0", *args.overrides]

    plain_cfg = load_config(args.config, base + ["run_id=plain"])
    pipeline = Pipeline(plain_cfg)
    plain_wall, plain_overhead = [], []
    with run_lock(plain_cfg.run_dir):
        try:
            pipeline.start()
            for k in range(1, args.iterations + 1):
                started = time.perf_counter()
                pipeline.run_iteration(k)
                wall = time.perf_counter() - started
                plain_wall.append(wall)
                plain_overhead.append(wall - sum(pipeline.step_seconds[k].values()))
        finally:
            pipeline.close()
            pipeline.services.stop()
    print(f"plain loop: median iteration {statistics.median(plain_wall):.3f}s", flush=True)

    from flows.api_server import prefect_api

    started = time.perf_counter()
    with prefect_api():  # as `areal-pipeline train` runs it: PREFECT_API_URL's server, else a temporary one
        train(config_path=args.config, overrides=base + ["run_id=flow"])
    flow_total = time.perf_counter() - started
    run_dir = work / "flow"
    timings = [json.loads((run_dir / f"iter_{k}" / "orchestration.json").read_text())
               for k in range(1, args.iterations + 1)]
    flow_wall = [t["wall_seconds"] for t in timings]
    flow_overhead = [t["overhead_seconds"] for t in timings]
    print(f"flows: median iteration {statistics.median(flow_wall):.3f}s, "
          f"median overhead {1000 * statistics.median(flow_overhead):.1f} ms", flush=True)

    overhead_ms = 1000 * statistics.median(flow_overhead)
    print(json.dumps({
        "iterations": args.iterations,
        "plain_iteration_s": round(statistics.median(plain_wall), 4),
        "flow_iteration_s": round(statistics.median(flow_wall), 4),
        "overhead_ms_per_iteration": round(overhead_ms, 1),
        "overhead_ms_per_iteration_plain": round(1000 * statistics.median(plain_overhead), 1),
        "overhead_share": round(statistics.median(o / w for o, w in zip(flow_overhead, flow_wall)), 4),
        "flow_vs_plain_wall": round(sum(flow_wall) / sum(plain_wall), 3),
        "flow_run_total_s": round(flow_total, 1),
    }))


if __name__ == "__main__":
    main()
