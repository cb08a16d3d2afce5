"""What a rollout workflow sends to an inference engine and what it gets back (AReaL's shapes)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from areal_pipeline.config import GenerationConfig


@dataclass
class ModelRequest:
    """One sample to generate. `gconfig.n_samples` is ignored: a group is sampled by sending several requests.

    `rid` names the trajectory; every turn of a multi-turn episode should reuse it, so they land on the same
    server and reuse its prefix cache. `extra_sampling_params` go to the server as they are (e.g.
    `{"ignore_eos": True}`), after the ones built from `gconfig`.
    """

    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    input_ids: list[int] = field(default_factory=list)
    gconfig: GenerationConfig = field(default_factory=GenerationConfig)
    metadata: dict[str, Any] = field(default_factory=dict)
    extra_sampling_params: dict[str, Any] = field(default_factory=dict)


@dataclass
class ModelResponse:
    """A finished generation. `output_versions[i]` is the policy version that produced `output_tokens[i]`.

    `stop_reason` is "stop" (EOS or a stop token/string) or "length"; an interruption that used up the whole
    budget is reported as "length". `server` is the address that served it.
    """

    input_tokens: list[int]
    output_tokens: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    stop_reason: str
    latency: float
    ttft: Optional[float] = None
    server: str = ""

    @property
    def input_len(self) -> int:
        return len(self.input_tokens)

    @property
    def output_len(self) -> int:
        return len(self.output_tokens)
