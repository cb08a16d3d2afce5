"""A multi-step text environment whose states repeat across a group: walking to a goal on a small grid.

A puzzle (the `grid` data set: a start and a goal on a `dataset.grid_size` square, and `dataset.grid_pits` pits) is
one prompt, so its group's episodes all start from one cell and keep meeting the same cells: the anchor states of
GiGPO's step groups (training/gigpo.py). Each step the agent sees where the goal lies from it (`goal +2,-1`: two to
the right, one down) and which moves would step into a pit next to it (`pit L,U`), and answers one move, U, D, L or
R; a move off the grid or an answer that is no move leaves it where it was. Reaching the goal ends the episode with
reward 1 on that step; stepping into a pit, or running out of `agent.max_steps` steps, ends it with 0. Pits make
walks that fail after good moves: where step credit (GiGPO) and episode credit (GRPO) part.

The trajectory's reward is the episode's success (GRPO's signal); each model turn records the cell it acted from
(`step_states`, as `gigpo.anchor_key` of the cell) and its step reward (`step_rewards`), and `metadata["steps"]` keeps
the walk for humans. Scored in process: the environment's rules are its reward, nothing to run in the reward pool.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from areal_pipeline.config import at_least
from areal_pipeline.data.datasets import GRID_MOVES, grid_observation, grid_pits_next
from areal_pipeline.data.trajectory import SequenceBuilder, Trajectory
from areal_pipeline.inference.types import ModelRequest, SamplingParams
from areal_pipeline.workflows.rlvr import chat_prompt_ids, sample_seed
from areal_pipeline.workflows.turns import next_turn_ids, user_turn_ids

MOVES = GRID_MOVES


@dataclass
class GridWorldConfig:
    """rollout.agent of rollout.workflow=grid_world."""

    # grid_world: model turns (moves) per episode at most; the goal not reached by then scores 0
    max_steps: int = 8

    field_rules: ClassVar[dict] = {"max_steps": at_least(1)}


@dataclass(frozen=True)
class Puzzle:
    start: tuple[int, int]
    goal: tuple[int, int]
    size: int
    pits: frozenset = frozenset()

    @classmethod
    def parse(cls, text: str, size: int) -> "Puzzle":
        """`"sx,sy>gx,gy"` or `"sx,sy>gx,gy|px,py;..."` (with pits), the grid data set's answer."""
        walk, _, pit_text = text.partition("|")
        try:
            start, goal = (tuple(int(v) for v in part.split(",")) for part in walk.split(">"))
            pits = [tuple(int(v) for v in pit.split(",")) for pit in pit_text.split(";")] if pit_text else []
            if any(len(cell) != 2 for cell in (start, goal, *pits)):
                raise ValueError
        except ValueError:
            raise ValueError(f"grid_world: {text!r} is not a puzzle 'sx,sy>gx,gy' or 'sx,sy>gx,gy|px,py;...' "
                             "(dataset.name=grid)") from None
        if not all(0 <= v < size for cell in (start, goal, *pits) for v in cell):
            raise ValueError(f"grid_world: puzzle {text!r} does not fit a {size}x{size} grid (dataset.grid_size)")
        if start in pits or goal in pits:
            raise ValueError(f"grid_world: puzzle {text!r} has a pit on its start or goal")
        return cls(start, goal, size, frozenset(pits))


def step(cell: tuple[int, int], answer: str, size: int) -> tuple[int, int]:
    """The cell after `answer`: one move, or the same cell for a move off the grid or an answer that is no move."""
    move = MOVES.get(answer.strip().upper())
    if move is None:
        return cell
    x, y = cell[0] + move[0], cell[1] + move[1]
    return (x, y) if 0 <= x < size and 0 <= y < size else cell


def observation(cell: tuple[int, int], goal: tuple[int, int], pits=frozenset()) -> str:
    return grid_observation(goal[0] - cell[0], goal[1] - cell[1], grid_pits_next(cell, pits))


def state_key(puzzle: Puzzle, cell: tuple[int, int]) -> str:
    """The environment state a step acts from: the cell on this puzzle (what the agent sees is a function of it)."""
    return f"{puzzle.start}>{puzzle.goal}@{cell}"


class GridWorldWorkflow:
    config_class = GridWorldConfig
    reward_function = None  # the environment's rules score the episode
    tools = ()

    def __init__(self, gconfig, tokenizer, grid_size: int, max_steps: int = 8):
        if max_steps < 1:
            raise ValueError(f"agent.max_steps must be at least 1, got {max_steps}")
        self.sampling = SamplingParams.from_config(gconfig)
        self.tokenizer = tokenizer
        self.grid_size = grid_size
        self.max_steps = max_steps
        self._observation_ids: dict[str, tuple[list[int], list[int]]] = {}

    @classmethod
    def from_config(cls, cfg, tokenizer, reward_pool, *, reward_fn, tool_addresses) -> "GridWorldWorkflow":
        return cls(cfg.rollout.gconfig, tokenizer, cfg.dataset.grid_size, cfg.rollout.agent.max_steps)

    def _environment_ids(self, text: str) -> tuple[list[int], list[int]]:
        if text not in self._observation_ids:  # at most (2 * grid_size - 1)^2 observations
            self._observation_ids[text] = user_turn_ids(self.tokenizer, text)
        return self._observation_ids[text]

    async def arun_episode(self, engine, data: dict[str, Any]) -> Trajectory:
        from areal_pipeline.training.gigpo import anchor_key, per_token

        puzzle = Puzzle.parse(str(data["answer"]), self.grid_size)
        seq = SequenceBuilder(chat_prompt_ids(self.tokenizer, data["messages"]))
        rid = uuid.uuid4().hex
        messages = list(data["messages"])
        cell, states, rewards, steps = puzzle.start, [], [], []
        resp: Optional[Any] = None
        for turn in range(self.max_steps):
            sampling = dataclasses.replace(self.sampling, **sample_seed(data, turn))
            resp = await engine.agenerate(ModelRequest(rid=rid, input_ids=list(seq.input_ids), sampling=sampling))
            seq.add_model_turn(resp)
            answer = self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
            states.append(anchor_key(state_key(puzzle, cell)))
            after = step(cell, answer, puzzle.size)
            reached, fell = after == puzzle.goal, after in puzzle.pits
            rewards.append(1.0 if reached else 0.0)
            steps.append({"cell": list(cell), "answer": answer, "moved": after != cell, "pit": fell})
            messages.append({"role": "assistant", "content": answer})
            cell = after
            if reached or fell or turn + 1 == self.max_steps:
                break
            text = observation(cell, puzzle.goal, puzzle.pits)
            closing, message = self._environment_ids(text)
            seq.add_environment(next_turn_ids(resp, self.tokenizer.eos_token_id, closing, message))
            messages.append({"role": "user", "content": text})
        success = cell == puzzle.goal
        n = len(seq.input_ids)
        return seq.trajectory(
            prompt_id=data["prompt_id"],
            group_id=data["prompt_id"],
            sample_idx=data.get("sample_idx", 0),
            reward=1.0 if success else 0.0,
            stop_reason=resp.stop_reason,
            messages=messages,
            text=self.tokenizer.decode(seq.input_ids[seq.prompt_len:]),
            metadata={"answer": data.get("answer"), "steps": steps, "server": resp.server, "success": success,
                      "num_steps": len(steps), "wasted_moves": sum(not s["moved"] for s in steps),
                      "fell_in_pit": cell in puzzle.pits},
            step_states=per_token(states, seq.turn_spans, n, fill=-1),
            step_rewards=per_token(rewards, seq.turn_spans, n, fill=0.0),
        )
