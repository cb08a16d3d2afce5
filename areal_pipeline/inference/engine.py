"""The batched decode engine behind the CPU inference server: one thread owns the model and schedules requests.

Requests that arrive while a batch is decoding join it at the next step boundary (step-level continuous batching):
their prompts are prefilled together and merged into the running batch (kv_batch.py), so every decode step runs all
live requests through the model at once; finished requests leave the batch at once.

Logprobs are those of the full distribution at the request's temperature (`log_softmax(logits / T)`),
computed before top-k / top-p / min-p filtering: exactly what a trainer's teacher-forced forward pass at the
same temperature computes.
"""

from __future__ import annotations

import concurrent.futures
import gc
import threading
import time
from collections import deque
from typing import Any, Callable, Optional

import torch

from areal_pipeline.http_json import RequestRejected as RequestError
from areal_pipeline.inference.kv_batch import Batch, GenRequest, prefill
from areal_pipeline.inference.lora_serving import (EVICTED, AdapterWeights, MergedAdapter, base_locked,
                                                    refusal_for)
from areal_pipeline.inference.sampling import sample_next_tokens
from areal_pipeline.inference.types import SamplingParams
from areal_pipeline.model import eos_token_ids, load_model, load_tokenizer
from areal_pipeline.utils import get_logger

logger = get_logger(__name__)

__all__ = ["BatchEngine", "GenRequest", "RequestError", "SamplingParams"]

# A text prompt is tokenised whole when it has at most this many characters per token of room in the context
# (English runs ~4 per token); a longer one first as a prefix of that length.
PREFIX_CHARS_PER_TOKEN = 8
PREFIX_CUT_TOKENS = 16
PAUSED_FOR_WEIGHT_UPDATE = "paused for a weight update"  # the abort message of a request a pause interrupted


class BatchEngine:
    def __init__(self, model_path: str, *, max_batch_size: int = 128, context_length: int = 0,
                 seed: int = 0, dtype: str = "float32", device: str = "cpu",
                 trust_remote_code: bool = False, weight_version: str = "0",
                 on_load_failure: Optional[Callable[[], None]] = None, deterministic: bool = False):
        """`deterministic`: honour requests' `sampling_seed` (SGLang ignores it unless started with
        --enable-deterministic-inference, and so does this engine)."""
        self.model_path = model_path
        self.max_batch_size = max_batch_size
        self.seed = seed
        self.deterministic = deterministic
        self.dtype = dtype
        self.device = torch.device(device)
        self.trust_remote_code = trust_remote_code
        self.weight_version = weight_version
        self._requested_context_length = context_length
        self.context_length = context_length
        self.model = None
        self.tokenizer = None
        self.eos_ids: list[int] = []
        self.ready = threading.Event()
        self.load_error: Optional[BaseException] = None
        self.on_load_failure = on_load_failure
        self.paused = False
        self.adapter = MergedAdapter()  # the LoRA adapter merged into the model (lora_serving.py), if any
        self._pending: deque[GenRequest] = deque()
        self._commands: deque[tuple[Callable[[], Any], concurrent.futures.Future]] = deque()
        self._cv = threading.Condition()
        self._stop = False
        self._batch = Batch()
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(seed)
        self._thread: Optional[threading.Thread] = None
        self.stats = {"decode_steps": 0, "prefill_batches": 0, "prefill_tokens": 0, "generated_tokens": 0,
                      "finished_requests": 0, "peak_running_requests": 0, "aborted_requests": 0,
                      # seconds spent admitting and decoding: how much of the wall time the engine generated, so a
                      # caller can tell a server kept busy from one waiting for requests (bench/async_vs_sync.py)
                      "busy_seconds": 0.0}

    # ----- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="batch-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _load(self) -> None:
        self.tokenizer = load_tokenizer(self.model_path, self.trust_remote_code)
        self.model = load_model(self.model_path, self.dtype, self.device, self.trust_remote_code)
        self.eos_ids = eos_token_ids(self.tokenizer, self.model.generation_config)
        max_pos = getattr(self.model.config, "max_position_embeddings", None) or 1 << 30
        self.context_length = min(self._requested_context_length or max_pos, max_pos)
        self.vocab_size = self.model.config.vocab_size

    # ----- thread-safe API -------------------------------------------------------------------------
    def submit(self, request: GenRequest) -> None:
        self.validate(request)
        if self.deterministic and request.params.sampling_seed is not None:
            request.generator = torch.Generator(device=self.device)
            request.generator.manual_seed(int(request.params.sampling_seed))
        with self._cv:
            self._pending.append(request)
            self._cv.notify_all()

    def validate(self, request: GenRequest) -> None:
        ids = request.input_ids
        if not ids:
            raise RequestError("the prompt is empty: input_ids must hold at least one token")
        # the length first: a prompt of millions of ids is refused without looking at each of them
        total = len(ids) + request.params.max_new_tokens
        if total >= self.context_length:  # as SGLang's check (0.5.10 refuses a total equal to the context length)
            raise RequestError(self._context_exceeded(total, len(ids), request.params.max_new_tokens))
        if self.deterministic and request.params.min_p > 0:  # SGLang's seeded sampler asserts on it: its server dies
            raise RequestError("min_p > 0 cannot be used on a server started with --enable-deterministic-inference "
                               "(SGLang's seeded sampler does not support it)")
        if not all(type(i) is int and 0 <= i < self.vocab_size for i in ids):
            raise RequestError(f"input_ids must be integers in [0, {self.vocab_size})")
        if (refusal := refusal_for([request.lora_name], self.adapter.name)) is not None:
            raise RequestError(refusal)

    def _context_exceeded(self, total: Any, prompt_tokens: Any, max_new_tokens: int) -> str:
        return (f"Requested token count exceeds the model's maximum context length of {self.context_length} "
                f"tokens. You requested a total of {total} tokens: {prompt_tokens} tokens from the input and "
                f"{max_new_tokens} tokens for the completion.")

    def tokenize(self, text: str, max_new_tokens: int) -> list[int]:
        """The token ids of a text prompt (any thread); RequestError as soon as it is known not to fit the
        context with `max_new_tokens` more. A huge text is tokenised as growing prefixes, so that refusing it
        costs about as much as tokenising a text just over the limit: tokenising a 40 MB prompt took 114 s."""
        budget = self.context_length - 1 - max_new_tokens
        chars = max(budget, 1) * PREFIX_CHARS_PER_TOKEN
        while chars < len(text):
            prefix_tokens = len(self.tokenizer.encode(text[:chars]))
            # cutting a word can give its start more tokens than the whole word has: allow for it
            if prefix_tokens > budget + PREFIX_CUT_TOKENS:
                at_least = prefix_tokens - PREFIX_CUT_TOKENS
                raise RequestError(self._context_exceeded(f"more than {at_least + max_new_tokens}",
                                                          f"more than {at_least}", max_new_tokens)
                                   + f" (The prompt's first {chars} characters alone are {prefix_tokens} tokens.)")
            chars *= 4
        return self.tokenizer.encode(text)

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `fn` on the engine thread between two decode steps."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            self._commands.append((fn, fut))
            self._cv.notify_all()
        return fut

    def num_running(self) -> int:
        return len(self._batch) + len(self._pending)

    def pause(self) -> concurrent.futures.Future:
        def _pause():
            self.paused = True
            self._abort_where(lambda r: True, PAUSED_FOR_WEIGHT_UPDATE)
        return self.call(_pause)

    def resume(self) -> concurrent.futures.Future:
        def _resume():
            self.paused = False
        return self.call(_resume)

    def abort(self, rid: Optional[str] = None, abort_all: bool = False) -> concurrent.futures.Future:
        return self.call(lambda: self._abort_where(lambda r: abort_all or r.rid == rid, "aborted by request"))

    def load_adapter(self, name: str, adapter: AdapterWeights) -> concurrent.futures.Future:
        """Merge `adapter` (read and checked: lora_serving.read_adapter) into the base as `name`, in place of the
        adapter merged before, whose running requests end as aborted (their clients resend them naming this one)."""
        def _load():
            self._abort_where(lambda r: r.lora_name != name, EVICTED)
            self.adapter.merge(self.model, name, adapter)
        return self.call(_load)

    def unload_adapter(self) -> concurrent.futures.Future:
        """Serve the base again: the requests running on the adapter end as aborted."""
        def _unload():
            self._abort_where(lambda r: r.lora_name is not None, EVICTED)
            self.adapter.unmerge(self.model)
        return self.call(_unload)

    def _refuse_while_adapter(self) -> None:
        if self.adapter.name is not None:  # the base under it would no longer be the one the adapter was made for
            raise RequestError(base_locked(self.adapter.name))

    def load_weights(self, state: dict[str, torch.Tensor], weight_version: Optional[str]) -> concurrent.futures.Future:
        """Copy weights that `read_weights` checked into the model, between two decode steps."""
        def _load():
            self._refuse_while_adapter()
            own = self.model.state_dict()
            with torch.no_grad():
                for name, tensor in state.items():
                    own[name].copy_(tensor.to(own[name].dtype))
            if weight_version is not None:  # as SGLang: without one the version stays (a bucket before the last)
                self.weight_version = weight_version
            return len(state)
        return self.call(_load)

    def update_weights_from_group(self, group, backend: str, names: list[str], dtypes: list[str],
                                  shapes: list[list[int]], weight_version: Optional[str],
                                  timeout: Optional[float] = None) -> concurrent.futures.Future:
        """Receive the tensors the trainer broadcasts (rank 0 of `group`), in order, between decode steps. A tensor
        that does not come within `timeout` seconds (default: the group's own limit) is a PeerTimeout naming the
        trainer: the engine thread must not wait for good on a trainer that hangs."""
        from areal_pipeline.training.weight_group import GROUP_TIMEOUT
        from areal_pipeline.training.weight_sync import DTYPES as WIRE_DTYPES
        from areal_pipeline.training.weight_sync import wait_for

        limit = timeout if timeout is not None else GROUP_TIMEOUT.total_seconds()

        def _update():
            self._refuse_while_adapter()
            params = self.model.state_dict()
            unknown = [n for n in names if n not in params]
            if unknown:  # fail before receiving: the trainer's broadcast then errors out instead of hanging
                raise RequestError(f"tensors this model does not have: {unknown[:5]}")
            for name, dtype, shape in zip(names, dtypes, shapes):
                if dtype not in WIRE_DTYPES:
                    raise RequestError(f"unsupported dtype {dtype!r} for {name}")
                # gloo receives into host memory whatever the model's device; NCCL into the GPU's
                buffer = torch.empty(shape, dtype=WIRE_DTYPES[dtype], device="cpu" if backend == "gloo" else self.device)
                wait_for(group.broadcast(buffer, root=0), limit, "the trainer (rank 0 of the weight-update group)",
                         f"send of {name}")
                with torch.no_grad():
                    params[name].copy_(buffer.to(params[name].dtype))
            if weight_version is not None:
                self.weight_version = weight_version
            return len(names)
        return self.call(_update)

    # ----- engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._load()
            self._warm_up()
        except BaseException as e:  # reported through /health and the log
            logger.exception("failed to load model %s", self.model_path)
            self.load_error = e
            if self.on_load_failure is not None:
                self.on_load_failure()
            return
        # the model and the modules stay for the server's life: full collections need not walk them again
        gc.freeze()
        self.ready.set()
        torch.set_grad_enabled(False)
        while True:
            with self._cv:
                while not (self._stop or self._commands or len(self._batch)
                           or (self._pending and not self.paused)):
                    self._cv.wait()
                if self._stop:
                    break
                commands = list(self._commands)
                self._commands.clear()
            for fn, fut in commands:
                try:
                    fut.set_result(fn())
                except BaseException as e:
                    fut.set_exception(e)
            try:
                self._step()
            except Exception as e:
                # The running batch's cache may be half updated: its requests end with an error and the next
                # step starts a fresh batch. Queued requests were not part of the step and stay queued.
                logger.exception("engine step failed")
                self._fail_running(f"internal error: {type(e).__name__}: {e}")
        self._abort_where(lambda r: True, "server shutting down")

    def _warm_up(self) -> None:
        request = GenRequest(input_ids=[self.eos_ids[0] if self.eos_ids else 0],
                             params=SamplingParams(max_new_tokens=1))
        with torch.inference_mode():
            self._admit([request])

    def _step(self) -> None:
        new = []
        if not self.paused and self._pending and len(self._batch) < self.max_batch_size:
            self._collect_burst()
            with self._cv:
                room = self.max_batch_size - len(self._batch)
                new = [self._pending.popleft() for _ in range(min(room, len(self._pending)))]
            new = self._refuse_adapters_not_loaded(new)
        started = time.perf_counter()  # the burst's wait above is no work
        if new:
            self._admit_or_fail(new)
        self._finish_aborted()
        if len(self._batch):
            with torch.inference_mode():
                self._decode()
        self.stats["busy_seconds"] += time.perf_counter() - started

    def _collect_burst(self) -> None:
        # Concurrent clients' requests arrive a few ms apart; when the engine is idle, waiting a moment
        # lets them share one prefill instead of joining one by one.
        if len(self._batch):
            return
        deadline = time.perf_counter() + 0.02
        seen = -1
        while len(self._pending) != seen and time.perf_counter() < deadline:
            seen = len(self._pending)
            time.sleep(0.002)

    def _refuse_adapters_not_loaded(self, new: list[GenRequest]) -> list[GenRequest]:
        """`new` less the requests naming another adapter than the one merged now (checked at admission, not only
        when they came: an adapter may have been swapped while they queued); those end refused, with a 400."""
        admitted = []
        for r in new:
            if (refusal := refusal_for([r.lora_name], self.adapter.name)) is None:
                admitted.append(r)
            else:
                r.error_status = 400
                self._fail(r, refusal)
        return admitted

    def _admit_or_fail(self, new: list[GenRequest]) -> None:
        """Admit `new`, which has left the queue: if admission fails, whatever of it is not finished ends with an
        error here (no abort path would find it: it is neither queued nor, unless the merge happened, running)."""
        try:
            with torch.inference_mode():
                self._admit(new)
        except Exception as e:
            logger.exception("admitting %d request(s) failed", len(new))
            cause = e.__cause__ if isinstance(e, _PrefillFailed) else e
            message = f"internal error while admitting the request: {type(cause).__name__}: {cause}"
            running = set(map(id, self._batch.requests))
            for r in new:
                if not r.done and id(r) not in running:
                    self._fail(r, message)
            if not isinstance(e, _PrefillFailed):  # they reached the batch: it may be inconsistent now
                raise

    def _fail(self, r: GenRequest, message: str) -> None:
        r.error = message
        self._finish(r, {"type": "abort", "message": message})

    def _fail_running(self, message: str) -> None:
        batch, self._batch = self._batch, Batch()
        for r in batch.requests:
            if not r.done:
                self._fail(r, message)

    def _abort_where(self, pred: Callable[[GenRequest], bool], message: str) -> None:
        with self._cv:
            queued = [r for r in self._pending if pred(r)]
            for r in queued:
                self._pending.remove(r)
        for r in queued:
            self._finish(r, {"type": "abort", "message": message})
        for r in self._batch.requests:
            if pred(r):
                r.abort_message = message
        self._finish_aborted()

    def _finish_aborted(self) -> None:
        aborted = [i for i, r in enumerate(self._batch.requests) if r.abort_message is not None]
        for i in aborted:
            r = self._batch.requests[i]
            self._finish(r, {"type": "abort", "message": r.abort_message})
        if aborted:
            self._batch.drop_rows(set(aborted), self.device)

    def _finish(self, r: GenRequest, reason: dict) -> None:
        if r.done:  # a request answers once, whatever path reaches it again
            return
        r.finish_reason = reason
        r.weight_version = self.weight_version
        r.finished = time.perf_counter()
        self.stats["finished_requests"] += 1
        if reason["type"] == "abort":
            self.stats["aborted_requests"] += 1
        if r.on_finish is not None:
            r.on_finish(r)

    def _admit(self, new: list[GenRequest]) -> None:
        """Prefill the new prompts together, sample their first token, and merge them into the batch."""
        self.stats["prefill_batches"] += 1
        try:
            p = prefill(self.model, new, self.tokenizer.pad_token_id or 0, self.device)
            tokens, logprobs = self._sample(new, p.logits)
        except Exception as e:  # the running batch is untouched
            raise _PrefillFailed(str(e)) from e
        self.stats["prefill_tokens"] += p.prompt_tokens
        self._batch.merge(new, p, tokens)
        self.stats["peak_running_requests"] = max(self.stats["peak_running_requests"], len(self._batch))
        self._append_tokens(tokens, logprobs, first_row=len(self._batch) - len(new))

    def _decode(self) -> None:
        b = self._batch
        logits = b.forward(self.model)
        self.stats["decode_steps"] += 1
        tokens, logprobs = self._sample(b.requests, logits)
        b.next_tokens = tokens
        self._append_tokens(tokens, logprobs, first_row=0)

    def _append_tokens(self, tokens: torch.Tensor, logprobs: torch.Tensor, first_row: int) -> None:
        """Record each row's new token and retire the rows that are finished."""
        b = self._batch
        done = set()
        for row, (tok, lp) in enumerate(zip(tokens.tolist(), logprobs.tolist()), start=first_row):
            r = b.requests[row]
            if r.params.max_new_tokens == 0:
                self._finish(r, {"type": "length", "length": 0})
                done.add(row)
                continue
            r.output_ids.append(tok)
            r.output_logprobs.append(lp)
            r.output_versions.append(self.weight_version)
            self.stats["generated_tokens"] += 1
            reason = self._stop_reason(r, tok)
            if reason is not None:
                self._finish(r, reason)
                done.add(row)
        if done:
            self._batch.drop_rows(done, self.device)

    def _stop_reason(self, r: GenRequest, tok: int) -> Optional[dict]:
        p = r.params
        if (not p.ignore_eos and tok in self.eos_ids) or tok in p.stop_token_ids:
            return {"type": "stop", "matched": tok}
        if p.stop:
            text = self.tokenizer.decode(r.output_ids, skip_special_tokens=p.skip_special_tokens)
            for s in p.stop:
                if s in text:
                    return {"type": "stop", "matched": s}
        if len(r.output_ids) >= p.max_new_tokens:
            return {"type": "length", "length": len(r.output_ids)}
        return None

    def _sample(self, requests: list[GenRequest], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return sample_next_tokens(logits, [r.params for r in requests], [r.generator for r in requests],
                                  self._generator)


class _PrefillFailed(RuntimeError):
    """Admission failed before the new requests joined the batch (the running batch is as it was)."""

