"""What a person sees in the Prefect UI of a train run: its metrics table of every iteration so far and its curves,
both kept up to date while it runs and published once more however it ends; per iteration a card with its
metrics, sample trajectories (prompt, reference answer, completion, reward) and links; and a progress bar."""

from __future__ import annotations

import base64
import json
import re
import threading
import time
from typing import Any, Optional
from uuid import UUID

from prefect.artifacts import (create_markdown_artifact, create_progress_artifact, create_table_artifact,
                               update_progress_artifact)
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import ArtifactUpdate

from areal_pipeline import shutdown
from areal_pipeline.data.shards import read_table
from areal_pipeline.metrics import metrics_table, plot_curves, run_history, significant, summarize
from areal_pipeline.pipeline import Pipeline
from areal_pipeline.utils import get_logger
from tasks.runs import LiveRun

logger = get_logger(__name__)

SAMPLES_SHOWN = 4  # the best half and the worst half of an iteration's episodes, each from a prompt of its own
SAMPLE_CHARS = 600
PROGRESS_INTERVAL_S = 2.0
# How often, at most, the run's table and curves are brought up to date while it runs: each update is a plot and
# an API write, more than a sub-second iteration should pay every time. They are always updated at the end.
LIVE_INTERVAL_S = 10.0
# An iteration's card: published at most this often (and always for the last iteration and one with a checkpoint)
ITERATION_ARTIFACTS_INTERVAL_S = 2.0
CURVES_PNG = "reward_curve.png"


def artifact_key(run_id: str, what: str) -> str:
    """Artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", f"{run_id}-{what}".lower()).strip("-")


def iteration_key(run_id: str, k: int) -> str:
    """Iteration k's card: a key of its own, numbered so that the keys sort in the order of the iterations."""
    return artifact_key(run_id, f"iter-{k:04d}")


class RunArtifacts:
    """The run's table of metrics (`<run>-metrics`: a row per iteration so far, iteration 0 the initial
    evaluation) and its curves (`<run>-reward-curve`: one picture of panels, the PNG in the run directory).

    Made in the train flow run (the artifacts are its own) at the start with what the run directory holds, then
    updated in place (no new version per update) at most every `interval_s` seconds as iterations finish, and once
    more when the block ends, done, failed or cancelled. A stop signal (Ctrl-C, SIGTERM) skips that last update:
    the process must end within seconds."""

    def __init__(self, run: LiveRun, interval_s: Optional[float] = None):
        self.pipeline, self.run_id = run.pipeline, run.run_id
        self.interval_s = LIVE_INTERVAL_S if interval_s is None else interval_s
        self.summary: dict[str, Any] = {}
        self._ids: dict[str, UUID] = {}
        self._published_at = -float("inf")
        self._shown = -1  # the newest iteration the artifacts show
        self._lock = threading.Lock()
        self._run = run

    def __enter__(self) -> "RunArtifacts":
        # made now, in this flow run; the curves are drawn once an iteration finishes (not on the way to the first)
        self.publish(force=True, draw=False)
        self._published_at = -float("inf")
        self._run.artifacts = self
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self._run.artifacts = None
        if kind is None:
            self.publish(force=True)
        elif issubclass(kind, Exception):  # the run's own error is what its caller must see
            self._publish_or_warn(force=True)

    def iteration_done(self, k: int) -> None:
        """Iteration k's record is written: bring the artifacts up to date if they are due."""
        if time.monotonic() - self._published_at >= self.interval_s:
            self._publish_or_warn()

    def _publish_or_warn(self, force: bool = False) -> None:
        # the API away for a moment fails no iteration: the next update shows what this one would have
        try:
            self.publish(force=force)
        except Exception as error:
            logger.warning("run %s: could not update its table and curves artifacts: %s", self.run_id, error)

    def publish(self, force: bool = False, draw: bool = True) -> None:
        """Show what the run directory holds now (unless it is shown already and not `force`); `draw`: the
        curves too."""
        with self._lock:
            records = run_history(self.pipeline.paths.run_dir)
            newest = records[-1]["iteration"] if records else -1
            if not force and newest == self._shown:
                return
            self._shown, self._published_at = newest, time.monotonic()
            self._table(records)
            self._curves(records if draw else [])

    def _table(self, records: list[dict[str, Any]]) -> None:
        rows = metrics_table([table_metrics(r) for r in records])
        description = f"{self.run_id}: metrics of every iteration so far ({len(rows)} rows; iteration 0: the initial " \
                      "policy's evaluation)"
        if "metrics" not in self._ids:
            self._ids["metrics"] = create_table_artifact(key=artifact_key(self.run_id, "metrics"), table=rows,
                                                         description=description)
        else:
            self._update("metrics", json.dumps(rows), description)

    def _curves(self, records: list[dict[str, Any]]) -> None:
        run_dir = self.pipeline.paths.run_dir
        png = plot_curves(records, run_dir / CURVES_PNG, title=self.run_id)
        self.summary = {"curve": str(png), **summarize(records)} if png is not None else {}
        if png is None:
            markdown = f"# {self.run_id}: curves\n\nThe curves appear here once an iteration of this run finishes."
        else:
            inline = base64.b64encode(png.read_bytes()).decode()
            markdown = (f"# {self.run_id}: curves\n\n![curves](data:image/png;base64,{inline})\n\n"
                        f"PNG: `{png}`  \nMetrics: `{self.pipeline.paths.metrics_jsonl}`\n\n"
                        + "\n".join(f"- {k}: {significant(v)}" for k, v in self.summary.items() if k != "curve"))
        description = f"{self.run_id}: reward, pass@1, KL, entropy, grad norm, loss, staleness, throughput per iteration"
        if "curves" not in self._ids:
            self._ids["curves"] = create_markdown_artifact(key=artifact_key(self.run_id, "reward-curve"),
                                                           markdown=markdown, description=description)
        else:
            self._update("curves", markdown, description)

    def _update(self, which: str, data: str, description: str) -> None:
        with get_client(sync_client=True) as client:
            client.update_artifact(artifact_id=self._ids[which],
                                   artifact=ArtifactUpdate(data=data, description=description))


def publish_iteration(run: LiveRun, k: int, record: dict[str, Any]) -> bool:
    """Iteration k's card (its metrics, samples and outputs: `<run>-iter-<k>`), and the run's table and curves
    where due. Where iterations take less than ITERATION_ARTIFACTS_INTERVAL_S, a card each would cost the API
    more than a person can read: then cards are published at most that often, and always for a run's last
    iteration and for an iteration with a checkpoint (the table has every iteration). Returns whether the card
    was published. Nothing is published once a stop signal arrived: the process must end within seconds, and the
    run's next command shows iteration k in the table and curves (its record is written)."""
    if shutdown.requested_by() is not None:
        return False
    if run.artifacts is not None:
        run.artifacts.iteration_done(k)
    pipeline, run_id, now = run.pipeline, run.run_id, time.monotonic()
    due = (now - run.artifacts_published_at >= ITERATION_ARTIFACTS_INTERVAL_S
           or k == pipeline.cfg.total_iterations or pipeline.wants_checkpoint(k))
    if not due:
        return False
    run.artifacts_published_at = now
    skipped = "" if run.last_card is None or k - 1 <= run.last_card else (
        f"Iterations {run.last_card + 1}..{k - 1} have no card of their own: cards are published at most every "
        f"{ITERATION_ARTIFACTS_INTERVAL_S:g} s (and for every checkpoint and the last iteration); the run's metrics "
        "table has every iteration.\n\n")
    run.last_card = k
    paths = pipeline.paths
    checkpoint = paths.checkpoint(k)
    links = [f"- rollout shards: `{paths.rollout(k)}`", f"- batch shards: `{paths.batch(k)}`",
             f"- metrics: `{paths.metrics(k)}`"]
    if checkpoint.is_dir():
        links.append(f"- checkpoint: `{checkpoint}` (Hugging Face model in `{checkpoint / 'model'}`)")
    metrics = "\n".join(f"| {name} | {significant(value)} |" for name, value in record.items() if value is not None)
    create_markdown_artifact(
        key=iteration_key(run_id, k),
        markdown=(f"# {run_id} / iteration {k}\n\n{skipped}## Metrics\n\n| metric | value |\n|---|---|\n{metrics}\n\n"
                  f"{failures_markdown(pipeline, k)}## Sample trajectories\n\n{samples_markdown(pipeline, k)}\n\n"
                  "## Outputs\n" + "\n".join(links)),
        description=f"{run_id} iteration {k}: metrics, samples (best and worst) and outputs")
    return True


def table_metrics(record: dict[str, Any]) -> dict[str, Any]:
    """A metrics record as the run's table shows it: `failure_rate` and the group counts, not a column per cause
    (`failures/<cause>`, `retries/<cause>`: the iteration's card lists them)."""
    return {key: value for key, value in record.items() if not key.startswith(("failures/", "retries/"))}


def failures_markdown(pipeline: Pipeline, k: int) -> str:
    """Iteration k's episodes that failed for good, as its rollout's manifest lists them: a table of cause, peer,
    count and the first message; "" when none failed."""
    from areal_pipeline.data.shards import has_manifest, read_manifest

    out = pipeline.paths.rollout(k)
    failures = read_manifest(out).get("failures") if has_manifest(out) else None
    if not failures:
        return ""
    counts: dict[tuple[str, str], list] = {}
    for f in failures:
        entry = counts.setdefault((f["cause"], f.get("peer") or "-"), [0, f.get("message", "")])
        entry[0] += 1
    rows = "\n".join(f"| {cause} | {peer} | {n} | {_cell(message)} |"
                     for (cause, peer), (n, message) in sorted(counts.items(), key=lambda c: -c[1][0]))
    return (f"## Failed episodes\n\n{len(failures)} episode(s) failed for good (rollout.on_failure="
            f"{pipeline.cfg.rollout.on_failure}):\n\n| cause | peer | episodes | first message |\n|---|---|---|---|\n"
            f"{rows}\n\n")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:200]


def pick_samples(rows: list[dict[str, Any]], n: int = SAMPLES_SHOWN) -> list[tuple[str, dict[str, Any]]]:
    """("best" | "worst", row) for up to `n` episodes: the highest rewards, then the lowest, each from a prompt
    not shown yet (ties by prompt id and sample, so the choice is the same on every read)."""
    ranked = sorted(rows, key=lambda r: (-r["reward"], r["prompt_id"], r["sample_idx"]))
    shown: list[tuple[str, dict[str, Any]]] = []
    prompts: set[str] = set()
    for label, candidates, quota in (("best", ranked, (n + 1) // 2), ("worst", ranked[::-1], n)):
        for row in candidates:
            if len(shown) >= quota:
                break
            if row["prompt_id"] not in prompts:
                prompts.add(row["prompt_id"])
                shown.append((label, row))
    return shown


def samples_markdown(pipeline: Pipeline, k: int) -> str:
    """Iteration k's chosen episodes (`pick_samples`): prompt, reference answer, completion and reward each."""
    table = read_table(pipeline.paths.rollout(k))
    rows = table.select(["prompt_id", "sample_idx", "reward", "stop_reason", "messages", "text", "metadata",
                         "input_ids", "loss_mask"]).to_pylist()
    answers: Optional[dict[str, Any]] = None
    parts = []
    for label, row in pick_samples(rows):
        reference = json.loads(row["metadata"] or "{}").get("answer")
        if reference is None:  # a workflow that keeps no answer in its episodes: the data set's row
            if answers is None:
                answers = {r.get("prompt_id"): r.get("answer")
                           for r in pipeline.records(pipeline.cfg.dataset.train_split)}
            reference = answers.get(row["prompt_id"])
        parts.append(f"### {label}: {row['prompt_id']} (sample {row['sample_idx']}), reward {row['reward']:.3g}, "
                     f"{row['stop_reason']}\n\n**Prompt**\n\n{_block(_prompt(pipeline, row))}\n\n"
                     f"**Reference answer**: `{reference}`\n\n**Completion**\n\n{_block(row['text'])}\n")
    return "\n".join(parts) or "No episodes."


def _prompt(pipeline: Pipeline, row: dict[str, Any]) -> str:
    """The episode's prompt: its messages before the model's first turn, else its first tokens decoded."""
    messages = json.loads(row["messages"] or "[]")
    before = []
    for message in messages:
        if message.get("role") == "assistant":
            break
        before.append(message)
    if before:
        if len(before) == 1:
            return str(before[0].get("content", ""))
        return "\n".join(f"[{m.get('role')}] {m.get('content', '')}" for m in before)
    prompt_len = row["loss_mask"].index(1) if 1 in row["loss_mask"] else len(row["input_ids"])
    return pipeline.tokenizer.decode(row["input_ids"][:prompt_len], skip_special_tokens=True)


def _block(text: str) -> str:
    """`text` (cut to SAMPLE_CHARS) as a fenced block that nothing inside it closes."""
    text = text if len(text) <= SAMPLE_CHARS else text[:SAMPLE_CHARS] + " ..."
    fence = "`" * max(3, 1 + max((len(run) for run in re.findall(r"`+", text)), default=0))
    return f"{fence}\n{text}\n{fence}"


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
