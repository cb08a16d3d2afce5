"""One agent episode as the trainer sees it: the exact token sequence the model was conditioned on."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        for name in ("loss_mask", "logprobs", "versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"trajectory {self.prompt_id}/{self.sample_idx}: {name} has {len(getattr(self, name))} "
                    f"entries for {n} tokens"
                )

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)
