"""The `evaluate` flow: pass@1 and mean reward of a checkpoint on the test split, published as an artifact."""

from __future__ import annotations

from typing import Any, Optional

from prefect import flow, get_run_logger, runtime
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from areal_pipeline.evaluation import evaluate_checkpoint
from areal_pipeline.run_spec import resolve_run_config
from flows import labels, run_logs
from flows.artifacts import artifact_key


@flow(name="evaluate", flow_run_name=labels.evaluate_run_name, persist_result=True, result_serializer="json")
def evaluate(config_path: str = "configs/tiny_cpu.yaml", overrides: Optional[list[str]] = None,
             run_id: Optional[str] = None, checkpoint: str = "latest") -> dict[str, Any]:
    """Score a checkpoint of a run on the config's test split: pass@1 and mean reward, greedy, one sample a
    prompt, on inference servers of its own; a table and a report artifact.

    Args:
        config_path: The run's config file (relative to the directory the flow runs in), e.g. configs/tiny_cpu.yaml.
        overrides: Dotted key=value overrides of the config, e.g. eval_max_prompts=50.
        run_id: The run whose checkpoint is scored (default: the config's run_id).
        checkpoint: "latest" (the run's newest checkpoint), a checkpoint directory, or a Hugging Face model
            directory.
    """
    with labels.crashed_if_forced_to_exit(runtime.flow_run.id):  # marked Crashed if forced to exit
        run_logs.keep_completed_task_runs_from_the_api()
        cfg = resolve_run_config(config_path, overrides, run_id)
        labels.tag_iteration_run((*labels.run_tags(cfg, config_path), "evaluate"))
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
