"""GiGPO learns on its multi-step environment: configs/gigpo_grid.yaml shortened (14 iterations instead of 30)
through the real servers and trainer, from the config's own warm-started base model; every step record the
advantage used came through the rollout shards, and the advantage trained on is GRPO's plus the step term, which the
test computes by hand from the steps' rewards and states."""

from __future__ import annotations

import statistics
from collections import defaultdict

import pytest

from _learning_helpers import base_model, first_and_last, short_run
from areal_pipeline.data.shards import read_table, read_trajectories
from areal_pipeline.run_dir import RunPaths


@pytest.fixture(scope="module")
def grid_base_model(model_cache) -> str:
    return base_model("gigpo_grid.yaml", model_cache)


# The base model walks to the goal in about a third of its walks; by hand (bench/gigpo_vs_grpo.py, seed 1) the
# success rate is ~0.6 by iteration 6 and ~0.7 from iteration 14 on. The fixture's warm start counts against the
# test's time limit, and on a loaded machine it alone took most of the suite's default limit: a limit of its own,
# as the search agent's.
@pytest.mark.timeout(1800)
def test_gigpo_raises_the_success_rate_of_grid_walks(grid_base_model, tmp_path):
    cfg, records = short_run("gigpo_grid.yaml", tmp_path, f"model.path={grid_base_model}", "total_iterations=14")
    curve = [round(r["reward_mean"], 2) for r in records]
    first, last = first_and_last(records, "reward_mean", 3)
    assert last > first + 0.15, curve
    assert records[-1]["agent/num_steps"] < records[0]["agent/num_steps"], curve  # shorter walks
    paths = RunPaths(cfg.run_dir)
    walks = read_trajectories(paths.rollout(1))
    # a group's walks start from one cell: every group's first steps share one anchor state
    for group in {t.group_id for t in walks}:
        first_states = {next(s for s in t.step_states if s != -1) for t in walks if t.group_id == group}
        assert len(first_states) == 1
    # the reward is the goal step's alone; and walks of a group meet again beyond their start (the step groups)
    for t in walks:
        starts = step_starts(t.loss_mask)
        step_rewards = [t.step_rewards[i] for i in starts]
        assert step_rewards == [0.0] * (len(starts) - 1) + [t.reward], step_rewards
    revisited = 0
    for group in {t.group_id for t in walks}:
        seen: dict[int, int] = {}
        for t in (t for t in walks if t.group_id == group):
            for state in {s for s in t.step_states if s != -1}:
                seen[state] = seen.get(state, 0) + 1
        revisited += sum(count > 1 for count in seen.values()) - 1  # the start cell is shared by construction
    assert revisited > 0
    batch = read_table(paths.batch(1), schema=None)
    assert batch.column("step_states").null_count == 0
    assert_step_term_trained_on(batch.to_pylist(), cfg.ppo.gigpo_discount)


def step_starts(mask: list) -> list[int]:
    return [i for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])]


def hand_step_advantages(rows: list[dict], gamma: float) -> dict[tuple[int, int], float]:
    """GiGPO's A^S by the paper, (row, first token of the step) -> value: each step's discounted return against
    the returns of the steps of its group that acted from the same state ((R - mean) / (std + 1e-6)), 0 alone."""
    steps = []
    for r, row in enumerate(rows):
        starts = step_starts(row["loss_mask"])
        returns, following = [], 0.0
        for i in reversed(starts):
            following = row["step_rewards"][i] + gamma * following
            returns.append(following)
        for i, ret in zip(starts, reversed(returns)):
            steps.append((r, i, (row["group_id"], row["step_states"][i]), ret))
    by_state = defaultdict(list)
    for _, _, key, ret in steps:
        by_state[key].append(ret)
    return {(r, i): 0.0 if len(by_state[key]) < 2 else
            (ret - statistics.mean(by_state[key])) / (statistics.stdev(by_state[key]) + 1e-6)
            for r, i, key, ret in steps}


def assert_step_term_trained_on(rows: list[dict], gamma: float) -> None:
    """GRPO gives every step of a walk one advantage, and the batch normalisation is one affine map over the batch:
    so two steps of one walk differ in advantage by omega/std times their difference in A^S, one positive factor
    for the whole batch. With the step term weighted 0 (or computed wrongly) the differences are 0 or out of
    proportion."""
    hand = hand_step_advantages(rows, gamma)
    pairs = []  # (trained difference, by-hand difference) of consecutive steps of a walk
    for r, row in enumerate(rows):
        starts = step_starts(row["loss_mask"])
        pairs += [(row["advantages"][b] - row["advantages"][a], hand[(r, b)] - hand[(r, a)])
                  for a, b in zip(starts, starts[1:])]
    ratios = [trained / expected for trained, expected in pairs if abs(expected) > 1e-2]
    assert len(ratios) >= 10, (len(ratios), len(pairs))  # walks whose steps the step term tells apart
    assert min(ratios) > 0 and max(ratios) == pytest.approx(min(ratios), rel=1e-3), (min(ratios), max(ratios))
    factor = statistics.mean(ratios)
    for trained, expected in pairs:  # the small differences too, the zero ones included
        assert trained == pytest.approx(factor * expected, rel=1e-3, abs=1e-5), (trained, expected, factor)
