"""What a firing trains on from the line's recorded traffic (docs/online.md): the samples its servers recorded
(online/traffic_log.py) that have a reward now and that no earlier firing took, as episodes of the candidate's
iterations.

    samples  = the recorded chat completions, one per choice (sample_id), not taken by an earlier firing
    reward   = the newest feedback naming the sample's response, else the newest naming its conversation
    waiting  = no reward yet and younger than recurring.feedback_window: left for a later firing (never a 0)
    expired  = no reward and older than that: taken (never trained), counted
    stale    = generated more than recurring.max_staleness versions before the champion: taken, counted
    gate     = asking one of the gate's held-out questions: taken, counted, never trained

The rewarded samples become trajectories exactly as they were sampled: the prompt's and the completion's token ids,
the completion's behaviour logprobs and the policy version of each token; the decoupled loss weighs them by the
proximal policy over the behaviour one. Samples of the same prompt, token for token, that number at least
`recurring.traffic_min_group` form a group (GRPO: the group's mean reward is each one's baseline). The others
have no group of their own: each iteration's share of them is one pooled group, so that the pool's mean reward is
the baseline, which is REINFORCE with a batch baseline: the baseline does not depend on any one sample's own
action more than through its 1/N share of the mean, so the gradient keeps its sign and is unbiased as N grows
(GRPO's groups have the same 1/n share).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Optional

from areal_pipeline.data.trajectory import NO_VERSION, Trajectory

POOL = "traffic:pool"


@dataclass
class TrafficWindow:
    iterations: list[list[Trajectory]]  # the rewarded samples, as the episodes of each traffic iteration
    taken: dict[str, str]  # sample_id -> trained | expired | stale | gate: what this firing takes for good
    counts: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def record(self) -> dict[str, Any]:
        return {**self.counts, "iterations": len(self.iterations), "problems": self.problems}


def rewards_by_sample(samples: list[dict[str, Any]], feedback: list[dict[str, Any]],
                      scored: Optional[dict[str, float]] = None) -> tuple[dict[str, float], int]:
    """(sample_id -> its reward, how many feedback records name no recorded sample). The newest feedback of a
    response wins over older ones, a response's own over its conversation's, and any feedback over `scored` (the
    rewards a function gave the samples when the firing collected them)."""
    by_response: dict[str, float] = {}
    by_conversation: dict[str, float] = {}
    for record in sorted(feedback, key=lambda f: (f["received_at"], f["feedback_id"])):
        if record.get("response_id"):
            by_response[record["response_id"]] = float(record["reward"])
        elif record.get("conversation_id"):
            by_conversation[record["conversation_id"]] = float(record["reward"])
    responses = {s["response_id"] for s in samples}
    conversations = {s["conversation_id"] for s in samples}
    orphans = sum(1 for r in by_response if r not in responses) + sum(
        1 for c in by_conversation if c not in conversations)
    rewards = {sid: float(reward) for sid, reward in (scored or {}).items()}
    for sample in samples:
        if sample["response_id"] in by_response:
            rewards[sample["sample_id"]] = by_response[sample["response_id"]]
        elif sample["conversation_id"] in by_conversation:
            rewards[sample["sample_id"]] = by_conversation[sample["conversation_id"]]
    return rewards, orphans


def last_user_message(sample: dict[str, Any]) -> str:
    try:
        messages = json.loads(sample["messages"])
    except (TypeError, ValueError):
        return ""
    users = [m.get("content") for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    return str(users[-1]).strip() if users and isinstance(users[-1], str) else ""


def sample_trajectory(sample: dict[str, Any], reward: float, group_id: str) -> Trajectory:
    """A recorded sample as the trainer takes an episode: what the server computed, token for token."""
    prompt, completion = list(sample["prompt_ids"]), list(sample["completion_ids"])
    try:
        messages = [*json.loads(sample["messages"]), json.loads(sample["reply"])]
    except (TypeError, ValueError):
        messages = []
    return Trajectory(
        prompt_id=sample["sample_id"], group_id=group_id, sample_idx=int(sample["choice"]),
        input_ids=prompt + completion, loss_mask=[0] * len(prompt) + [1] * len(completion),
        logprobs=[0.0] * len(prompt) + [float(x) for x in sample["logprobs"]],
        versions=[NO_VERSION] * len(prompt) + [int(v) for v in sample["versions"]],
        reward=float(reward), num_turns=1, stop_reason=sample.get("finish_reason") or "",
        messages=messages,
        metadata={"source": "traffic", "response_id": sample["response_id"],
                  "conversation_id": sample["conversation_id"], "server": sample.get("server", ""),
                  # a string: a number in an episode's metadata is reported as a workflow's fact (agent/<key>)
                  "recorded_at": datetime.fromtimestamp(float(sample["created_at"]), timezone.utc).isoformat()})


def asks_a_gate_question(message: str, gate_questions: set[str]) -> bool:
    """Whether a user's message is one of the gate's questions, alone or with an instruction before or after it (as a
    data set words a prompt: "What is 3+4? Answer with the number.")."""
    return message in gate_questions or any(
        message.startswith(q + " ") or message.endswith(" " + q) or f" {q} " in message for q in gate_questions if q)


def reply_text(sample: dict[str, Any]) -> str:
    try:
        content = json.loads(sample["reply"]).get("content")
    except (TypeError, ValueError, AttributeError):
        return ""
    return content if isinstance(content, str) else ""


def score_samples(samples: list[dict[str, Any]], reward_fn, skip: set[str]) -> dict[str, float]:
    """`reward_fn(messages, completion)` of each sample not in `skip`: its reward where the function returns a
    finite number; a sample it returns None for has no reward yet. Anything else names the sample."""
    scored = {}
    for sample in samples:
        if sample["sample_id"] in skip:
            continue
        reward = reward_fn(json.loads(sample["messages"]), reply_text(sample))
        if reward is None:
            continue
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise ValueError(f"recurring.traffic_reward returned {reward!r} for sample {sample['sample_id']}: "
                             "must be a finite number, or None where it cannot tell yet")
        scored[sample["sample_id"]] = float(reward)
    return scored


def _oldest_version(sample: dict[str, Any]) -> int:
    versions = [int(v) for v in sample["versions"] if int(v) >= 0]
    return min(versions) if versions else int(sample.get("version", 0))


def take_traffic(samples: list[dict[str, Any]], feedback: list[dict[str, Any]], taken_before: set[str], *,
                 now: float, champion_version: int, feedback_window: float, max_staleness: int, min_group: int,
                 gate_questions: set[str], episodes_per_iteration: int, max_episodes: Optional[int] = None,
                 problems: Iterable[str] = (), scored: Optional[dict[str, float]] = None) -> TrafficWindow:
    """The firing's traffic: every recorded sample not in `taken_before`, judged as the module says (`scored`: the
    rewards of a function, for samples without feedback); at most
    `max_episodes` rewarded ones trained (None: all; whole groups, oldest first; the rest wait), in iterations of
    about `episodes_per_iteration` episodes."""
    rewards, orphans = rewards_by_sample(samples, feedback, scored)
    taken: dict[str, str] = {}
    counts = {"recorded": len(samples), "new": 0, "rewarded": 0, "waiting": 0, "expired": 0, "stale": 0,
              "gate_overlap": 0, "orphan_feedback": orphans, "deferred": 0, "trained": 0}
    ready: list[dict[str, Any]] = []
    for sample in samples:
        sid = sample["sample_id"]
        if sid in taken_before:
            continue
        counts["new"] += 1
        if asks_a_gate_question(last_user_message(sample), gate_questions):
            taken[sid] = "gate"
        elif sid not in rewards:
            if now - float(sample["created_at"]) > feedback_window:
                taken[sid] = "expired"
            else:
                counts["waiting"] += 1
        elif champion_version - _oldest_version(sample) > max_staleness:
            taken[sid] = "stale"
        elif not all(math.isfinite(x) for x in sample["logprobs"]) or not sample["completion_ids"]:
            taken[sid] = "unusable"
        else:
            ready.append(sample)
    counts["rewarded"] = len(ready)
    for status in ("expired", "stale", "gate", "unusable"):
        counts["gate_overlap" if status == "gate" else status] = sum(1 for s in taken.values() if s == status)

    by_prompt: dict[str, list[dict[str, Any]]] = {}
    for sample in sorted(ready, key=lambda s: (float(s["created_at"]), s["sample_id"])):
        by_prompt.setdefault(sample["prompt_sha256"], []).append(sample)
    units: list[list[dict[str, Any]]] = []  # a group whole, or one sample of the pool
    for members in by_prompt.values():
        if len(members) >= min_group:
            units.append(members)
        else:
            units.extend([member] for member in members)
    chosen: list[list[dict[str, Any]]] = []
    total = 0
    for unit in units:  # oldest first: by_prompt keeps the order of each prompt's first sample
        if max_episodes is not None and total + len(unit) > max_episodes:
            counts["deferred"] += len(unit)
            continue
        chosen.append(unit)
        total += len(unit)

    n_iterations = math.ceil(total / max(1, episodes_per_iteration)) if total else 0
    iterations: list[list[Trajectory]] = [[] for _ in range(n_iterations)]
    sizes = [0] * n_iterations
    for unit in chosen:
        j = sizes.index(min(sizes))  # the emptiest iteration (the first of equals): balanced, deterministic
        group = f"traffic:{unit[0]['prompt_sha256'][:16]}" if len(unit) >= min_group else f"{POOL}-{j + 1}"
        for sample in unit:
            iterations[j].append(sample_trajectory(sample, rewards[sample["sample_id"]], group))
            taken[sample["sample_id"]] = "trained"
        sizes[j] += len(unit)
    counts["trained"] = total
    return TrafficWindow(iterations, taken, counts, list(problems))
