"""What a rollout workflow sends to an inference engine and what it gets back (AReaL's shapes), and the one type
of sampling parameters from the workflow to the server.

    sampling = SamplingParams.from_config(cfg.rollout.gconfig)          # once, in the workflow
    req = ModelRequest(input_ids=ids, sampling=dataclasses.replace(sampling, sampling_seed=7))
    sampling.sglang()         # SGLang's `sampling_params` for /generate (the client's wire form)
    sampling.vllm(seeded)     # vLLM's fields for /inference/v1/generate
    SamplingParams.from_json(body["sampling_params"])  # the CPU server's parse, with its checks
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from areal_pipeline.http_json import RequestRejected, check_bool, check_int, check_number, shown

GREEDY_TEMPERATURE = 1e-6
# SGLang's fields that the CPU server takes only at their neutral value: RL rollouts never change them, and silently
# ignoring another value would make logprobs disagree with the trainer.
NEUTRAL_FIELDS = {"n": 1, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                  "min_new_tokens": 0}
# Sent only when they differ from these (SGLang's and vLLM's own defaults), so a plain request's wire form stays
# the six fields every client sends.
_OPTIONAL = {"min_p": 0.0, "ignore_eos": False, "skip_special_tokens": True}
_VLLM_SEED_RANGE = 1 << 63  # vLLM's seed is a signed 64-bit integer; the pipeline's episode seeds may exceed it


@dataclass(frozen=True)
class SamplingParams:
    """One generation's sampling, in SGLang's names. `max_new_tokens` None: up to the end of the context (an
    OpenAI request without max_tokens; the server or client fills it in before generating)."""

    max_new_tokens: Optional[int] = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    sampling_seed: Optional[int] = None

    def __post_init__(self) -> None:
        # lists given (a config's, a JSON body's) are kept as tuples: a frozen value stays what it was when sent
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if isinstance(value, str) and name == "stop":
                object.__setattr__(self, name, (value,))
            elif isinstance(value, list):
                object.__setattr__(self, name, tuple(value))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @classmethod
    def from_config(cls, gconfig: Any) -> "SamplingParams":
        """A workflow's `rollout.gconfig` (config.GenerationConfig, not imported: the configuration sits above
        nothing here; its `n_samples` is the executor's: one request is one sample)."""
        return cls(max_new_tokens=gconfig.max_new_tokens, temperature=0.0 if gconfig.greedy else gconfig.temperature,
                   top_p=gconfig.top_p, top_k=gconfig.top_k, stop=tuple(gconfig.stop),
                   stop_token_ids=tuple(gconfig.stop_token_ids))

    def for_choice(self, choice: int) -> "SamplingParams":
        """Sample `choice` of n of one request: each its own seed (n equal samples help no one)."""
        if self.sampling_seed is None:
            return self
        return dataclasses.replace(self, sampling_seed=(self.sampling_seed + choice) % (1 << 63))

    # ----- wire forms ------------------------------------------------------------------------------
    def sglang(self) -> dict[str, Any]:
        """SGLang's `sampling_params` of a /generate request."""
        if self.max_new_tokens is None:
            raise ValueError("max_new_tokens must be set before a request is sent")
        params: dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                                  "top_p": self.top_p, "top_k": self.top_k, "stop": list(self.stop),
                                  "stop_token_ids": list(self.stop_token_ids)}
        params.update(self._changed_optional())
        if self.sampling_seed is not None:
            params["sampling_seed"] = self.sampling_seed
        return params

    def vllm(self, seeded: bool) -> dict[str, Any]:
        """vLLM's sampling fields (/inference/v1/generate); the seed only when `seeded` (inference.vllm.seeded_sampling:
        vLLM's seeded sampler is slower and differs from its batched one)."""
        if self.max_new_tokens is None:
            raise ValueError("max_new_tokens must be set before a request is sent")
        params: dict[str, Any] = {"max_tokens": self.max_new_tokens, "temperature": self.temperature,
                                  "top_p": self.top_p, "top_k": self.top_k, "stop": list(self.stop),
                                  "stop_token_ids": list(self.stop_token_ids)}
        params.update(self._changed_optional())
        if seeded and self.sampling_seed is not None:
            params["seed"] = self.sampling_seed % _VLLM_SEED_RANGE
        return params

    def _changed_optional(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name, default in _OPTIONAL.items() if getattr(self, name) != default}

    @classmethod
    def from_json(cls, data: Any) -> "SamplingParams":
        """A /generate request's `sampling_params` (SGLang's names; null: the default), checked: RequestRejected
        (HTTP 400) naming the field otherwise."""
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise RequestRejected(f"sampling_params must be a JSON object, got {shown(data)}")
        names = {f.name for f in dataclasses.fields(cls)} | set(NEUTRAL_FIELDS)
        for key in data:
            if key not in names:
                raise RequestRejected(f"unknown field '{key}' in sampling_params; valid: {', '.join(sorted(names))}")
        given = {k: v for k, v in data.items() if v is not None or k == "sampling_seed"}
        value = {f.name: given.get(f.name, f.default) for f in dataclasses.fields(cls)}
        check_int("max_new_tokens", value["max_new_tokens"], minimum=0)
        if check_number("temperature", value["temperature"]) < 0:
            raise RequestRejected(f"'temperature' must be non-negative, got {shown(value['temperature'])}")
        if not 0 < check_number("top_p", value["top_p"]) <= 1:
            raise RequestRejected(f"'top_p' must be in (0, 1], got {shown(value['top_p'])}")
        top_k = value["top_k"]
        if type(top_k) is not int or top_k == 0 or top_k < -1:
            raise RequestRejected(f"'top_k' must be -1 (whole vocabulary) or at least 1, got {shown(top_k)}")
        if not 0 <= check_number("min_p", value["min_p"]) <= 1:
            raise RequestRejected(f"'min_p' must be in [0, 1], got {shown(value['min_p'])}")
        stop = value["stop"]
        stop = [stop] if isinstance(stop, str) else stop
        if not (isinstance(stop, (list, tuple)) and all(type(s) is str and s for s in stop)):
            raise RequestRejected(f"'stop' must be a non-empty string or a list of them, got {shown(stop)}")
        stop_token_ids = value["stop_token_ids"]
        if not (isinstance(stop_token_ids, (list, tuple)) and all(type(t) is int for t in stop_token_ids)):
            raise RequestRejected(f"'stop_token_ids' must be a list of integers, got {shown(stop_token_ids)}")
        check_bool("ignore_eos", value["ignore_eos"])
        check_bool("skip_special_tokens", value["skip_special_tokens"])
        if value["sampling_seed"] is not None:  # the range torch.Generator.manual_seed takes
            check_int("sampling_seed", value["sampling_seed"], minimum=-(1 << 63), maximum=(1 << 64) - 1)
        for name, neutral in NEUTRAL_FIELDS.items():
            given_value = given.get(name, neutral)
            if type(given_value) not in (int, float) or given_value != neutral:
                raise RequestRejected(f"{name}={shown(given_value)} is not supported by the CPU server "
                                      f"(only {neutral!r})")
        return cls(**{**value, "stop": tuple(stop), "stop_token_ids": tuple(stop_token_ids)})


@dataclass
class ModelRequest:
    """One sample to generate (a group is sampled by sending several requests).

    `rid` names the trajectory; every turn of a multi-turn episode should reuse it, so they land on the same
    server and reuse its prefix cache.
    """

    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    input_ids: list[int] = field(default_factory=list)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    metadata: dict[str, Any] = field(default_factory=dict)


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
