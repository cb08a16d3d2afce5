"""What a person sees in the Prefect UI: per-iteration metrics, sample trajectories and links; per-run curve
and progress."""

from __future__ import annotations

import base64
import re
import time
from typing import Any, Optional
from uuid import UUID

from prefect.artifacts import (create_markdown_artifact, create_progress_artifact, create_table_artifact,
                               update_progress_artifact)

from areal_pipeline.data.shards import read_table
from areal_pipeline.metrics import plot_reward_curve, read_metrics, summarize
from areal_pipeline.pipeline import Pipeline
from tasks.runs import LiveRun

SAMPLES_SHOWN = 4
PROGRESS_INTERVAL_S = 2.0
ITERATION_ARTIFACTS_INTERVAL_S = 2.0


def artifact_key(run_id: str, what: str) -> str:
    """Artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", f"{run_id}-{what}".lower()).strip("-")


def _fmt(value: Any) -> Any:
    return round(value, 4) if isinstance(value, float) else value


def publish_iteration(run: LiveRun, k: int, record: dict[str, Any]) -> bool:
    """Iteration k's metrics table and samples (two artifacts, keyed by run: the UI shows the newest and keeps the
    history). Where iterations take less than ITERATION_ARTIFACTS_INTERVAL_S, each would cost the API more than
    a person can read: then they are published at most that often, and always for a run's last iteration and
    for an iteration with a checkpoint. Returns whether they were."""
    pipeline, run_id, now = run.pipeline, run.run_id, time.monotonic()
    due = (now - run.artifacts_published_at >= ITERATION_ARTIFACTS_INTERVAL_S
           or k == pipeline.cfg.total_iterations or pipeline.wants_checkpoint(k))
    if not due:
        return False
    run.artifacts_published_at = now
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
    return True


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


class Progress:
    """The run's progress artifact (iterations done of `total`), updated at most every `min_interval_s` seconds
    and at the end: each update is an API write, a cost a sub-second iteration need not pay every time."""

    def __init__(self, total: int, done: int, min_interval_s: float = PROGRESS_INTERVAL_S):
        self.total, self.done, self.min_interval_s = max(1, total), done, min_interval_s
        self.artifact_id: Optional[UUID] = create_progress_artifact(progress=self._percent(),
                                                                     description="iterations done")
        self._published, self._published_at = done, time.monotonic()

    def _percent(self) -> float:
        return 100.0 * self.done / self.total

    def update(self, done: Optional[int]) -> None:
        """`done` iterations are finished (None: publish what is known now, as at the end of a run)."""
        if done is not None:
            self.done = max(self.done, done)
            if time.monotonic() - self._published_at < self.min_interval_s:
                return
        if self.artifact_id is None or self.done == self._published:
            return
        update_progress_artifact(artifact_id=self.artifact_id, progress=self._percent())
        self._published, self._published_at = self.done, time.monotonic()
