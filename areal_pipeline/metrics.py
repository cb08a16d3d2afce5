"""Run metrics for people: the reward curve as a PNG, a short text summary (the trackers: areal_pipeline/trackers/)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from areal_pipeline.utils import atomic_path


def read_metrics(metrics_jsonl: Path) -> list[dict[str, Any]]:
    if not Path(metrics_jsonl).is_file():
        return []
    return [json.loads(line) for line in Path(metrics_jsonl).read_text().splitlines() if line.strip()]


def plot_reward_curve(records: list[dict[str, Any]], out: Path, title: str = "") -> Optional[Path]:
    """Training reward (and eval pass@1 where measured) per iteration."""
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    its = [r["iteration"] for r in records]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(its, [r["reward_mean"] for r in records], marker="o", ms=3, label="train reward (mean)")
    evals = [(r["iteration"], r["eval_pass_at_1"]) for r in records if r.get("eval_pass_at_1") is not None]
    if evals:
        ax.plot(*zip(*evals), marker="s", ms=4, ls="--", label="eval pass@1")
    ax.set_xlabel("iteration")
    ax.set_ylabel("reward")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    with atomic_path(Path(out)) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return Path(out)


def summarize(records: list[dict[str, Any]], window: int = 3) -> dict[str, Any]:
    """First vs last iterations' mean reward: the one-line answer to "did it learn?"."""
    if not records:
        return {}
    window = max(1, min(window, len(records) // 2 or 1))
    first = [r["reward_mean"] for r in records[:window]]
    last = [r["reward_mean"] for r in records[-window:]]
    evals = [r["eval_pass_at_1"] for r in records if r.get("eval_pass_at_1") is not None]
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
