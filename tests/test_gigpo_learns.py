"""GiGPO learns on its multi-step environment: configs/gigpo_grid.yaml shortened (14 iterations instead of 30)
through the real servers and trainer, from the config's own warm-started base model; every step record the
advantage used came through the rollout shards."""

from __future__ import annotations

import pytest

from _learning_helpers import base_model, first_and_last, short_run
from areal_pipeline.data.shards import read_table, read_trajectories
from areal_pipeline.run_dir import RunPaths


@pytest.fixture(scope="module")
def grid_base_model(model_cache) -> str:
    return base_model("gigpo_grid.yaml", model_cache)


# The base model walks to the goal in about a third of its walks; by hand (bench/gigpo_vs_grpo.py, seed 1) the
# success rate is ~0.6 by iteration 6 and ~0.7 from iteration 14 on.
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
        starts = [i for i, m in enumerate(t.loss_mask) if m and (i == 0 or not t.loss_mask[i - 1])]
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
