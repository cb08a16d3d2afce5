"""Deployments of `train` and `evaluate` served against the configured Prefect API, so runs can be started
from the UI (with typed parameters) and scheduled."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from prefect import serve

from flows.evaluate import evaluate
from flows.train import train


def build_deployments(config_path: str, overrides: list[str], run_id: Optional[str], iterations: Optional[int],
                      cron: Optional[str] = None, interval: Optional[float] = None,
                      eval_cron: Optional[str] = None, eval_interval: Optional[float] = None):
    """A scheduled train run continues the same run id from its newest checkpoint for `iterations` more
    iterations; a scheduled evaluate run scores the run's newest checkpoint."""
    config_path = str(Path(config_path).resolve())
    common = {"config_path": config_path, "overrides": overrides, "run_id": run_id}
    train_deployment = train.to_deployment(
        name="train", parameters={**common, "iterations": iterations}, cron=cron, interval=interval,
        description="RL training: one child flow run per iteration (rollout -> advantages -> ppo_update -> "
                    "broadcast_weights -> checkpoint -> evaluate)")
    evaluate_deployment = evaluate.to_deployment(
        name="evaluate", parameters={**common, "checkpoint": "latest"}, cron=eval_cron, interval=eval_interval,
        description="pass@1 and mean reward of a checkpoint (default: the run's newest) on the test split")
    return [train_deployment, evaluate_deployment]


def serve_deployments(*args, **kwargs) -> None:
    serve(*build_deployments(*args, **kwargs))
