"""The reflection and multi-turn agents' curricula: whole arithmetic episodes, in the workflows' own tokens.

An episode is the workflow's prompt (`chat_prompt_ids`), then model turns `<number><|im_end|>`, each wrong one
followed by exactly the ids the workflow appends after it (`user_turn_ids` of its feedback message: the template's
closing, the user message, the next assistant header; labels -100 there and on the prompt), until a right answer
or as many turns as the workflow's config runs (`TURNS`: longer episodes only make the warm start slower). The
mix is a base model RL can improve on both counts: the first answer is one too high a share
`tiny.pretrain_off_by_one` of the time (the default task's habit), and after the feedback a wrong answer is fixed
only a share `FIX_RATE` of the time (otherwise it is repeated). A share `FIRST_TURN_ONLY` of the batches
holds only the episodes' first turns (the same prefixes): the sums and the habit are learned there at a quarter
of the tokens (the feedback message is most of an episode's length), which halves the warm start's time.
"""

from __future__ import annotations

import random
from typing import Any

from areal_pipeline.warm_start import IGNORE, Example, Sampler

TURNS = {"reflection": 2, "multi_turn": 3}  # the longest episode written: configs/gsm8k_<agent>.yaml's max_turns
FIX_RATE = 0.3  # share of wrong answers fixed after the feedback
FIRST_TURN_ONLY = 0.6  # share of the warm start's batches cut after the first turn


def reflection(tokenizer, tiny: Any, seed: int) -> Sampler:
    """Episodes of the reflection workflow: a wrong answer gets its "please try to answer it again"."""
    from areal_pipeline.workflows.reflection import REFLECTION_MESSAGE

    return episodes(tokenizer, tiny, seed, REFLECTION_MESSAGE, TURNS["reflection"])


def multi_turn(tokenizer, tiny: Any, seed: int) -> Sampler:
    """Episodes of the multi_turn workflow with its default feedback (MathMultiTurnAgent's wrong-answer message)."""
    from areal_pipeline.workflows.multi_turn import WRONG_MESSAGE

    return episodes(tokenizer, tiny, seed, WRONG_MESSAGE, TURNS["multi_turn"])


def episodes(tokenizer, tiny: Any, seed: int, wrong_message: str, max_turns: int) -> Sampler:
    """Episodes on the arithmetic train questions (`arithmetic.train_questions`)."""
    from areal_pipeline.warm_start.arithmetic import answer_ids, train_questions
    from areal_pipeline.workflows.turns import user_turn_ids

    closing, message = user_turn_ids(tokenizer, wrong_message)
    feedback = closing + message  # after a turn that ended with its EOS, as every curriculum turn does
    examples = train_questions(tokenizer, seed)

    def episode(rng: random.Random, prompt: list[int], answer: int, max_turns: int) -> Example:
        ids, labels = list(prompt), [IGNORE] * len(prompt)
        shown = answer + 1 if rng.random() < tiny.pretrain_off_by_one else answer
        for turn in range(max_turns):
            if turn:
                ids += feedback
                labels += [IGNORE] * len(feedback)  # the environment's tokens carry no loss
                shown = answer if rng.random() < FIX_RATE else shown
            target = answer_ids(tokenizer, shown)
            ids += target
            labels += target
            if shown == answer:
                break
        return ids, labels

    def sample(rng: random.Random, n: int) -> list[Example]:
        turns = 1 if rng.random() < FIRST_TURN_ONLY else max_turns  # one length a batch: little padding
        return [episode(rng, *rng.choice(examples), turns) for _ in range(n)]

    return sample
