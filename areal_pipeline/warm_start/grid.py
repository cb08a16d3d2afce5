"""The grid_world agent's curriculum: whole walks on the grid data set's train puzzles, in the workflow's own tokens.

A walk is the puzzle's prompt (`chat_prompt_ids`), then model turns `<move><|im_end|>`, each followed by exactly the
ids the workflow appends (`user_turn_ids` of the next observation; labels -100 there and on the prompt), until the
goal or `GridWorldConfig.max_steps` moves. A share `RANDOM_MOVE_SHARE` of the moves is drawn uniformly from the four
(a wall, a step away), the rest is a step towards the goal: the base model walks in the format and towards the goal
more often than not, but wanders enough that most walks run out of steps; RL has to learn to read the observation.

`grid_pits` teaches walks on puzzles with `PITS` pits: the observations name the pits next to the walker and the
moves ignore them (a walk that steps into one ends there); fewer moves are random (`PITS_RANDOM_MOVE_SHARE`), as
the pits end many walks early. RL has to learn to step around them.
"""

from __future__ import annotations

import random
from typing import Any

from areal_pipeline.warm_start import IGNORE, Example, Sampler

WRITTEN_FOR = {"rollout.workflow": "grid_world", "dataset.name": "grid", "dataset.grid_size": 5}
RANDOM_MOVE_SHARE = 0.6
PITS = 3  # the pits of the `grid_pits` curriculum's puzzles (configs/gigpo_grid_pits.yaml's dataset.grid_pits)
PITS_RANDOM_MOVE_SHARE = 0.3


def good_moves(cell: tuple[int, int], goal: tuple[int, int]) -> list[str]:
    """The moves that bring `cell` one step nearer `goal`."""
    dx, dy = goal[0] - cell[0], goal[1] - cell[1]
    return [m for m, wanted in (("R", dx > 0), ("L", dx < 0), ("U", dy > 0), ("D", dy < 0)) if wanted]


def curriculum_with_pits(tokenizer, tiny: Any, seed: int) -> Sampler:
    return curriculum(tokenizer, tiny, seed, pits=PITS, random_move_share=PITS_RANDOM_MOVE_SHARE)


def curriculum(tokenizer, tiny: Any, seed: int, pits: int = 0, random_move_share: float = RANDOM_MOVE_SHARE) -> Sampler:
    from areal_pipeline.config import DatasetConfig
    from areal_pipeline.data.datasets import load_records
    from areal_pipeline.workflows.grid_world import MOVES, GridWorldConfig, Puzzle, observation, step
    from areal_pipeline.workflows.rlvr import chat_prompt_ids
    from areal_pipeline.workflows.turns import user_turn_ids

    dataset = DatasetConfig(name="grid", grid_pits=pits)
    records = load_records(dataset, dataset.train_split, seed)
    puzzles = [(chat_prompt_ids(tokenizer, r["messages"]), Puzzle.parse(r["answer"], dataset.grid_size))
               for r in records]
    max_steps = GridWorldConfig().max_steps
    move_ids = {move: tokenizer(move)["input_ids"] + [tokenizer.eos_token_id] for move in MOVES}
    environment: dict[str, list[int]] = {}

    def after(text: str) -> list[int]:
        if text not in environment:
            closing, message = user_turn_ids(tokenizer, text)
            environment[text] = closing + message
        return environment[text]

    def walk(rng: random.Random, prompt: list[int], puzzle: Puzzle) -> Example:
        ids, labels = list(prompt), [IGNORE] * len(prompt)
        cell = puzzle.start
        for turn in range(max_steps):
            move = rng.choice(list(MOVES)) if rng.random() < random_move_share else rng.choice(
                good_moves(cell, puzzle.goal))
            ids += move_ids[move]
            labels += move_ids[move]
            cell = step(cell, move, puzzle.size)
            if cell == puzzle.goal or cell in puzzle.pits or turn + 1 == max_steps:
                break
            environment_ids = after(observation(cell, puzzle.goal, puzzle.pits))
            ids += environment_ids
            labels += [IGNORE] * len(environment_ids)
        return ids, labels

    def sample(rng: random.Random, n: int) -> list[Example]:
        return [walk(rng, *rng.choice(puzzles)) for _ in range(n)]

    return sample
