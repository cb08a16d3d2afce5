"""The gate of a firing: is the candidate better than the champion on the same held-out prompts?

Both policies answer every gate prompt greedily, once; each prompt then gives a pair of rewards (champion's,
candidate's), and the test is over those pairs, so the prompts' own difficulty cancels out:

    bootstrap   d_i = candidate_i - champion_i; the prompts are resampled with replacement B times (seeded) and
                p = (1 + #{b: mean(d*_b) <= m}) / (B + 1), one-sided, for H0: mean(d) <= m (m = min_improvement)
    mcnemar     pass@1 (a reward >= 1 passes): b = prompts only the candidate passes, c = only the champion;
                p = P(X >= b) for X ~ Binomial(b + c, 1/2), McNemar's exact one-sided test of "the candidate
                passes more often"

The candidate is promoted only if its improvement (mean d, or (b - c) / n) is at least `min_improvement` and
p <= 1 - confidence.
"""

from __future__ import annotations

import math
from typing import Any, Mapping


class GateError(ValueError):
    pass


def paired_differences(champion: Mapping[str, float], candidate: Mapping[str, float]) -> list[float]:
    """candidate - champion, prompt by prompt, in the prompts' order (both must have scored the same prompts)."""
    if set(champion) != set(candidate):
        missing = sorted(set(champion) ^ set(candidate))[:5]
        raise GateError(f"the two policies were not scored on the same prompts (e.g. {missing})")
    if not champion:
        raise GateError("the gate has no prompts")
    return [float(candidate[p]) - float(champion[p]) for p in sorted(champion)]


def bootstrap_p_value(differences: list[float], min_improvement: float, resamples: int, seed: int) -> float:
    """One-sided paired bootstrap: the share of resampled mean differences at or below `min_improvement`,
    counted with the observed set as one more resample (so p is never 0)."""
    import numpy as np

    d = np.asarray(differences, dtype=np.float64)
    rng = np.random.default_rng(seed)
    below = 0
    for start in range(0, resamples, 1000):  # bounded memory whatever the number of prompts
        rows = min(1000, resamples - start)
        means = d[rng.integers(0, len(d), size=(rows, len(d)))].mean(axis=1)
        below += int((means <= min_improvement + 1e-12).sum())
    return (1 + below) / (resamples + 1)


def bootstrap_lower_bound(differences: list[float], confidence: float, resamples: int, seed: int) -> float:
    """The (1 - confidence) quantile of the resampled mean differences: the one-sided lower confidence bound."""
    import numpy as np

    d = np.asarray(differences, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = np.concatenate([d[rng.integers(0, len(d), size=(min(1000, resamples - s), len(d)))].mean(axis=1)
                            for s in range(0, resamples, 1000)])
    return float(np.quantile(means, 1 - confidence))


def mcnemar_p_value(only_candidate: int, only_champion: int) -> float:
    """McNemar's exact one-sided test: P(X >= b) for X ~ Binomial(b + c, 1/2); 1 when no prompt differs."""
    b, n = only_candidate, only_candidate + only_champion
    if n == 0:
        return 1.0
    return sum(math.comb(n, k) for k in range(b, n + 1)) / 2 ** n


def passes(reward: float) -> bool:
    return reward >= 1.0


def summary(rewards: Mapping[str, float]) -> dict[str, float]:
    n = max(1, len(rewards))
    return {"prompts": len(rewards), "mean_reward": sum(rewards.values()) / n,
            "pass_at_1": sum(passes(r) for r in rewards.values()) / n}


def decide(champion: Mapping[str, float], candidate: Mapping[str, float], *, test: str, min_improvement: float,
           confidence: float, resamples: int = 10000, seed: int = 0) -> dict[str, Any]:
    """The gate's figures and decision (`passed`, with the `reason` in words) for per-prompt rewards."""
    differences = paired_differences(champion, candidate)
    n = len(differences)
    record: dict[str, Any] = {"test": test, "prompts": n, "champion": summary(champion),
                              "candidate": summary(candidate), "min_improvement": min_improvement,
                              "confidence": confidence}
    if test == "mcnemar":
        only_candidate = sum(passes(candidate[p]) and not passes(champion[p]) for p in champion)
        only_champion = sum(passes(champion[p]) and not passes(candidate[p]) for p in champion)
        improvement = (only_candidate - only_champion) / n
        p_value = mcnemar_p_value(only_candidate, only_champion)
        record.update(metric="pass_at_1", only_candidate=only_candidate, only_champion=only_champion)
    elif test == "bootstrap":
        improvement = sum(differences) / n
        p_value = bootstrap_p_value(differences, min_improvement, resamples, seed)
        record.update(metric="mean_reward", resamples=resamples,
                      lower_bound=bootstrap_lower_bound(differences, confidence, resamples, seed))
    else:
        raise GateError(f"unknown gate test {test!r}: bootstrap or mcnemar")
    alpha = 1 - confidence
    passed = improvement >= min_improvement and p_value <= alpha + 1e-12
    if passed:
        reason = (f"the candidate is better by {improvement:+.3f} {record['metric']} (>= {min_improvement}), "
                  f"p = {p_value:.3g} <= {alpha:.3g}")
    elif improvement < min_improvement:
        reason = f"the candidate's improvement {improvement:+.3f} {record['metric']} is below {min_improvement}"
    else:
        reason = (f"the candidate's improvement {improvement:+.3f} {record['metric']} is not significant: "
                  f"p = {p_value:.3g} > {alpha:.3g}")
    record.update(improvement=improvement, p_value=p_value, passed=passed, reason=reason)
    return record
