"""GiGPO (training/gigpo.py) on cases worked out by hand, the grid_world environment's rules, the step records'
way through the shards into the advantage, and the config's checks."""

import math

import pyarrow as pa
import pytest
import torch

from areal_pipeline.config import ConfigError, NormConfig, PPOConfig
from areal_pipeline.data.datasets import load_records
from areal_pipeline.data.shards import read_table, read_trajectories, write_shards
from areal_pipeline.data.trajectory import Trajectory
from areal_pipeline.training.advantage_registry import make_advantage
from areal_pipeline.training.advantages import compute_advantages
from areal_pipeline.training.gigpo import anchor_key, combine, per_token, step_advantages, step_index, step_returns
from areal_pipeline.training.ppo import compute_batch
from areal_pipeline.workflows.grid_world import Puzzle, observation, state_key, step

S = 1 / math.sqrt(2)  # 0.7071

# Two walks of one group. Row 0: steps from cells 10 (tokens 1-2) and 20 (token 4), the second reaching the goal.
# Row 1: steps from cells 10 (token 1), 30 (token 3) and 20 (token 5), the third reaching the goal.
MASK = torch.tensor([[0, 1, 1, 0, 1, 0, 0],
                     [0, 1, 0, 1, 0, 1, 0]], dtype=torch.float32)
STATES = torch.tensor([[-1, 10, 10, -1, 20, -1, -1],
                       [-1, 10, -1, 30, -1, 20, -1]])
REWARDS = torch.tensor([[0, 0, 0, 0, 1, 0, 0],
                        [0, 0, 0, 0, 0, 1, 0]], dtype=torch.float32)


def close(t, expected):
    torch.testing.assert_close(t, torch.tensor(expected, dtype=t.dtype), rtol=1e-4, atol=1e-5)


def test_steps_are_runs_of_generated_tokens_numbered_across_the_batch():
    close(step_index(MASK), [[-1, 0, 0, -1, 1, -1, -1], [-1, 2, -1, 3, -1, 4, -1]])


def test_discounted_step_returns_stay_within_their_row():
    # gamma 0.5. Row 0: R = [0 + 0.5 * 1, 1] = [0.5, 1]; row 1: [0.25, 0.5, 1] (row 0's return does not leak)
    returns, rows = step_returns(REWARDS, MASK, 0.5)
    close(returns, [0.5, 1.0, 0.25, 0.5, 1.0])
    assert rows.tolist() == [0, 0, 1, 1, 1]


def test_step_groups_are_the_steps_of_a_group_from_one_state():
    # Cell 10: returns {0.5, 0.25}, mean 0.375, unbiased std sqrt(2 * 0.125^2 / 1) = 0.1768 -> +-0.7071.
    # Cell 20: {1, 1}: no spread, 0. Cell 30: one step, nothing to compare with, 0. Each step counts once: row 0's
    # step from cell 10 has two tokens and is still one entry of its step group.
    out = step_advantages(REWARDS, STATES, MASK, torch.tensor([0, 0]), gamma=0.5)
    close(out, [[0, S, S, 0, 0, 0, 0], [0, -S, 0, 0, 0, 0, 0]])


def test_the_mean_norm_variant_only_centres():
    out = step_advantages(REWARDS, STATES, MASK, torch.tensor([0, 0]), gamma=0.5, norm="none")
    close(out, [[0, 0.125, 0.125, 0, 0, 0, 0], [0, -0.125, 0, 0, 0, 0, 0]])


def test_the_same_state_in_two_groups_forms_two_step_groups():
    # different prompts: every step is alone in its step group
    out = step_advantages(REWARDS, STATES, MASK, torch.tensor([0, 1]), gamma=0.5)
    close(out, torch.zeros(2, 7).tolist())


def test_an_unknown_norm_is_refused():
    with pytest.raises(ValueError, match="gigpo_norm must be one of"):
        step_advantages(REWARDS, STATES, MASK, torch.tensor([0, 0]), norm="max")


def test_combine_adds_omega_times_the_step_advantage_on_generated_tokens():
    episode = torch.tensor([[9.0, 1.0, 1.0, 9.0, 1.0, 9.0, 9.0], [9.0, -1.0, 9.0, -1.0, 9.0, -1.0, 9.0]])
    step = torch.tensor([[0, S, S, 0, 0, 0, 0], [0, -S, 0, 0, 0, 0, 0]])
    close(combine(episode, step, MASK, 0.5),
          [[0, 1 + S / 2, 1 + S / 2, 0, 1, 0, 0], [0, -1 - S / 2, 0, -1, 0, -1, 0]])


def _batch(rewards):
    return {"rewards": torch.tensor(rewards), "loss_mask": MASK, "logprobs": torch.zeros(2, 7),
            "group_ids": torch.tensor([0, 0]), "no_eos": torch.tensor([False, False]), "step_states": STATES,
            "step_rewards": REWARDS}


def test_gigpo_is_grpo_plus_the_step_advantage_then_the_advantage_norm():
    none = NormConfig(mean_level="none", std_level="none")
    cfg = PPOConfig(advantage="gigpo", gigpo_step_weight=2.0, gigpo_discount=0.5, adv_norm=none)
    out = make_advantage(cfg).fn(_batch([1.0, 0.0]))
    grpo = compute_advantages(_batch([1.0, 0.0]), PPOConfig(adv_norm=none))["advantages"]
    # GRPO: rewards {1, 0} of one group -> +-0.7071 on every generated token of each row
    close(grpo, [[0, S, S, 0, S, 0, 0], [0, -S, 0, -S, 0, -S, 0]])
    close(out["advantages"], [[0, 3 * S, 3 * S, 0, S, 0, 0], [0, -3 * S, 0, -S, 0, -S, 0]])
    assert {"returns", "token_rewards", "kl", "task_rewards"} <= set(out)


def test_gigpo_without_step_records_is_a_clear_error():
    batch = {k: v for k, v in _batch([1.0, 0.0]).items() if not k.startswith("step_")}
    with pytest.raises(ValueError, match="needs each step's state and return"):
        make_advantage(PPOConfig(advantage="gigpo")).fn(batch)


def test_a_workflow_recording_no_states_is_refused_at_load():
    from areal_pipeline.run_spec import load_config

    with pytest.raises(ConfigError, match="ppo.advantage=gigpo needs a workflow that records each step"):
        load_config("configs/tiny_cpu.yaml", ["ppo.advantage=gigpo"])
    with pytest.raises(ConfigError, match="a group reward replaces each trajectory's reward"):
        load_config("configs/gigpo_grid.yaml", ["rollout.group_reward=judge", "judge.base_url=http://127.0.0.1:9",
                                                "judge.model=m"])
    with pytest.raises(ConfigError, match="ppo.gigpo_norm='max'"):
        load_config("configs/gigpo_grid.yaml", ["ppo.gigpo_norm=max"])


# ------------------------------------------------------------------------------------------- the environment

def test_moves_walls_and_answers_that_are_no_move():
    assert step((1, 1), "R", 5) == (2, 1)
    assert step((1, 1), " u ", 5) == (1, 2)
    assert step((0, 0), "L", 5) == (0, 0)  # off the grid: stays
    assert step((4, 4), "U", 5) == (4, 4)
    assert step((2, 2), "north", 5) == (2, 2)  # no move: stays
    assert observation((1, 3), (4, 0)) == "goal +3,-3"


def test_puzzles_parse_and_bad_ones_are_named():
    assert Puzzle.parse("0,1>3,4", 5) == Puzzle((0, 1), (3, 4), 5)
    with pytest.raises(ValueError, match="is not a puzzle"):
        Puzzle.parse("0,1-3,4", 5)
    with pytest.raises(ValueError, match="does not fit a 5x5 grid"):
        Puzzle.parse("0,1>5,4", 5)


def test_the_grid_splits_never_share_a_puzzle_and_states_have_stable_keys():
    from areal_pipeline.config import DatasetConfig

    cfg = DatasetConfig(name="grid", grid_size=4)
    train, test = load_records(cfg, "train", 1), load_records(cfg, "test", 1)
    assert not {r["answer"] for r in train} & {r["answer"] for r in test}
    assert len(train) + len(test) == len({r["answer"] for r in train + test})
    assert train == load_records(cfg, "train", 1)
    puzzle = Puzzle.parse(train[0]["answer"], 4)
    assert anchor_key(state_key(puzzle, (1, 1))) == anchor_key(state_key(puzzle, (1, 1))) >= 0
    assert anchor_key(state_key(puzzle, (1, 1))) != anchor_key(state_key(puzzle, (1, 2)))


# ------------------------------------------------------------------------------------------- through the shards

def _trajectory(i, mask, states, rewards, reward):
    n = len(mask)
    return Trajectory(prompt_id="p", group_id="p", sample_idx=i, input_ids=list(range(n)), loss_mask=mask,
                      logprobs=[0.0] * n, versions=[0] * n, reward=reward, step_states=states, step_rewards=rewards)


def test_step_records_travel_through_the_shards_exactly_into_the_advantage(tmp_path):
    big = anchor_key("a state whose key needs all 63 bits") | (1 << 62)
    rows = [_trajectory(0, MASK[0].int().tolist(), [-1, big, big, -1, 20, -1, -1], REWARDS[0].tolist(), 1.0),
            _trajectory(1, MASK[1].int().tolist()[:6], [-1, big, -1, 30, -1, 20], REWARDS[1].tolist()[:6], 0.0)]
    write_shards(rows, tmp_path, run_id="r", iteration=1)
    back = read_trajectories(tmp_path)
    assert back[0].step_states[1] == big and back[1].step_rewards == REWARDS[1].tolist()[:6]
    table, _ = compute_batch(read_table(tmp_path), PPOConfig(advantage="gigpo", gigpo_discount=0.5,
                                                             adv_norm=NormConfig(mean_level="none",
                                                                                 std_level="none")))
    advantages = table.column("advantages").to_pylist()
    # GRPO's +-0.7071 plus the step advantage of the shared state (+-0.7071 on the steps from `big`)
    assert advantages[0] == pytest.approx([0, 2 * S, 2 * S, 0, S, 0, 0], rel=1e-4, abs=1e-5)
    assert advantages[1] == pytest.approx([0, -2 * S, 0, -S, 0, -S], rel=1e-4, abs=1e-5)


def test_step_records_of_the_wrong_length_are_refused():
    with pytest.raises(ValueError, match="step_states has 2 entries for 3 tokens"):
        _trajectory(0, [0, 1, 1], [-1, 5], [0.0, 0.0, 0.0], 1.0)


def test_shards_written_before_step_records_read_back_without_them(tmp_path):
    from areal_pipeline.data.shards import trajectory_table, write_table

    old = trajectory_table([_trajectory(0, [0, 1], None, None, 1.0)], "r", 1).drop_columns(
        ["step_states", "step_rewards"])
    write_table(old, tmp_path, run_id="r", iteration=1)
    (back,) = read_trajectories(tmp_path)
    assert back.step_states is None and back.step_rewards is None and back.reward == 1.0
