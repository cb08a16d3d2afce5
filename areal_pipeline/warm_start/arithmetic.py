"""The default task's curriculum: single-turn arithmetic answers, a share of them one too high."""

from __future__ import annotations

import random
from typing import Any

from areal_pipeline.warm_start import IGNORE, Example, Sampler


def train_questions(tokenizer, seed: int) -> list[tuple[list[int], int]]:
    """(prompt ids, answer) of each distinct question of the default arithmetic generator's train split under the
    run's seed: its test split stays unseen by every warm start."""
    from areal_pipeline.config import DatasetConfig
    from areal_pipeline.data.datasets import load_records
    from areal_pipeline.workflows.rlvr import chat_prompt_ids

    questions = {r["question"]: r for r in load_records(DatasetConfig(), "train", seed)}
    return [(chat_prompt_ids(tokenizer, r["messages"]), int(r["answer"])) for r in questions.values()]


def answer_ids(tokenizer, answer: int) -> list[int]:
    """A model turn as the workflows read it: `<number><|im_end|>`."""
    return tokenizer(str(answer))["input_ids"] + [tokenizer.eos_token_id]


def curriculum(tokenizer, tiny: Any, seed: int) -> Sampler:
    """Single-turn answers to the train questions. A share `tiny.pretrain_off_by_one` of them is one too high: the
    model learns the format and the sums, but also a habit RL has to unlearn."""
    examples = train_questions(tokenizer, seed)

    def sample(rng: random.Random, n: int) -> list[Example]:
        batch = []
        for prompt, answer in rng.choices(examples, k=n):
            shown = answer + 1 if rng.random() < tiny.pretrain_off_by_one else answer
            target = answer_ids(tokenizer, shown)
            batch.append((prompt + target, [IGNORE] * len(prompt) + target))  # the loss is on the answer only
        return batch

    return sample
