"""GiGPO against GRPO on a multi-step environment: the same config, seeds and puzzles (configs/gigpo_grid.yaml, the
grid_world workflow; configs/gigpo_grid_pits.yaml, the same with pits), only `ppo.advantage` differs. Success rate
(the batch's share of walks that reach the goal) against iterations for each, on a grid with pits also the share of
walks that fell in one, and how many iterations each needs before its success rate, averaged over a window of
iterations, first reaches a threshold.

    python bench/gigpo_vs_grpo.py [--iterations 30] [--seeds 1 2] [--threshold 0.7] [--window 3] [overrides ...]

`iterations_ratio` is GRPO's iterations to the threshold over GiGPO's, summed over the seeds (above 1: GiGPO gets
there in fewer iterations); a run that never reaches it counts as iterations + 1 and is reported as not reached.
`paired_success` compares the two runs of a seed iteration by iteration (they play the same puzzles): the mean
success gain of GiGPO and in how many iterations each was ahead.
Runs go through `Pipeline.run_iterations` (no Prefect), one after another. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Optional

ADVANTAGES = ("grpo", "gigpo")


def run_records(config: str, overrides: list[str]) -> list[dict]:
    from areal_pipeline.pipeline import Pipeline
    from areal_pipeline.run_dir import run_lock
    from areal_pipeline.run_spec import load_config

    cfg = load_config(config, overrides)
    pipeline = Pipeline(cfg)
    with run_lock(cfg.run_dir):
        try:
            pipeline.start()
            records = pipeline.run_iterations(1, cfg.total_iterations)
        finally:
            pipeline.close()
            pipeline.services.stop()
    return records


def iterations_to(curve: list[float], threshold: float, window: int) -> Optional[int]:
    """The first iteration k whose mean success over iterations k - window + 1 .. k is at least `threshold`."""
    for k in range(window, len(curve) + 1):
        if statistics.fmean(curve[k - window:k]) >= threshold:
            return k
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/gigpo_grid.yaml")
    p.add_argument("--iterations", type=int, default=30)
    p.add_argument("--seeds", type=int, nargs="+", default=[1])
    p.add_argument("--threshold", type=float, default=0.7)
    p.add_argument("--window", type=int, default=3)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-gigpo-"))
    curves: dict[str, dict[int, list[float]]] = {a: {} for a in ADVANTAGES}
    falls: dict[str, dict[int, list[float]]] = {a: {} for a in ADVANTAGES}
    started = time.time()
    for seed in args.seeds:
        for advantage in ADVANTAGES:
            run_id = f"{advantage}-seed{seed}"
            records = run_records(args.config, [
                f"output_dir={work}", f"run_id={run_id}", f"seed={seed}", f"ppo.advantage={advantage}",
                f"total_iterations={args.iterations}", "eval_freq=0", *args.overrides])
            curves[advantage][seed] = curve = [float(r["reward_mean"]) for r in records]
            print(f"{run_id}: success by iteration " + " ".join(f"{v:.2f}" for v in curve), flush=True)
            if "agent/fell_in_pit" in records[0]:  # a grid with pits: the share of walks ending in one
                falls[advantage][seed] = fell = [float(r["agent/fell_in_pit"]) for r in records]
                print(f"{run_id}: fell in a pit by iteration " + " ".join(f"{v:.2f}" for v in fell), flush=True)
    reached = {a: {s: iterations_to(c, args.threshold, args.window) for s, c in curves[a].items()} for a in ADVANTAGES}
    counted = {a: sum(k if k is not None else args.iterations + 1 for k in reached[a].values()) for a in ADVANTAGES}
    last = {a: statistics.fmean(v for c in curves[a].values() for v in c[-args.window:]) for a in ADVANTAGES}
    for a in ADVANTAGES:
        print(f"{a}: iterations to {args.threshold:.2f} (mean of {args.window}): "
              + ", ".join(f"seed {s}: {k if k is not None else 'not reached'}" for s, k in reached[a].items())
              + f"; success over the last {args.window} iterations {last[a]:.3f}")
    ratio = counted["grpo"] / counted["gigpo"]
    print(f"iterations to the threshold, GRPO / GiGPO: {ratio:.2f}")
    # Both runs of a seed play the same puzzles in each iteration: the per-iteration difference is paired, far less
    # noisy than either curve (a batch of 16 puzzles is easy or hard for both).
    gaps = [b - a for s in args.seeds for a, b in zip(curves["grpo"][s], curves["gigpo"][s])]
    paired = {"mean_gain": round(statistics.fmean(gaps), 4), "iterations_gigpo_higher": sum(g > 0 for g in gaps),
              "iterations_grpo_higher": sum(g < 0 for g in gaps), "iterations": len(gaps)}
    print(f"success, GiGPO - GRPO on the same iteration's puzzles: mean {paired['mean_gain']:+.3f}; GiGPO higher in "
          f"{paired['iterations_gigpo_higher']}, GRPO higher in {paired['iterations_grpo_higher']} of {len(gaps)}")
    print(json.dumps({"benchmark": "gigpo_vs_grpo", "config": args.config, "iterations": args.iterations,
                      "seeds": args.seeds, "threshold": args.threshold, "window": args.window,
                      "iterations_to_threshold": {a: {str(s): k for s, k in reached[a].items()} for a in ADVANTAGES},
                      "final_success": last, "iterations_ratio": round(ratio, 3), "paired_success": paired,
                      "curves": {a: {str(s): c for s, c in curves[a].items()} for a in ADVANTAGES},
                      "fell_in_pit": {a: {str(s): c for s, c in falls[a].items()} for a in ADVANTAGES},
                      "wall_s": round(time.time() - started, 1)}))


if __name__ == "__main__":
    main()
