"""Rewards for open-domain QA: token F1 and exact match after SQuAD's answer normalisation.

Both take the best score over the reference answers (a question may accept several). As in the HotpotQA
evaluation script, yes/no answers get no partial credit: "yes" against "no" is 0, not a word overlap.
"""

from __future__ import annotations

import re
import string
from collections import Counter

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)
_NO_PARTIAL_CREDIT = {"yes", "no", "noanswer"}


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _references(references: str | list[str]) -> list[str]:
    refs = [references] if isinstance(references, str) else list(references)
    if not refs:
        raise ValueError("at least one reference answer is needed")
    return refs


def _f1(prediction: str, reference: str) -> float:
    pred, ref = normalize_answer(prediction), normalize_answer(reference)
    if (pred in _NO_PARTIAL_CREDIT or ref in _NO_PARTIAL_CREDIT) and pred != ref:
        return 0.0
    common = Counter(pred.split()) & Counter(ref.split())
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(pred.split()), overlap / len(ref.split())
    return 2 * precision * recall / (precision + recall)


def f1_reward(prediction: str, references: str | list[str]) -> float:
    """Token-level F1 of the prediction against the closest reference, in [0, 1]."""
    return max(_f1(prediction, ref) for ref in _references(references))


def exact_match_reward(prediction: str, references: str | list[str]) -> float:
    """1.0 if the normalised prediction equals a normalised reference, else 0.0."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(ref) for ref in _references(references)))
