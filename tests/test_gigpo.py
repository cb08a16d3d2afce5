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
from areal_pipeline.training.batches import compute_batch
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


def test_pits_parse_show_next_to_the_walker_and_leave_a_way_to_the_goal():
    from areal_pipeline.config import DatasetConfig
    from areal_pipeline.data.datasets import DatasetError, _grid_connected

    puzzle = Puzzle.parse("0,0>3,3|1,0;0,2", 5)
    assert puzzle.pits == {(1, 0), (0, 2)} and Puzzle.parse("0,0>3,3", 5).pits == frozenset()
    assert observation((0, 1), (3, 3), puzzle.pits) == "goal +3,+2 pit U"
    assert observation((0, 0), (3, 3), puzzle.pits) == "goal +3,+3 pit R"
    assert observation((1, 1), (3, 3), puzzle.pits) == "goal +2,+2 pit D"
    assert observation((0, 0), (3, 3), {(0, 1), (1, 0)}) == "goal +3,+3 pit U,R"
    with pytest.raises(ValueError, match="has a pit on its start or goal"):
        Puzzle.parse("0,0>3,3|3,3", 5)
    with pytest.raises(ValueError, match="does not fit a 5x5 grid"):
        Puzzle.parse("0,0>3,3|5,1", 5)
    with pytest.raises(ValueError, match="is not a puzzle"):
        Puzzle.parse("0,0>3,3|1", 5)

    plain = load_records(DatasetConfig(name="grid"), "train", 1)
    with_pits = load_records(DatasetConfig(name="grid", grid_pits=4), "train", 1)
    # the same puzzles, in the same order, with pits added: a grid without pits is the grid it always was
    assert [r["answer"] for r in plain] == [r["answer"].split("|")[0] for r in with_pits]
    for record in with_pits:
        puzzle = Puzzle.parse(record["answer"], 5)
        assert len(puzzle.pits) == 4 and _grid_connected(5, puzzle.start, puzzle.goal, puzzle.pits)
        assert record["messages"][-1]["content"].endswith(observation(puzzle.start, puzzle.goal, puzzle.pits))
    assert with_pits == load_records(DatasetConfig(name="grid", grid_pits=4), "train", 1)
    with pytest.raises(DatasetError, match="grid_pits must be 0..23 on a 5x5 grid, got 24"):
        load_records(DatasetConfig(name="grid", grid_pits=24), "train", 1)
    with pytest.raises(DatasetError, match="leaves no way from"):
        load_records(DatasetConfig(name="grid", grid_size=3, grid_pits=6), "train", 1)


def test_a_walk_that_steps_into_a_pit_ends_there_with_zero():
    from test_workflows_common import ScriptedEngine, play

    from areal_pipeline.config import GenerationConfig
    from areal_pipeline.model import build_byte_tokenizer
    from areal_pipeline.workflows.grid_world import GridWorldWorkflow

    tokenizer = build_byte_tokenizer()
    moves = {0: "U", 1: "R", 2: "U"}  # (0,0) -> (0,1) -> (1,1), the pit
    engine = ScriptedEngine(lambda request, turn: tokenizer(moves[turn])["input_ids"] + [tokenizer.eos_token_id])
    workflow = GridWorldWorkflow(GenerationConfig(max_new_tokens=4), tokenizer, grid_size=5, max_steps=8)
    data = {"prompt_id": "p", "answer": "0,0>3,3|1,1", "messages": [{"role": "user", "content": "go"}]}
    [walk] = play(workflow, engine, data)
    assert walk.reward == 0.0 and walk.metadata["fell_in_pit"] and walk.metadata["num_steps"] == 2
    assert [s["pit"] for s in walk.metadata["steps"]] == [False, True]
    assert walk.messages[-2]["content"] == "goal +3,+2 pit R"  # it was told, and stepped in anyway
    assert len(engine.calls) == 2


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


def test_the_pits_warm_start_teaches_the_workflows_own_walks():
    """Each taught walk, replayed through grid_world with the same moves, is the same tokens: the base model learns
    the environment's format exactly, pits and their observations included."""
    import random

    from test_workflows_common import ScriptedEngine, play

    from areal_pipeline.config import DatasetConfig, GenerationConfig, TinyModelConfig
    from areal_pipeline.model import build_byte_tokenizer
    from areal_pipeline.warm_start import IGNORE, curriculum
    from areal_pipeline.warm_start.grid import PITS
    from areal_pipeline.workflows.grid_world import GridWorldWorkflow
    from areal_pipeline.workflows.rlvr import chat_prompt_ids

    tokenizer = build_byte_tokenizer()
    records = load_records(DatasetConfig(name="grid", grid_pits=PITS), "train", 1)
    prompts: dict[tuple, list] = {}  # puzzles of one relative goal and start's pits share a prompt
    for r in records:
        prompts.setdefault(tuple(chat_prompt_ids(tokenizer, r["messages"])), []).append(r)
    sample = curriculum("grid_pits")(tokenizer, TinyModelConfig(pretrain_task="grid_pits"), 1)
    fell = 0
    for ids, labels in sample(random.Random(0), 40):
        prompt_len = labels.index(next(label for label in labels if label != IGNORE))
        taught = [i for i, label in enumerate(labels) if label != IGNORE]
        moves, current = [], []
        for i in taught:  # the labelled runs: a move, then the end of turn
            current.append(ids[i])
            if ids[i] == tokenizer.eos_token_id:
                moves.append(current)
                current = []
        replays = []
        for record in prompts[tuple(ids[:prompt_len])]:
            engine = ScriptedEngine(lambda request, turn, moves=moves: moves[min(turn, len(moves) - 1)])
            workflow = GridWorldWorkflow(GenerationConfig(max_new_tokens=4), tokenizer, grid_size=5, max_steps=8)
            [walk] = play(workflow, engine, {**record, "prompt_id": "p"})
            if walk.input_ids == ids:
                replays.append(walk)
        assert replays, "no puzzle of this prompt plays the taught walk"
        assert all(w.num_turns == len(moves) for w in replays)
        fell += replays[0].metadata["fell_in_pit"]
    assert 0 < fell < 40  # the base model is blind to the pits: some of its walks end in one


def test_a_step_that_opens_the_sequence_is_a_step():
    from areal_pipeline.training.gigpo import step_index, step_starts

    mask = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 0]])
    assert step_starts(mask).tolist() == [[True, False, False, True], [False, True, False, False]]
    assert step_index(mask).tolist() == [[0, 0, -1, 1], [-1, 2, 2, -1]]
