"""The `evaluate` flow: pass@1 and mean reward of a checkpoint on the test split, published as an artifact."""

from __future__ import annotations

from typing import Any, Optional

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from areal_pipeline.evaluation import evaluate_checkpoint
from areal_pipeline.run_spec import resolve_run_config
from flows import run_logs
from flows.artifacts import artifact_key


@flow(name="evaluate", persist_result=True, result_serializer="json")
def evaluate(config_path: str = "configs/tiny_cpu.yaml", overrides: Optional[list[str]] = None,
             run_id: Optional[str] = None, checkpoint: str = "latest") -> dict[str, Any]:
    """Score `checkpoint` (a checkpoint directory, a Hugging Face model directory, or "latest": the run's
    newest checkpoint) on the config's test split."""
    run_logs.keep_completed_task_runs_from_the_api()
    cfg = resolve_run_config(config_path, overrides, run_id)
    record = evaluate_checkpoint(cfg, checkpoint)
    model_dir = record.pop("model")
    table = [{"metric": k, "value": round(v, 4) if isinstance(v, float) else v}
             for k, v in record.items() if k != "samples"]
    create_table_artifact(key=artifact_key(cfg.run_id, "evaluation"), table=table,
                          description=f"{cfg.run_id}: evaluation of {model_dir}")
    samples = "\n".join(f"- reward {s['reward']:.2f}: `{s['prompt'][:120]}` -> `{s['completion'][:200]}`"
                        for s in record["samples"])
    create_markdown_artifact(
        key=artifact_key(cfg.run_id, "evaluation-report"),
        markdown=f"# Evaluation of `{model_dir}`\n\npass@1 **{record['pass_at_1']:.3f}**, mean reward "
                 f"{record['reward_mean']:.3f} on {record['num_prompts']} prompts of the "
                 f"`{cfg.dataset.test_split}` split.\n\n## Samples\n{samples}\n",
        description=f"{cfg.run_id}: evaluation report")
    get_run_logger().info("%s: pass@1 %.3f, reward %.3f", model_dir, record["pass_at_1"], record["reward_mean"])
    return {"model": str(model_dir), **{k: v for k, v in record.items() if k != "samples"}}
