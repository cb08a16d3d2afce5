"""A reward for recorded traffic that checks the answer itself (`recurring.traffic_reward`, docs/online.md): the
embedded default's users ask "What is a<op>b? Answer with the number.", so the right answer is in the question. A
firing calls it on every recorded sample that got no feedback:

    areal-pipeline recurring fire --config configs/online_cpu.yaml \\
        recurring.traffic_reward=examples/arithmetic_verifier.py:score

Returns None for a question it cannot read (that sample waits for feedback instead)."""

from __future__ import annotations

import re
from typing import Any, Optional

from areal_pipeline.data.datasets import ARITHMETIC_OPERATORS
from areal_pipeline.rewards.math import math_reward

QUESTION = re.compile(r"What is (-?\d+)\s*([+\-*])\s*(-?\d+)\?")


def score(messages: list[dict[str, Any]], completion: str) -> Optional[float]:
    asked = [m.get("content") for m in messages if m.get("role") == "user" and isinstance(m.get("content"), str)]
    found = QUESTION.search(asked[-1]) if asked else None
    if found is None:
        return None
    a, op, b = int(found.group(1)), found.group(2), int(found.group(3))
    return math_reward(completion, str(ARITHMETIC_OPERATORS[op](a, b)))
