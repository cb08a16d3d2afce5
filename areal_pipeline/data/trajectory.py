"""One agent episode as the trainer sees it: the exact token sequence the model was conditioned on."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

# Version recorded for tokens the policy did not produce (prompt, tool output).
NO_VERSION = -1


@dataclass
class Trajectory:
    prompt_id: str
    group_id: str
    sample_idx: int
    # prompt + every later token, in order: model turns, and for agents the environment's turns
    input_ids: list[int]
    # 1 exactly on model-generated tokens
    loss_mask: list[int]
    # behaviour logprob of each generated token (0.0 elsewhere)
    logprobs: list[float]
    # policy version that produced each token (NO_VERSION elsewhere)
    versions: list[int]
    reward: float
    num_turns: int = 1
    stop_reason: str = ""
    # for humans: the chat so far and the decoded sequence
    messages: list[dict[str, str]] = field(default_factory=list)
    text: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    # Per-token returns set by the workflow itself (multi_turn's discounted per-turn rewards). When present the
    # advantage uses them before normalisation instead of spreading `reward` over the tokens; None for the usual
    # one-reward-per-trajectory case.
    token_returns: Optional[list[float]] = None
    # The reward of the prompt's baseline episode, set by the rollout where the advantage asks for one (ReMax's
    # greedy completion: `advantage_registry.Advantage.greedy_baseline`); None otherwise.
    baseline_reward: Optional[float] = None
    # Per-token step records of a multi-step environment, for step-level credit (GiGPO, training/gigpo.py): on each
    # token of a model turn, an integer key of the environment state the turn acted from (`gigpo.anchor_key`), -1
    # elsewhere, and the reward the environment gave that turn, 0 elsewhere. None where the workflow records none.
    step_states: Optional[list[int]] = None
    step_rewards: Optional[list[float]] = None

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        names = ["loss_mask", "logprobs", "versions"] + [
            name for name in ("token_returns", "step_states", "step_rewards") if getattr(self, name) is not None]
        for name in names:
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"trajectory {self.prompt_id}/{self.sample_idx}: {name} has {len(getattr(self, name))} "
                    f"entries for {n} tokens"
                )

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)


class SequenceBuilder:
    """Grows one episode's token sequence turn by turn.

    The sequence is only ever appended to, with the prompt ids, each model turn's output tokens exactly
    as generated, and the environment's ids, so the next request is sent `input_ids` and the trained
    sequence is exactly what the model was conditioned on (no re-tokenization of the conversation).
    """

    def __init__(self, prompt_ids: list[int]):
        self.input_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        # [start, end) of each model turn in input_ids
        self.turn_spans: list[tuple[int, int]] = []
        self.add_environment(prompt_ids)
        self.prompt_len = len(prompt_ids)

    def __len__(self) -> int:
        return len(self.input_ids)

    def add_environment(self, ids: list[int]) -> None:
        self.input_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [NO_VERSION] * len(ids)

    def add_model_turn(self, resp) -> None:
        """Append a generation (a `ModelResponse`), which must have been conditioned on the sequence so far."""
        if resp.input_tokens != self.input_ids:
            raise ValueError("the generation was conditioned on a different sequence than the episode's so far")
        start = len(self.input_ids)
        self.input_ids += resp.output_tokens
        self.loss_mask += [1] * resp.output_len
        self.logprobs += resp.output_logprobs
        self.versions += resp.output_versions
        self.turn_spans.append((start, len(self.input_ids)))

    def turn_returns(self, returns: list[float]) -> list[float]:
        """Per-token returns: each model turn's tokens get that turn's return, every other token 0."""
        if len(returns) != len(self.turn_spans):
            raise ValueError(f"{len(returns)} returns for {len(self.turn_spans)} model turns")
        out = [0.0] * len(self.input_ids)
        for (start, end), value in zip(self.turn_spans, returns):
            out[start:end] = [float(value)] * (end - start)
        return out

    def trajectory(self, **fields: Any) -> Trajectory:
        return Trajectory(input_ids=list(self.input_ids), loss_mask=list(self.loss_mask),
                          logprobs=list(self.logprobs), versions=list(self.versions),
                          num_turns=len(self.turn_spans), **fields)
