"""Warm starts of the embedded tiny model: the supervised "pretraining" that makes it a base model RL can improve.

Real RL starts from a base model that already behaves in the task's format and is sometimes right. The embedded
model is built in code, so each task brings a *curriculum*: a function that makes supervised examples (token ids,
and labels that are -100 where no loss is taken) in the task's own chat format, with the habits RL is meant to
unlearn written into them. `model.tiny.pretrain_task` names the curriculum; `warm_start` trains on it.

A curriculum is `make(tokenizer, tiny, seed) -> sample`, where `sample(rng, n)` draws a batch of n examples, each
`(input_ids, labels)`. Curricula live one per module of this package and are found by name in `CURRICULA` ("module:function",
imported on first use, so a curriculum's data generator loads only when that task is built).
"""

from __future__ import annotations

import importlib
import random
from typing import Any, Callable

from areal_pipeline.utils import get_logger

logger = get_logger(__name__)

Example = tuple[list[int], list[int]]
Sampler = Callable[[random.Random, int], list[Example]]

CURRICULA: dict[str, str] = {
    "arithmetic": "areal_pipeline.warm_start.arithmetic:curriculum",
    "reflection": "areal_pipeline.warm_start.multi_turn_math:reflection",
    "multi_turn": "areal_pipeline.warm_start.multi_turn_math:multi_turn",
    "search": "areal_pipeline.warm_start.search:curriculum",
    "calculator": "areal_pipeline.warm_start.calculator:curriculum",
    "grid": "areal_pipeline.warm_start.grid:curriculum",
    "grid_pits": "areal_pipeline.warm_start.grid:curriculum_with_pits",
}

IGNORE = -100  # the label of a token the loss skips (prompts, environment turns)
# A batch whose rows start with at least this many equal, unlabelled tokens (a tool-using agent's system prompt)
# runs them once and its rows on from there: the same loss and gradients for a fraction of the compute where the
# shared start is most of each row. Shorter shared starts (the arithmetic prompts') take the plain forward pass,
# bitwise as before.
SHARED_PREFIX_MIN_TOKENS = 256


def curriculum(name: str) -> Callable[..., Sampler]:
    if name not in CURRICULA:
        raise ValueError(f"unknown warm-start curriculum '{name}' (model.tiny.pretrain_task); "
                         f"valid: {', '.join(sorted(CURRICULA))}")
    module, function = CURRICULA[name].split(":")
    return getattr(importlib.import_module(module), function)


def warm_start(model, tokenizer, tiny: Any, seed: int) -> None:
    """`tiny.pretrain_steps` AdamW steps on batches drawn from the curriculum `tiny.pretrain_task`."""
    import torch

    rng = random.Random(seed)
    sample = curriculum(tiny.pretrain_task)(tokenizer, tiny, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=tiny.pretrain_lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / tiny.pretrain_steps)
    threads = torch.get_num_threads()
    # One thread: the built weights do not depend on the machine's core count, and on a busy 2-core
    # machine a single thread is also the faster one (no waiting on a descheduled sibling).
    torch.set_num_threads(1)
    model.train()
    try:
        for _ in range(tiny.pretrain_steps):
            rows, targets = zip(*sample(rng, tiny.pretrain_batch_size))
            shared = _shared_unlabelled_prefix(rows, targets)
            optimizer.zero_grad()
            if shared >= SHARED_PREFIX_MIN_TOKENS:
                loss = _loss_with_shared_prefix(model, tokenizer, rows, targets, shared)
                loss.backward()
            elif tiny.pretrain_micro_batches > 1:
                loss = _accumulate_by_length(model, tokenizer, rows, targets, tiny.pretrain_micro_batches)
            else:
                loss = model(**_padded(tokenizer, rows, targets)).loss
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
    finally:
        torch.set_num_threads(threads)
    model.eval()
    logger.info("warm-started the tiny model: %d steps of the '%s' curriculum, final loss %.3f",
                tiny.pretrain_steps, tiny.pretrain_task, float(loss.detach() if torch.is_tensor(loss) else loss))


def _padded(tokenizer, rows, targets) -> dict:
    """The rows right-padded to the longest, as `model(**...)` takes them (its loss: the mean over labelled tokens)."""
    import torch

    width = max(map(len, rows))
    return {"input_ids": torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows]),
            "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]),
            "labels": torch.tensor([list(t) + [IGNORE] * (width - len(t)) for t in targets])}


def _accumulate_by_length(model, tokenizer, rows, targets, micro_batches: int):
    """The gradient of the batch's loss (the mean over all its labelled tokens, as one padded batch computes it),
    accumulated over `micro_batches` groups of rows of similar length, each padded only to its own longest row.
    Returns the loss's value."""
    import torch.nn.functional as F

    # a token's label is predicted at the position before it: the first token of a row is never a target
    labelled = sum(sum(1 for label in t[1:] if label != IGNORE) for t in targets)
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    size = -(-len(rows) // micro_batches)
    total = 0.0
    for start in range(0, len(order), size):
        chosen = order[start:start + size]
        batch = _padded(tokenizer, [rows[i] for i in chosen], [targets[i] for i in chosen])
        labels = batch.pop("labels")
        logits = model(**batch).logits[:, :-1].float()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=IGNORE,
                               reduction="sum") / max(labelled, 1)
        loss.backward()
        total += loss.item()
    return total


def _shared_unlabelled_prefix(rows, targets) -> int:
    """How many leading tokens every row has in common with no label on them (at most all but a row's last)."""
    shared = min(len(r) for r in rows) - 1
    first = rows[0]
    for row, target in zip(rows, targets):
        labelled = next((i for i, label in enumerate(target) if label != IGNORE), len(target))
        same = next((i for i, (a, b) in enumerate(zip(row, first)) if a != b), len(row))
        shared = min(shared, labelled, same)
    return max(shared, 0)


def _loss_with_shared_prefix(model, tokenizer, rows, targets, shared: int):
    """The causal LM loss of the batch (mean over labelled tokens, as `model(labels=...)` computes it), running the
    rows' first `shared` tokens once: their KV cache, expanded to the batch, is the past of every row's rest (the
    gradient flows through it back into the shared tokens' forward pass)."""
    import torch
    import torch.nn.functional as F
    from transformers import DynamicCache

    prefix = model(input_ids=torch.tensor([list(rows[0][:shared])]), use_cache=True)
    n = len(rows)
    past = DynamicCache(ddp_cache_data=[(layer.keys.expand(n, -1, -1, -1), layer.values.expand(n, -1, -1, -1))
                                        for layer in prefix.past_key_values.layers])
    rests = [list(r[shared:]) for r in rows]
    width = max(map(len, rests))
    ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rests])
    attention = torch.tensor([[1] * (shared + len(r)) + [0] * (width - len(r)) for r in rests])
    positions = (shared + torch.arange(width)).expand(n, -1)
    out = model(input_ids=ids, attention_mask=attention, position_ids=positions, past_key_values=past)
    # token t of a rest is predicted at t - 1: the prefix's last position predicts each rest's first token
    logits = torch.cat([prefix.logits[:, -1:].expand(n, -1, -1), out.logits[:, :-1]], dim=1)
    labels = torch.tensor([list(t[shared:]) + [IGNORE] * (width - len(t) + shared) for t in targets])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=IGNORE)
