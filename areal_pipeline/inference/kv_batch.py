"""The CPU engine's requests and the model's forward passes over them: a prefill of new prompts, the running
batch's KV cache, and its decode steps (engine.py schedules them).

New prompts are prefilled together; their KV cache is left-padded to the running batch's length and concatenated
to it, so every decode step runs all live requests through the model at once. Rows leave the batch as their
requests finish, and left padding common to every remaining row is trimmed away.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from areal_pipeline.inference.types import SamplingParams


@dataclass
class GenRequest:
    input_ids: list[int]
    params: SamplingParams
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    return_logprob: bool = False
    logprob_start_len: int = -1
    on_finish: Optional[Callable[["GenRequest"], None]] = None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    # the engine's weight version when each output token was sampled: weights loaded between two decode steps
    # (no pause) change it within one generation
    output_versions: list[str] = field(default_factory=list)
    input_logprobs: list[Optional[float]] = field(default_factory=list)
    finish_reason: Optional[dict] = None
    weight_version: str = ""
    created: float = field(default_factory=time.perf_counter)
    finished: float = 0.0
    abort_message: Optional[str] = None  # set from another thread to abort at the next step
    # Why the server failed this request (an internal error, not the request's fault): the HTTP reply is then an
    # error, never an abort a client would take for a pause and resend.
    error: Optional[str] = None
    error_status: int = 500  # 400 where the request could not run as asked (an adapter not loaded)
    lora_name: Optional[str] = None  # the LoRA adapter it runs on (lora_serving.py); None: the base
    generator: Optional[torch.Generator] = None
    cached_tokens: int = 0  # prompt tokens whose KV cache came from another request's prefill

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Prefill:
    """New prompts run through the model, not yet part of the batch; row i belongs to the i-th new request."""

    cache: object  # transformers DynamicCache
    mask: torch.Tensor  # [rows, T], 1 where the cache holds a real token
    next_pos: torch.Tensor  # [rows], position id of the token fed next
    logits: torch.Tensor  # [rows, vocab], float: each row's next-token logits
    prompt_tokens: int  # tokens run through the model (a prompt several requests share counts once)


def _left_pad(t: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    missing = length - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def prefill(model, new: list[GenRequest], pad_id: int, device: torch.device) -> Prefill:
    """The new prompts through the model. A prompt that several requests share (a GRPO group's samples) is run
    once and its KV cache copied to each of them, as SGLang's radix cache would reuse it. Requests that asked for
    their prompt's logprobs get them (`input_logprobs`)."""
    from transformers import DynamicCache

    first_of: dict[tuple[int, ...], int] = {}
    row_of = [first_of.setdefault(tuple(r.input_ids), len(first_of)) for r in new]
    prompts = [list(p) for p in first_of]
    lengths = [len(p) for p in prompts]
    width = max(lengths)
    ids = torch.tensor([[pad_id] * (width - n) + p for p, n in zip(prompts, lengths)], device=device)
    mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths], device=device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    want_input_logprobs = any(r.return_logprob and r.logprob_start_len >= 0 for r in new)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=DynamicCache(),
                use_cache=True, logits_to_keep=0 if want_input_logprobs else 1)
    logits, cache = out.logits.float(), out.past_key_values
    if len(prompts) < len(new):
        seen: set[int] = set()
        for r, row in zip(new, row_of):
            r.cached_tokens = len(r.input_ids) if row in seen else 0
            seen.add(row)
        rows = torch.tensor(row_of, device=device)
        ids, mask, positions, logits = ids[rows], mask[rows], positions[rows], logits[rows]
        cache = DynamicCache(ddp_cache_data=[(layer.keys[rows], layer.values[rows]) for layer in cache.layers])
    if want_input_logprobs:
        _record_input_logprobs(new, logits, ids, width)
    return Prefill(cache, mask, positions[:, -1] + 1, logits[:, -1], sum(lengths))


def _record_input_logprobs(new: list[GenRequest], logits: torch.Tensor, ids: torch.Tensor, width: int) -> None:
    for row, r in enumerate(new):
        if not (r.return_logprob and r.logprob_start_len >= 0):
            continue
        n = len(r.input_ids)
        temp = 1.0 if r.params.greedy else float(r.params.temperature)
        lp = torch.log_softmax(logits[row, width - n:-1] / temp, dim=-1)
        target = ids[row, width - n + 1:]
        values = lp.gather(-1, target[:, None]).squeeze(-1).tolist()
        r.input_logprobs = ([None] + values)[r.logprob_start_len:]


class Batch:
    """The live requests and their KV cache; row i of every tensor belongs to requests[i]."""

    def __init__(self) -> None:
        self.requests: list[GenRequest] = []
        self.cache = None  # transformers DynamicCache, [B, heads, T, dim] per layer
        self.mask: Optional[torch.Tensor] = None  # [B, T], 1 where the cache holds a real token
        self.next_pos: Optional[torch.Tensor] = None  # [B], position id of the token fed next
        self.next_tokens: Optional[torch.Tensor] = None  # [B], sampled but not yet in the cache

    def __len__(self) -> int:
        return len(self.requests)

    def merge(self, new: list[GenRequest], p: Prefill, tokens: torch.Tensor) -> None:
        """Add the prefilled requests, whose first sampled tokens are `tokens`, as the batch's last rows."""
        from transformers import DynamicCache

        if not len(self):
            self.requests, self.cache, self.mask, self.next_pos, self.next_tokens = (list(new), p.cache, p.mask,
                                                                                    p.next_pos, tokens)
            return
        width = max(self.mask.shape[1], p.mask.shape[1])
        layers = []
        for old_layer, new_layer in zip(self.cache.layers, p.cache.layers):
            layers.append(tuple(
                torch.cat([_left_pad(a, width, 2), _left_pad(c, width, 2)], dim=0)
                for a, c in ((old_layer.keys, new_layer.keys), (old_layer.values, new_layer.values))
            ))
        # built whole before any is assigned: a failure midway leaves the batch as it was
        merged = (DynamicCache(ddp_cache_data=layers),
                  torch.cat([_left_pad(self.mask, width, 1), _left_pad(p.mask, width, 1)], dim=0),
                  torch.cat([self.next_pos, p.next_pos]), torch.cat([self.next_tokens, tokens]))
        self.cache, self.mask, self.next_pos, self.next_tokens = merged
        self.requests = self.requests + list(new)

    def forward(self, model) -> torch.Tensor:
        """One decode step: the tokens sampled last go into the cache; returns each row's next-token logits
        [B, vocab] (float). The caller sets `next_tokens` from them."""
        mask = torch.cat([self.mask, self.mask.new_ones((len(self), 1))], dim=1)
        out = model(input_ids=self.next_tokens[:, None], attention_mask=mask, position_ids=self.next_pos[:, None],
                    past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.cache, self.mask = out.past_key_values, mask
        self.next_pos = self.next_pos + 1
        return out.logits[:, -1].float()

    def drop_rows(self, rows: set[int], device: torch.device) -> None:
        keep = [i for i in range(len(self)) if i not in rows]
        self.requests = [self.requests[i] for i in keep]
        if not keep:
            self.cache = self.mask = self.next_pos = self.next_tokens = None
            return
        index = torch.tensor(keep, device=device)
        self.mask, self.next_pos, self.next_tokens = self.mask[index], self.next_pos[index], self.next_tokens[index]
        self.cache.batch_select_indices(index)
        # Drop columns that are padding in every remaining row: they cost attention compute each step.
        first_real = int(self.mask.any(0).nonzero()[0])
        if first_real > 0:
            self.mask = self.mask[:, first_real:]
            for layer in self.cache.layers:
                layer.keys = layer.keys[:, :, first_real:]
                layer.values = layer.values[:, :, first_real:]
