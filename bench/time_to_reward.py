"""Time-to-reward of the pipeline: seconds of training until the rolling mean reward crosses a threshold.

    python bench/time_to_reward.py [--config configs/tiny_cpu.yaml] [--thresholds 0.5 0.7] [key=value ...]

Runs `run_plain` on the config (the embedded model is built before the clock starts, so the figures are
training time: start-up of the servers and trainer, then the iterations). `bench/trl_yardstick.py` measures
TRL's GRPOTrainer the same way. The last line is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from typing import Optional, Sequence

WINDOW = 5  # iterations in the rolling mean: one iteration's mean reward is noisy (32 prompts)


def seconds_to_reward(rewards: Sequence[float], seconds: Sequence[float], threshold: float,
                      window: int = WINDOW) -> Optional[float]:
    """`seconds[i]` (cumulative, at the end of step i) of the first step whose rolling mean reward over the
    last `window` steps (fewer at the start) reaches `threshold`; None if it never does."""
    for i in range(len(rewards)):
        recent = rewards[max(0, i + 1 - window): i + 1]
        if sum(recent) / len(recent) >= threshold:
            return round(seconds[i], 2)
    return None


def summary(name: str, rewards: Sequence[float], seconds: Sequence[float], thresholds: Sequence[float],
            startup: float) -> dict:
    k = min(WINDOW, len(rewards))
    figures = {f"{name}_seconds_to_reward_{t}": seconds_to_reward(rewards, seconds, t) for t in thresholds}
    figures.update({
        f"{name}_startup_seconds": round(startup, 2),
        f"{name}_steps": len(rewards),
        f"{name}_first_reward": round(sum(rewards[:k]) / k, 3),
        f"{name}_final_reward": round(sum(rewards[-k:]) / k, 3),
        f"{name}_seconds_per_step": round((seconds[-1] - startup) / len(rewards), 3),
    })
    return figures


def measure_pipeline(config: str, overrides: list[str], thresholds: Sequence[float]) -> dict:
    from areal_pipeline.model import resolve_model_path
    from areal_pipeline.pipeline import run_plain
    from areal_pipeline.run_spec import load_config

    cfg = load_config(config, overrides)
    started = time.perf_counter()
    resolve_model_path(cfg.model, cfg.output_dir, cfg.seed)  # the warm start (once per model) is not training time
    build = time.perf_counter() - started
    started = time.perf_counter()
    records = run_plain(cfg)
    wall = time.perf_counter() - started
    # Iteration k ends at (start-up + the nodes' time of iterations 1..k); start-up is what the nodes leave.
    durations = [sum(v for key, v in r.items() if key.startswith("time_")) for r in records]
    startup = wall - sum(durations)
    seconds, total = [], startup
    for d in durations:
        total += d
        seconds.append(total)
    rewards = [r["reward_mean"] for r in records]
    for r, s in zip(records, seconds):
        print(f"iteration {r['iteration']:3d}  {s:7.1f}s  reward {r['reward_mean']:.3f}"
              + (f"  eval pass@1 {r['eval_pass_at_1']:.2f}" if r["eval_pass_at_1"] is not None else ""))
    evals = [r["eval_pass_at_1"] for r in records if r["eval_pass_at_1"] is not None]
    return {**summary("ours", rewards, seconds, thresholds, startup), "ours_wall_seconds": round(wall, 2),
            "ours_model_build_seconds": round(build, 2), "ours_first_eval_pass_at_1": evals[0] if evals else None,
            "ours_final_eval_pass_at_1": evals[-1] if evals else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/tiny_cpu.yaml")
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.5, 0.7])
    p.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = p.parse_args()
    overrides = [f"output_dir={tempfile.mkdtemp(prefix='bench-ttr-')}", *args.overrides]
    print(json.dumps(measure_pipeline(args.config, overrides, args.thresholds)))


if __name__ == "__main__":
    main()
