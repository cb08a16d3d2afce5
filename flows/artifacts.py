"""What a person sees in the Prefect UI: per-iteration metrics, sample trajectories and links; per-run curve
and progress."""

from __future__ import annotations

import base64
import re
from typing import Any, Optional
from uuid import UUID

from prefect.artifacts import (create_markdown_artifact, create_progress_artifact, create_table_artifact,
                               update_progress_artifact)

from areal_pipeline.data.shards import read_table
from areal_pipeline.metrics import plot_reward_curve, read_metrics, summarize
from areal_pipeline.pipeline import Pipeline

SAMPLES_SHOWN = 4


def artifact_key(run_id: str, what: str) -> str:
    """Artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", f"{run_id}-{what}".lower()).strip("-")


def _fmt(value: Any) -> Any:
    return round(value, 4) if isinstance(value, float) else value


def publish_iteration(pipeline: Pipeline, k: int, record: dict[str, Any]) -> None:
    run_id = pipeline.cfg.run_id
    create_table_artifact(key=artifact_key(run_id, "metrics"),
                          table=[{"metric": name, "value": _fmt(v)} for name, v in record.items()],
                          description=f"{run_id} iteration {k}: metrics")
    paths = pipeline.paths
    rows = read_table(paths.rollout(k)).slice(0, SAMPLES_SHOWN).to_pylist()
    samples = "\n".join(
        f"**{r['prompt_id']}** (sample {r['sample_idx']}, reward {r['reward']:.2f}, {r['stop_reason']})\n\n"
        f"```\n{r['text'][:600]}\n```\n" for r in rows)
    checkpoint = paths.checkpoint(k)
    links = [f"- rollout shards: `{paths.rollout(k)}`", f"- batch shards: `{paths.batch(k)}`",
             f"- metrics: `{paths.metrics(k)}`"]
    if checkpoint.is_dir():
        links.append(f"- checkpoint: `{checkpoint}` (Hugging Face model in `{checkpoint / 'model'}`)")
    create_markdown_artifact(key=artifact_key(run_id, "iteration"),
                             markdown=f"# {run_id} / iteration {k}\n\n## Outputs\n" + "\n".join(links)
                             + f"\n\n## Sample trajectories\n\n{samples}",
                             description=f"{run_id} iteration {k}: samples and outputs")


def publish_curve(pipeline: Pipeline) -> Optional[dict[str, Any]]:
    """The reward curve as a PNG next to the run, and a markdown artifact showing and linking it."""
    run_id = pipeline.cfg.run_id
    records = read_metrics(pipeline.paths.metrics_jsonl)
    png = plot_reward_curve(records, pipeline.paths.run_dir / "reward_curve.png", title=run_id)
    if png is None:
        return None
    summary = summarize(records)
    inline = base64.b64encode(png.read_bytes()).decode()
    create_markdown_artifact(
        key=artifact_key(run_id, "reward-curve"),
        markdown=(f"# {run_id}: reward curve\n\n![reward curve](data:image/png;base64,{inline})\n\n"
                  f"PNG: `{png}`  \nMetrics: `{pipeline.paths.metrics_jsonl}`\n\n"
                  + "\n".join(f"- {k}: {_fmt(v)}" for k, v in summary.items())),
        description=f"{run_id}: reward per iteration")
    return {"curve": str(png), **summary}


def start_progress(total: int, done: int) -> Optional[UUID]:
    return create_progress_artifact(progress=100.0 * done / max(1, total), description="iterations done")


def update_progress(artifact_id: Optional[UUID], total: int, done: int) -> None:
    if artifact_id is not None:
        update_progress_artifact(artifact_id=artifact_id, progress=100.0 * done / max(1, total))
