"""The default task's curriculum: single-turn arithmetic answers, a share of them one too high."""

from __future__ import annotations

import random
from typing import Any

from areal_pipeline.warm_start import IGNORE, Example, Sampler


def curriculum(tokenizer, tiny: Any, seed: int) -> Sampler:
    """Questions of the default arithmetic generator's train split under the run's seed (its test split stays
    unseen), answered as `<number><|im_end|>`. A share `tiny.pretrain_off_by_one` of the answers is one too high:
    the model learns the format and the sums, but also a habit RL has to unlearn."""
    from areal_pipeline.config import DatasetConfig
    from areal_pipeline.data.datasets import load_records
    from areal_pipeline.model import EOS_TOKEN

    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    questions = {r["question"]: r for r in load_records(DatasetConfig(), "train", seed)}
    examples = [(tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True,
                                               return_dict=False), int(r["answer"]))
                for r in questions.values()]

    def sample(rng: random.Random, n: int) -> list[Example]:
        batch = []
        for prompt, answer in rng.choices(examples, k=n):
            shown = answer + 1 if rng.random() < tiny.pretrain_off_by_one else answer
            target = tokenizer(str(shown))["input_ids"] + [eos]
            batch.append((prompt + target, [IGNORE] * len(prompt) + target))  # the loss is on the answer only
        return batch

    return sample
