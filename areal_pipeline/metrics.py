"""Run metrics for people: the run's curves as one PNG, its metrics as a table, a short text summary (the
trackers: areal_pipeline/trackers/).

A run's history is `metrics.jsonl` (one record per RL iteration, 1..N) preceded, where the run evaluates, by the
initial policy's evaluation (`iter_0/eval.json`, shown as iteration 0: pass@1 from the start of the run)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

from areal_pipeline.run_dir import RunPaths, read_json
from areal_pipeline.utils import atomic_path

# The panels of the run's picture: (title, series on the left axis, series on the right axis), each series
# (metric, label). A panel is drawn where some record has a value for one of its series, a series where it has one.
PANELS = (
    ("reward", (("reward_mean", "train reward (mean)"), ("eval_pass_at_1", "eval pass@1")), ()),
    ("KL / entropy", (("kl", "KL to reference"), ("approx_kl", "approx. KL to behaviour")),
     (("entropy", "entropy (right)"),)),
    ("update", (("grad_norm", "grad norm"),), (("loss", "loss (right)"),)),
    ("staleness", (("staleness", "versions behind"),), ()),
    ("throughput", (("rollout_tokens_per_s", "rollout tokens/s"), ("train_tokens_per_s", "train tokens/s")), ()),
)
PANEL_COLUMNS = 2
# The table's first columns, in this order; the others follow in the order the records name them.
LEADING_COLUMNS = ("iteration", "reward_mean", "eval_pass_at_1", "accuracy", "kl", "entropy", "loss", "grad_norm",
                   "staleness")
SIGNIFICANT_DIGITS = 4


def read_metrics(metrics_jsonl: Path) -> list[dict[str, Any]]:
    if not Path(metrics_jsonl).is_file():
        return []
    return [json.loads(line) for line in Path(metrics_jsonl).read_text().splitlines() if line.strip()]


def initial_record(paths: RunPaths) -> Optional[dict[str, Any]]:
    """The initial policy's evaluation as a metrics record of iteration 0, where the run made one."""
    evaluation = read_json(paths.evaluation(0))
    if evaluation is None:
        return None
    return {"iteration": 0, "eval_pass_at_1": evaluation.get("pass_at_1"), "eval_reward": evaluation.get("reward_mean")}


def run_history(run_dir: Path) -> list[dict[str, Any]]:
    """The run's records in order of iteration: the initial evaluation (iteration 0) where made, then every
    finished iteration's."""
    paths = RunPaths(Path(run_dir))
    initial = initial_record(paths)
    return ([initial] if initial is not None else []) + read_metrics(paths.metrics_jsonl)


def _series(records: list[dict[str, Any]], metric: str) -> list[tuple[int, float]]:
    return [(r["iteration"], r[metric]) for r in records
            if isinstance(r.get(metric), (int, float)) and not isinstance(r.get(metric), bool)
            and math.isfinite(r[metric])]


def curve_panels(records: list[dict[str, Any]]) -> list[str]:
    """The titles of the panels `plot_curves` draws for `records`: those with data, in PANELS' order."""
    return [title for title, left, right in PANELS if any(_series(records, m) for m, _ in (*left, *right))]


def plot_curves(records: list[dict[str, Any]], out: Path, title: str = "") -> Optional[Path]:
    """The run at a glance, one PNG: a grid of panels (reward and eval pass@1; KL and entropy; grad norm and loss;
    staleness; tokens per second) over iterations, only the panels that have data. None where nothing is plotted."""
    panels = [(t, left, right) for t, left, right in PANELS if t in curve_panels(records)]
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = math.ceil(len(panels) / PANEL_COLUMNS)
    columns = min(PANEL_COLUMNS, len(panels))
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3 * rows), dpi=100, squeeze=False)
    for ax, (name, left, right) in zip(axes.flat, panels):
        lines = _draw(ax, records, left, marker="o")
        if right and any(_series(records, m) for m, _ in right):
            lines += _draw(ax.twinx(), records, right, marker="s", first_color=len(left))
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("iteration", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(lines, [line.get_label() for line in lines], loc="best", fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(title)
    # fixed margins (in inches: the title, the axes' labels): tight_layout would measure every text at each update
    height = 3 * rows
    fig.subplots_adjust(left=0.6 / (5 * columns), right=1 - 0.6 / (5 * columns), bottom=0.5 / height,
                        top=1 - 0.55 / height, wspace=0.35, hspace=0.5)
    with atomic_path(Path(out)) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return Path(out)


def _draw(ax, records, series, marker: str, first_color: int = 0) -> list:
    lines = []
    for i, (metric, label) in enumerate(series):
        points = _series(records, metric)
        if points:
            lines += ax.plot(*zip(*points), marker=marker, ms=3, color=f"C{first_color + i}", label=label)
    return lines


def significant(value: Any, digits: int = SIGNIFICANT_DIGITS) -> Any:
    """A float to `digits` significant digits (a loss of 3e-6 stays 3e-6, not 0); anything else as it is."""
    if isinstance(value, float) and math.isfinite(value):
        return float(f"{value:.{digits}g}")
    return value


def metrics_table(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per record, one column per metric that has a value in some record (a metric the config never
    fills, e.g. KL without a reference model, is left out), floats to SIGNIFICANT_DIGITS digits."""
    names: list[str] = []
    for record in records:
        names += [name for name, value in record.items() if value is not None and name not in names]
    columns = [name for name in LEADING_COLUMNS if name in names] + [n for n in names if n not in LEADING_COLUMNS]
    return [{name: significant(record.get(name)) for name in columns} for record in records]


def summarize(records: list[dict[str, Any]], window: int = 3) -> dict[str, Any]:
    """First vs last iterations' mean reward: the one-line answer to "did it learn?". Records without a reward
    (the initial evaluation, iteration 0) count for the evaluation only."""
    evals = [r["eval_pass_at_1"] for r in records if r.get("eval_pass_at_1") is not None]
    records = [r for r in records if r.get("reward_mean") is not None]
    if not records:
        return {}
    window = max(1, min(window, len(records) // 2 or 1))
    first = [r["reward_mean"] for r in records[:window]]
    last = [r["reward_mean"] for r in records[-window:]]
    return {
        "iterations": len(records),
        "reward_first": sum(first) / len(first),
        "reward_last": sum(last) / len(last),
        "eval_pass_at_1_first": evals[0] if evals else None,
        "eval_pass_at_1_last": evals[-1] if evals else None,
        "window": window,
        # the workflow's own figures (rollout stats `agent/<key>`: first-turn accuracy, share of episodes that
        # search, ...): {key: (first window's mean, last window's mean)}
        "agent": {key[len("agent/"):]: (_mean(records[:window], key), _mean(records[-window:], key))
                  for key in sorted({key for r in records for key in r if key.startswith("agent/")})},
    }


def _mean(records: list[dict[str, Any]], key: str) -> Optional[float]:
    values = [r[key] for r in records if r.get(key) is not None]
    return sum(values) / len(values) if values else None
