"""The `train` flow: set-up nodes, then one child flow run `<run>/iter-<k>` per RL iteration.

    rollout -> advantages -> ppo_update -> broadcast_weights -> checkpoint -> evaluate (every eval_freq)

Running `train` again with the same run id (or retrying a failed flow run from the UI/CLI) skips every
finished node: each node's output is complete on disk and its Prefect cache key is derived from it, so the run
continues from the node that failed. Servers and the trainer are stopped in every outcome.
"""

from __future__ import annotations

import json
import time
from typing import Any, Optional

from prefect import flow, get_run_logger
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

import tasks
from areal_pipeline.metrics import write_tensorboard
from areal_pipeline.pipeline import NODES, Pipeline, newest_completed_iteration, resolve_run_config, run_lock
from areal_pipeline.utils import atomic_write_text
from flows import artifacts
from tasks import registry


@flow(name="iteration", flow_run_name="{run_id}/iter-{k}", persist_result=True, result_serializer="json")
def iteration(run_id: str, k: int) -> dict[str, Any]:
    """One RL iteration of run `run_id`: policy k - 1 -> k."""
    pipeline = registry.get(run_id)
    # checkpoint and evaluate run as nodes only on the iterations that save or evaluate (save_freq,
    # eval_freq): a task run costs ~10 ms of API writes even when it has nothing to do
    due = {"checkpoint": pipeline.wants_checkpoint(k), "evaluate": pipeline.wants_evaluation(k)}
    results = {name: getattr(tasks, name)(run_id, k) for name in NODES if due.get(name, True)}
    record = pipeline.record_metrics(k, results)
    if pipeline.cfg.tensorboard:
        write_tensorboard([record], pipeline.paths.run_dir / "tensorboard")
    artifacts.publish_iteration(pipeline, k, record)
    get_run_logger().info("iteration %d: reward %.3f, %s", k, record["reward_mean"],
                          ", ".join(f"{n} {s:.2f}s" for n, s in pipeline.step_seconds.get(k, {}).items()))
    return record


def record_orchestration(pipeline: Pipeline, k: int, wall: float) -> None:
    """What the iteration cost beyond its nodes' own work: Prefect's share (`iter_<k>/orchestration.json`)."""
    work = sum(pipeline.step_seconds.get(k, {}).values())
    atomic_write_text(pipeline.paths.iteration(k) / "orchestration.json", json.dumps(
        {"wall_seconds": wall, "node_seconds": work, "overhead_seconds": wall - work}) + "\n")


@flow(name="train", persist_result=True, result_serializer="json")
def train(config_path: str = "configs/tiny_cpu.yaml", overrides: Optional[list[str]] = None,
          run_id: Optional[str] = None, iterations: Optional[int] = None) -> dict[str, Any]:
    """Train `config_path` (+ dotted `overrides`) as run `run_id` (default: the config's). `iterations`
    continues the run for that many more iterations after its newest finished one; without it the run goes
    to the config's `total_iterations`."""
    cfg = resolve_run_config(config_path, overrides, run_id, iterations)
    logger = get_run_logger()
    with run_lock(cfg.run_dir):
        pipeline = Pipeline(cfg)
        registry.register(pipeline)
        try:
            tasks.prepare_dataset(cfg.run_id)
            tasks.start_tool_servers(cfg.run_id)
            tasks.start_inference_servers(cfg.run_id)
            tasks.start_trainer(cfg.run_id)
            first = newest_completed_iteration(cfg.run_dir) + 1
            if first > 1:
                logger.info("run %s: iterations 1..%d are finished; continuing at %d", cfg.run_id, first - 1, first)
            progress = artifacts.start_progress(cfg.total_iterations, first - 1)
            # A flow waits for its heartbeat thread on exit (~1 s): too much for one child run per iteration.
            with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
                for k in range(first, cfg.total_iterations + 1):
                    started = time.perf_counter()
                    iteration(cfg.run_id, k)
                    record_orchestration(pipeline, k, time.perf_counter() - started)
                    artifacts.update_progress(progress, cfg.total_iterations, k)
            summary = artifacts.publish_curve(pipeline) or {}
            logger.info("run %s finished: %s", cfg.run_id, summary)
            return {"run_id": cfg.run_id, "run_dir": str(cfg.run_dir), **summary}
        finally:
            pipeline.close()
            pipeline.services.stop()
            registry.unregister(cfg.run_id)
