"""Binary reward for math answers (GSM8K `#### N` references, MATH-style `\\boxed{}` answers).

Plain numbers are compared exactly with `Fraction` (fast, and the common GSM8K case); anything
else goes to math-verify. math-verify's own timeouts use `signal.alarm`, which only works in the
main thread, so they are disabled here: run this under `RewardPool`, which enforces a timeout.
"""

from __future__ import annotations

import logging
import re
from fractions import Fraction

from math_verify import parse, verify

# With its timeouts off, math-verify warns so in every fresh worker process; those timeout
# messages are all these two loggers ever warn about.
for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).setLevel(logging.ERROR)

_HASHES = re.compile(r"####\s*([^\n]*)")
_ANSWER_IS = re.compile(r"answer\s+is\s*:?\s*(.+?)\s*(?:\.(?:\s|$)|\n|$)", re.IGNORECASE)
_NUMBER = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+"
# A minus sign right after a digit or ")" is subtraction ("10-5"), not a negative number.
_LAST_NUMBER = re.compile(rf"(?:(?<![\w)])-)?(?:{_NUMBER})(?:/\d+)?")
# A number, optionally a fraction or a percentage, then optional unit words ("18 dollars").
# Units need a space first so that "5x" stays algebra.
_PLAIN = re.compile(
    rf"(-?(?:{_NUMBER}))(?:\s*/\s*({_NUMBER}))?\s*(%|percent)?(?:\s+[a-z][a-z\s]*)?", re.IGNORECASE
)
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
# Dollar signs, math delimiters and LaTeX thin spaces ("1\,000").
_DROP = re.compile(r"\\?\$|\\[,!]")


def _last_boxed(text: str) -> str | None:
    """Content of the last complete `\\boxed{...}` (or `\\fbox`), braces balanced."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for start in reversed(starts):  # a truncated generation may leave the last box unclosed
        depth = 1
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
    return None


def extract_answer(text: str) -> str | None:
    """Final answer of a completion: last `\\boxed{}`, else `#### x`, else "the answer is x",
    else the last number; None if there is none."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    for pattern in (_HASHES, _ANSWER_IS):
        matches = pattern.findall(text)
        if matches and matches[-1].strip():
            return matches[-1].strip()
    numbers = _LAST_NUMBER.findall(text)
    return numbers[-1] if numbers else None


def extract_reference(reference: str) -> str:
    """The answer part of a reference: after the last `####` (GSM8K solution), else the last
    `\\boxed{}` (MATH solution), else the whole string."""
    hashes = _HASHES.findall(reference)
    if hashes and hashes[-1].strip():
        return hashes[-1].strip()
    boxed = _last_boxed(reference)
    return boxed if boxed is not None else reference.strip()


def _numeric_values(answer: str) -> set[Fraction] | None:
    """Values a plain-number answer may mean ("50%" is 50 or 0.5), or None if it is not one."""
    s = _DROP.sub("", _TEXT_WRAPPER.sub(r"\1", answer)).replace("\\%", "%")
    match = _PLAIN.fullmatch(s.strip().rstrip("."))
    if match is None:
        return None
    numerator, denominator, percent = match.groups()
    try:
        value = Fraction(numerator.replace(",", ""))
        if denominator is not None:
            value /= Fraction(denominator.replace(",", ""))
    except ZeroDivisionError:
        return None
    return {value, value / 100} if percent else {value}


def _as_latex(answer: str) -> str:
    # math-verify's LaTeX extractor only looks inside math delimiters or \boxed.
    return answer if "$" in answer or "\\(" in answer or "\\[" in answer else f"${answer}$"


def _symbolically_equal(answer: str, gold: str) -> bool:
    gold_parsed = parse(_as_latex(gold), parsing_timeout=None)
    answer_parsed = parse(_as_latex(answer), parsing_timeout=None)
    return verify(gold_parsed, answer_parsed, timeout_seconds=None)


def math_reward(completion: str, reference: str) -> float:
    """1.0 if the completion's final answer equals the reference answer, else 0.0."""
    answer = extract_answer(completion)
    if answer is None:
        return 0.0
    gold = extract_reference(reference)
    answer_values, gold_values = _numeric_values(answer), _numeric_values(gold)
    if answer_values is not None and gold_values is not None:
        return float(bool(answer_values & gold_values))
    return float(_symbolically_equal(answer, gold))
