"""Deployments of `train`, `evaluate` and `sweep` served against the configured Prefect API, so runs can be started
from the UI (with typed parameters) and scheduled."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from prefect import serve

from flows.evaluate import evaluate
from flows.sweep import sweep
from flows.train import train


def build_deployments(config_path: str, overrides: list[str], run_id: Optional[str], iterations: Optional[int],
                      cron: Optional[str] = None, interval: Optional[float] = None,
                      eval_cron: Optional[str] = None, eval_interval: Optional[float] = None):
    """A scheduled train run continues the same run id from its newest checkpoint for `iterations` more
    iterations; a scheduled evaluate run scores the run's newest checkpoint. A sweep run (the UI's Run, with the
    axes to add, e.g. `trainer.optimizer.lr=1e-3,5e-4`) starts a train run per combination, the served overrides
    fixed in every one."""
    config_path = str(Path(config_path).resolve())
    common = {"config_path": config_path, "overrides": overrides, "run_id": run_id}
    train_deployment = train.to_deployment(
        name="train", parameters={**common, "iterations": iterations}, cron=cron, interval=interval,
        description="RL training: one child flow run per iteration (rollout -> advantages -> ppo_update -> "
                    "broadcast_weights -> checkpoint -> evaluate)")
    evaluate_deployment = evaluate.to_deployment(
        name="evaluate", parameters={**common, "checkpoint": "latest"}, cron=eval_cron, interval=eval_interval,
        description="pass@1 and mean reward of a checkpoint (default: the run's newest) on the test split")
    # the served overrides are the sweep's single-valued axes; its run ids are the run id followed by the values
    fixed = [o for o in overrides if o.partition("=")[0].strip() != "run_id"]
    named = [o.partition("=")[2].strip() for o in overrides if o.partition("=")[0].strip() == "run_id"]
    sweep_deployment = sweep.to_deployment(
        name="sweep", parameters={"config_path": config_path, "axes": fixed, "iterations": iterations,
                                  "run_id": run_id or next(iter(named), None), "max_parallel": 1},
        description="a train run per combination of axes (key=v1,v2,...: add the keys to sweep), at most "
                    "max_parallel at once, each its own run id and flow run; a table artifact of their figures")
    return [train_deployment, evaluate_deployment, sweep_deployment]


def serve_deployments(*args, **kwargs) -> None:
    serve(*build_deployments(*args, **kwargs))
