"""The embedded judge's curriculum: judge calls of the arithmetic task, in the judge's own chat (rewards/judge.py),
answered with the scores JSON a strict grader writes: 1 where a candidate's answer is the reference's number, else 0.

The candidates are what the tiny policy writes: right answers, the one-too-high habit of its warm start, near misses,
other numbers and malformed text; groups of 1 to MAX_GROUP, each with its own share of right answers. The questions
are the arithmetic train split's under the run's seed (the test split stays unseen), so the judge never grades a
test question it was taught on.
"""

from __future__ import annotations

import json
import random
from typing import Any

from areal_pipeline.warm_start import IGNORE, Example, Sampler

MAX_GROUP = 8  # the most candidates of one judge call it is taught on (rollout.gconfig.n_samples of the default)


def wrong_answer(rng: random.Random, answer: int) -> str:
    """A candidate that is not `answer`: mostly the policy's habits, sometimes text that is no single number."""
    draw = rng.random()
    if draw < 0.4:
        return str(answer + 1)
    if draw < 0.55:
        return str(max(answer - 1, 0) if answer > 0 else answer + 2)
    if draw < 0.85:
        return str(rng.choice([n for n in range(0, 30) if n != answer]))
    return rng.choice([str(answer) * 2, f"{answer} {answer + 1}", "", f"{answer}+", str(answer + 10)])


def group(rng: random.Random, answer: int) -> tuple[list[str], list[int]]:
    """A group's candidate answers and the scores a strict grader gives them."""
    n = rng.randint(1, MAX_GROUP)
    right_share = rng.random()
    scores = [int(rng.random() < right_share) for _ in range(n)]
    return [str(answer) if s else wrong_answer(rng, answer) for s in scores], scores


def scores_ids(tokenizer, scores: list[int]) -> list[int]:
    """The judge's answer as the workflows read a model turn: the JSON, then the end of turn."""
    return tokenizer(json.dumps({"scores": scores}))["input_ids"] + [tokenizer.eos_token_id]


def curriculum(tokenizer, tiny: Any, seed: int) -> Sampler:
    from areal_pipeline.config import DatasetConfig
    from areal_pipeline.data.datasets import load_records
    from areal_pipeline.rewards.group import Candidate
    from areal_pipeline.rewards.judge import judge_messages

    questions = {r["question"]: r for r in load_records(DatasetConfig(), "train", seed)}
    records = list(questions.values())

    def example(rng: random.Random) -> Example:
        record = rng.choice(records)
        completions, scores = group(rng, int(record["answer"]))
        candidates = [Candidate(prompt_id=record["prompt_id"], sample_idx=i, question=record["question"],
                                completion=text, answer=record["answer"]) for i, text in enumerate(completions)]
        prompt = list(tokenizer.apply_chat_template(judge_messages(candidates), add_generation_prompt=True,
                                                    tokenize=True, return_dict=False))
        target = scores_ids(tokenizer, scores)
        return prompt + target, [IGNORE] * len(prompt) + target

    def sample(rng: random.Random, n: int) -> list[Example]:
        return [example(rng) for _ in range(n)]

    return sample
