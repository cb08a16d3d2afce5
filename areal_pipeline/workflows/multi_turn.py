"""Multi-turn answering with feedback and per-turn rewards (AReaL's multi-turn math agent).

Each turn the environment checks the answer (the reward function on that turn's text); while it is
wrong and turns remain (`agent.max_turns`) it says so as a user message (`agent.wrong_message`) and the model
answers again. A right answer ends the episode; with `agent.stop_on_success=false` the episode always runs
`max_turns` turns, a right answer answered by `agent.correct_message`, as AReaL's MathMultiTurnAgent does.
Turn t earns `r_t = ((success_t - 0.5) * 2 - agent.reward_bias) * agent.reward_scaling`, and its tokens
are trained with the discounted return `G_t = r_t + agent.turn_level_discount * G_{t+1}`: the workflow
writes G_t on each turn's tokens as the trajectory's `token_returns`, which the advantages step uses in
place of the trajectory reward (then normalises per `ppo.adv_norm`).

`Trajectory.reward` is for curves and pass@1: 1 if some turn was right, times `turn_level_discount` per
turn before the first right one. Every turn's answer, success, reward, return and policy version stay in the
trajectory's `metadata["turns"]`, so `per_version_log(run_dir)` reads them back from the run's shards and
`write_answer_logs` writes them as MathMultiTurnAgent's per-version answer files (`areal-pipeline answers`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterator

from areal_pipeline.config import at_least, within
from areal_pipeline.data.trajectory import NO_VERSION, Trajectory
from areal_pipeline.utils import atomic_write_text
from areal_pipeline.workflows.turns import FeedbackTurnsWorkflow, Outcome

if TYPE_CHECKING:
    from areal_pipeline.config import GenerationConfig
    from areal_pipeline.rewards.pool import RewardPool

# MathMultiTurnAgent's feedback
CORRECT_MESSAGE = "Congratulations! You are correct!"
WRONG_MESSAGE = "Unfortunately your answer is wrong. Let's try again."


def discounted_returns(rewards: list[float], discount: float) -> list[float]:
    """G_t = r_t + discount * G_{t+1}, with G = 0 after the last turn."""
    returns, following = [], 0.0
    for r in reversed(rewards):
        following = r + discount * following
        returns.append(following)
    return returns[::-1]


@dataclass
class MultiTurnConfig:
    """rollout.agent of rollout.workflow=multi_turn."""

    # multi_turn: model turns per episode at most
    max_turns: int = 2
    # multi_turn: per-turn rewards discounted backwards over turns, G_t = r_t + turn_level_discount * G_{t+1}
    turn_level_discount: float = 0.9
    # multi_turn per-turn reward: ((success - 0.5) * 2 - reward_bias) * reward_scaling
    reward_bias: float = 0.0
    # multi_turn per-turn reward: ((success - 0.5) * 2 - reward_bias) * reward_scaling
    reward_scaling: float = 1.0
    # multi_turn: the user message after a wrong answer (MathMultiTurnAgent's)
    wrong_message: str = WRONG_MESSAGE
    # multi_turn: the user message after a right answer, when the episode goes on (stop_on_success=false)
    correct_message: str = CORRECT_MESSAGE
    # multi_turn: whether a right answer ends the episode (false: always max_turns turns, as MathMultiTurnAgent runs
    # num_turns)
    stop_on_success: bool = True

    field_rules: ClassVar[dict] = {"max_turns": at_least(1), "turn_level_discount": within(0, 1)}


class MultiTurnWorkflow(FeedbackTurnsWorkflow):
    config_class = MultiTurnConfig
    reward_function = "areal_pipeline.rewards.math:math_reward"
    tools = ()

    def __init__(self, reward_fn: Callable[[str, Any], float], gconfig: "GenerationConfig", tokenizer,
                 reward_pool: "RewardPool", max_turns: int = 2, turn_level_discount: float = 0.9,
                 reward_bias: float = 0.0, reward_scaling: float = 1.0, correct_message: str = CORRECT_MESSAGE,
                 wrong_message: str = WRONG_MESSAGE, stop_on_success: bool = True):
        super().__init__(reward_fn, gconfig, tokenizer, reward_pool, max_turns, (wrong_message, correct_message))
        self.wrong_message, self.correct_message = wrong_message, correct_message
        self.message_ids = self.feedback_ids[wrong_message]
        self.correct_ids = self.feedback_ids[correct_message]
        self.stop_on_success = stop_on_success
        self.discount = turn_level_discount
        self.reward_bias = reward_bias
        self.reward_scaling = reward_scaling

    @classmethod
    def config_problems(cls, cfg, key) -> Iterator[str]:
        """Its trajectories carry per-turn returns, which one group score per trajectory cannot replace."""
        if cfg.rollout.group_reward:
            yield (f"{key('rollout.group_reward')}={cfg.rollout.group_reward}: the multi_turn workflow's per-turn "
                   "returns (token_returns) would ignore the judge's score; use a workflow with one reward per "
                   "trajectory")

    @classmethod
    def from_config(cls, cfg, tokenizer, reward_pool, *, reward_fn, tool_addresses) -> "MultiTurnWorkflow":
        agent: MultiTurnConfig = cfg.rollout.agent
        return cls(reward_fn, cfg.rollout.gconfig, tokenizer, reward_pool, max_turns=agent.max_turns,
                   turn_level_discount=agent.turn_level_discount, reward_bias=agent.reward_bias,
                   reward_scaling=agent.reward_scaling, wrong_message=agent.wrong_message,
                   correct_message=agent.correct_message, stop_on_success=agent.stop_on_success)

    def turn_reward(self, success: bool) -> float:
        return ((float(success) - 0.5) * 2 - self.reward_bias) * self.reward_scaling

    def feedback(self, turn: dict[str, Any]) -> str:
        return self.correct_message if turn["success"] else self.wrong_message

    def turn_fields(self, score: float) -> dict[str, Any]:
        success = score > 0
        return {"success": success, "reward": self.turn_reward(success)}

    def ends(self, turn: dict[str, Any]) -> bool:
        return turn["success"] and self.stop_on_success

    def outcome(self, turns: list[dict[str, Any]]) -> Outcome:
        returns = discounted_returns([t["reward"] for t in turns], self.discount)
        for record, value in zip(turns, returns):
            record["return"] = value
        first_right = next((i for i, t in enumerate(turns) if t["success"]), None)
        return Outcome(0.0 if first_right is None else self.discount ** first_right,
                       {"first_turn_correct": turns[0]["success"], "success": first_right is not None,
                        "num_turns": len(turns), "return": returns[0]},
                       turn_returns=returns)


def per_version_log(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every model turn of every finished rollout of a run, oldest policy version first.

    One row per turn: iteration, version (the policy version that began the turn; version_end where an
    update landed mid-turn), prompt_id, sample_idx, turn, answer (the turn's text) and whatever the
    workflow recorded for it (reward; success and return for multi_turn). Single-turn trajectories
    (rlvr) give one row each, with the trajectory's reward.
    """
    rows = []
    for iteration, t in _finished_trajectories(run_dir):
        for i, turn in enumerate(_turns(t)):
            extra = {k: v for k, v in turn.items() if k not in ("text", "version_start", "version_end")}
            rows.append({"iteration": iteration, "version": turn["version_start"],
                         "version_end": turn["version_end"], "prompt_id": t.prompt_id,
                         "sample_idx": t.sample_idx, "turn": i, "answer": turn["text"], **extra})
    return sorted(rows, key=lambda r: (r["version"], r["iteration"], r["prompt_id"], r["sample_idx"], r["turn"]))


def write_answer_logs(run_dir: str | Path, out: str | Path) -> list[Path]:
    """The run's answers as AReaL's MathMultiTurnAgent logs them, one directory per policy version (the version
    that began the turn): `out/<version>/<prompt_id>.txt` gets three lines per model turn ("idx: i / n, seqlen: L,
    head version: a, tail version: b." / "reward is r, prompt is ..." / "sequence is: <answer>.") and
    `out/<version>/<prompt_id>.jsonl` one object per turn (version_start, version_end, success, prompt_len,
    answer_len). Episodes in order of iteration, prompt and sample; files are written whole (a second call
    rewrites them). Returns the files written."""
    texts: dict[Path, list[str]] = {}
    lines: dict[Path, list[str]] = {}
    for _, t in sorted(_finished_trajectories(run_dir), key=lambda it: (it[0], it[1].prompt_id, it[1].sample_idx)):
        turns = _turns(t)
        first = turns[0]
        prompt_len = first["seqlen"] - first["num_tokens"] if "seqlen" in first else t.loss_mask.index(1)
        answered = [i for i, m in enumerate(t.messages) if m["role"] == "assistant"]
        prompt = "\n".join(m["content"] for m in t.messages[: answered[0] if answered else None])
        for i, turn in enumerate(turns):
            # the search agent scores only its episode: its last turn shows the episode's reward
            reward = turn.get("reward", t.reward if i == len(turns) - 1 else 0.0)
            seqlen = turn.get("seqlen", len(t.input_ids))
            base = Path(out) / str(turn["version_start"]) / t.prompt_id.replace("/", "_")
            texts.setdefault(base.parent / f"{base.name}.txt", []).append(
                f"idx: {i + 1} / {len(turns)}, seqlen: {seqlen}, head version: {turn['version_start']}, "
                f"tail version: {turn['version_end']}.\nreward is {reward}, prompt is {prompt}\n"
                f"sequence is: {turn['text']}.\n")
            success = turn.get("success", reward > 0)
            lines.setdefault(base.parent / f"{base.name}.jsonl", []).append(json.dumps(
                {"version_start": turn["version_start"], "version_end": turn["version_end"], "success": bool(success),
                 "prompt_len": prompt_len, "answer_len": seqlen - prompt_len}) + "\n")
    for path, parts in [*texts.items(), *lines.items()]:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, "".join(parts))
    return sorted([*texts, *lines])


def _finished_trajectories(run_dir: str | Path) -> Iterator[tuple[int, Trajectory]]:
    """(iteration, trajectory) of every rollout of the run that finished (its manifest written)."""
    from areal_pipeline.data.shards import is_complete, read_trajectories  # pyarrow: only for reading runs back

    for rollout in sorted(Path(run_dir).glob("iter_*/rollout"), key=lambda p: int(p.parent.name.split("_")[1])):
        if is_complete(rollout):
            iteration = int(rollout.parent.name.split("_")[1])
            yield from ((iteration, t) for t in read_trajectories(rollout))


def _turns(t: Trajectory) -> list[dict[str, Any]]:
    return t.metadata.get("turns") or [_single_turn(t)]


def _single_turn(t: Trajectory) -> dict[str, Any]:
    versions = [v for v, m in zip(t.versions, t.loss_mask) if m] or [NO_VERSION]
    return {"text": t.text, "reward": t.reward, "num_tokens": t.num_generated, "seqlen": len(t.input_ids),
            "stop_reason": t.stop_reason, "version_start": min(versions), "version_end": max(versions)}
