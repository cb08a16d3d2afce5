"""Short real runs of a config (the real servers, trainer and reward pool, through `run_plain`) and their first vs
last iterations: what the "does it learn?" tests share."""

from __future__ import annotations

import fcntl
from pathlib import Path
from typing import Any

from areal_pipeline.model import embedded_model_dir, resolve_model_path
from areal_pipeline.pipeline import run_plain
from areal_pipeline.run_spec import load_config

REPO = Path(__file__).resolve().parents[1]
# The pipeline evaluates at every multiple of eval_freq and at the last iteration: 1 is the only setting that
# scores the first iteration (whose update is still small: the configs warm the learning rate up).
EVALUATE_EVERY_ITERATION = "eval_freq=1"


def base_model(config: str, cache_dir: Path, *overrides: str) -> str:
    """The embedded model `configs/<config>` (+ overrides) warm-starts, built once in `cache_dir` (the `model_cache`
    fixture, shared by the session's workers): a worker that finds another building it waits for that build (a
    lock per model, so that builds of different models run side by side)."""
    cfg = load_config(REPO / "configs" / config, [f"output_dir={cache_dir}", *overrides])
    target = embedded_model_dir(cfg.output_dir, cfg.model.tiny, cfg.seed)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        return resolve_model_path(cfg.model, cfg.output_dir, cfg.seed)


def short_run(config: str, tmp_path: Path, *overrides: str) -> tuple[Any, list[dict[str, Any]]]:
    """Run `configs/<config>` from scratch (warm start included) under `tmp_path`, without evaluation unless the
    overrides set eval_freq (EVALUATE_EVERY_ITERATION): (config, the iterations' metrics)."""
    cfg = load_config(REPO / "configs" / config, [f"output_dir={tmp_path}", "eval_freq=0", *overrides])
    return cfg, run_plain(cfg)


def first_and_last(records: list[dict[str, Any]], key: str = "reward_mean", window: int = 5) -> tuple[float, float]:
    """The mean of `key` over the first and over the last `window` iterations."""
    first, last = [r[key] for r in records[:window]], [r[key] for r in records[-window:]]
    return sum(first) / len(first), sum(last) / len(last)


def first_and_last_pass_at_1(records: list[dict[str, Any]]) -> tuple[float, float]:
    """Greedy test pass@1 at the first and at the last iteration (a run with EVALUATE_EVERY_ITERATION)."""
    if records[0]["eval_pass_at_1"] is None or records[-1]["eval_pass_at_1"] is None:
        raise ValueError("the run did not evaluate at its first and last iterations: set eval_freq=1")
    return records[0]["eval_pass_at_1"], records[-1]["eval_pass_at_1"]


def fitted_rise(records: list[dict[str, Any]], key: str = "reward_mean") -> float:
    """How much `key` rose over the run by its least-squares line through every iteration: the whole curve's trend,
    not a few iterations at either end, which one lucky batch moves as much as the learning does."""
    values = [r[key] for r in records]
    n = len(values)
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in enumerate(values))
             / sum((x - mean_x) ** 2 for x in range(n)))
    return slope * (n - 1)
