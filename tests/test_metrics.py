"""The run's picture and table from hand-made records: panels only where there is data, columns only for metrics
with a value, floats to significant digits (a small loss is not 0), the initial evaluation as iteration 0."""

from __future__ import annotations

import json

import pytest

from areal_pipeline.metrics import (curve_panels, metrics_table, plot_curves, run_history, significant,
                                    summarize)


def _png_size(path) -> tuple[int, int]:
    """(width, height) in pixels, from the PNG's header."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def records(n: int, **extra) -> list[dict]:
    return [{"iteration": k, "reward_mean": 0.1 * k, "eval_pass_at_1": None, "kl": None, **{
        name: (value(k) if callable(value) else value) for name, value in extra.items()}} for k in range(1, n + 1)]


def test_only_panels_with_data_are_drawn(tmp_path):
    reward_only = records(3)
    assert curve_panels(reward_only) == ["reward"]
    everything = records(3, entropy=lambda k: 2.0 - 0.1 * k, grad_norm=1.5, loss=lambda k: 3e-6 * k, staleness=0,
                         rollout_tokens_per_s=900.0, train_tokens_per_s=None)
    assert curve_panels(everything) == ["reward", "KL / entropy", "update", "staleness", "throughput"]
    # a panel whose metrics are all missing, None or not finite is left out
    assert curve_panels(records(2, grad_norm=float("nan"), loss=None)) == ["reward"]
    assert curve_panels([{"iteration": 0, "eval_pass_at_1": 0.05}]) == ["reward"]
    assert curve_panels([]) == [] and plot_curves([], tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()

    one = plot_curves(reward_only, tmp_path / "one.png", title="r")
    five = plot_curves(everything, tmp_path / "five.png", title="r")
    two = plot_curves(records(2, staleness=1), tmp_path / "two.png")
    (w1, h1), (w5, h5), (w2, h2) = _png_size(one), _png_size(five), _png_size(two)
    # one panel: one cell; two: a row of two; five: three rows of two
    assert (w1, h1) == (500, 300) and (w2, h2) == (1000, 300) and (w5, h5) == (1000, 900)


def test_the_table_keeps_metrics_with_a_value_and_their_digits():
    history = [{"iteration": 0, "eval_pass_at_1": 0.0625, "eval_reward": 0.0625}] + records(
        2, loss=lambda k: -3.14159e-6 * k, clip_fraction=None, grad_norm=12345.678, staleness=0, lr=1e-3)
    rows = metrics_table(history)
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    # kl and clip_fraction have no value in any iteration: no column
    assert list(rows[1]) == ["iteration", "reward_mean", "eval_pass_at_1", "loss", "grad_norm", "staleness",
                             "eval_reward", "lr"]
    assert all(list(r) == list(rows[0]) for r in rows)  # every row has every column
    assert rows[1]["loss"] == -3.142e-06 and rows[2]["loss"] == -6.283e-06 and rows[1]["grad_norm"] == 12350.0
    assert rows[0]["reward_mean"] is None and rows[0]["eval_pass_at_1"] == 0.0625 and rows[2]["reward_mean"] == 0.2
    assert significant(0.30000000000000004) == 0.3 and significant(7) == 7 and significant(None) is None
    assert significant(float("inf")) == float("inf")


def test_the_history_starts_with_the_initial_evaluation(tmp_path):
    run_dir = tmp_path / "r"
    assert run_history(run_dir) == []
    (run_dir / "iter_0").mkdir(parents=True)
    (run_dir / "iter_0" / "eval.json").write_text(json.dumps({"version": 0, "pass_at_1": 0.05, "reward_mean": 0.05}))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({**r, "eval_pass_at_1": 0.5 if r["iteration"] == 2
                                                                else None}) + "\n" for r in records(2)))
    history = run_history(run_dir)
    assert [r["iteration"] for r in history] == [0, 1, 2]
    assert history[0] == {"iteration": 0, "eval_pass_at_1": 0.05, "eval_reward": 0.05}
    summary = summarize(history)
    assert summary["iterations"] == 2 and summary["reward_first"] == pytest.approx(0.1)
    assert (summary["eval_pass_at_1_first"], summary["eval_pass_at_1_last"]) == (0.05, 0.5)
    assert summarize(history[:1]) == {}
