"""Policy losses and the logits -> per-token quantities they need.

Every function works on tensors of any shape (the trainer passes packed 1-D token tensors);
`loss_mask` is 1 on the tokens that count, and losses are token means over it.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, x, 0.0).sum() / mask.sum().clamp(min=1)


def _sequence_mean(x: Tensor, mask: Tensor, seq_ids: Tensor) -> Tensor:
    """Each token gets the mean of `x` over the masked tokens of its sequence (differentiable)."""
    ids = torch.unique(seq_ids, return_inverse=True)[1].reshape(-1)
    w = mask.reshape(-1).to(x.dtype)
    n = int(ids.max()) + 1 if ids.numel() else 0
    total = x.new_zeros(n).index_add(0, ids, x.reshape(-1) * w)
    count = x.new_zeros(n).index_add(0, ids, w).clamp(min=1)
    return (total / count)[ids].reshape(x.shape)


def ppo_actor_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    eps_clip: float,
    eps_clip_higher: Optional[float] = None,
    c_clip: Optional[float] = None,
    proximal_logprobs: Optional[Tensor] = None,
    behav_imp_weight_cap: Optional[float] = None,
    importance_sampling_level: str = "token",
    seq_ids: Optional[Tensor] = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped PPO surrogate, token mean over `loss_mask` (AReaL's `ppo_actor_loss_fn`).

    With the base policy `pi_base` = `proximal_logprobs` if given, else `old_logprobs`:
        ratio  = exp(logp - logp_base)
        loss_t = max(-A * ratio, -A * clip(ratio, 1 - eps_clip, 1 + eps_clip_higher))
    Dual clip (`c_clip` > 1): for A < 0, `loss_t = min(loss_t, -c_clip * A)`, so a huge ratio on
    a bad token cannot produce an unbounded step.
    Decoupled PPO (`proximal_logprobs` given; the rollout policy `old` may be stale):
        loss_t *= w_t = exp(logp_prox - logp_old)    (behaviour importance weight)
    and tokens with w_t > `behav_imp_weight_cap` are dropped (weight 0, still counted in the mean).
    GSPO (`importance_sampling_level="sequence"`): every token of sequence i uses
        s_i = exp(mean_{t in i} (logp_t - logp_base_t))
    and the sequence's mean advantage. `seq_ids` names each token's sequence; for a 2-D
    `[B, T]` input it defaults to the row.

    Stats (detached scalars): `clip_fraction`, `dual_clip_fraction`, `approx_kl`
    (mean of logp - logp_base), `importance_weight` (mean ratio), and when decoupled
    `behave_imp_weight` (mean over kept tokens) and `behave_mask_fraction` (fraction of
    tokens dropped by the cap).
    """
    mask = loss_mask.bool()
    # Advantages and the base policy are data: the gradient flows through `logprobs` only.
    advantages = advantages.detach()
    base = (old_logprobs if proximal_logprobs is None else proximal_logprobs).detach()
    log_ratio = torch.where(mask, logprobs - base, 0.0)

    if importance_sampling_level == "sequence":
        if seq_ids is None:
            if logprobs.dim() != 2:
                raise ValueError("importance_sampling_level='sequence' needs seq_ids for packed inputs")
            seq_ids = torch.arange(logprobs.shape[0], device=logprobs.device)[:, None].expand_as(logprobs)
        log_ratio = _sequence_mean(log_ratio, mask, seq_ids)
        advantages = _sequence_mean(advantages, mask, seq_ids)
    elif importance_sampling_level != "token":
        raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {importance_sampling_level!r}")

    ratio = log_ratio.exp()
    high = eps_clip if eps_clip_higher is None else eps_clip_higher
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + high)
    pg_loss = torch.maximum(loss_unclipped, loss_clipped)
    clip_mask = mask & (loss_unclipped < loss_clipped)

    if c_clip is not None:
        if c_clip <= 1.0:
            raise ValueError(f"c_clip must be > 1, got {c_clip}")
        loss_dual = -c_clip * advantages
        dual_clip_mask = mask & (advantages < 0) & (loss_dual < pg_loss)
        pg_loss = torch.where(dual_clip_mask, loss_dual, pg_loss)
    else:
        dual_clip_mask = torch.zeros_like(mask)

    stats = {}
    if proximal_logprobs is not None:
        behave_weight = torch.exp(proximal_logprobs - old_logprobs).detach()
        keep = mask if behav_imp_weight_cap is None else mask & (behave_weight <= behav_imp_weight_cap)
        behave_weight = torch.where(keep, behave_weight, 0.0)
        pg_loss = pg_loss * behave_weight
        stats["behave_imp_weight"] = _masked_mean(behave_weight, keep)
        stats["behave_mask_fraction"] = _masked_mean((mask & ~keep).float(), mask)

    loss = _masked_mean(pg_loss, mask)
    stats.update(
        clip_fraction=_masked_mean(clip_mask.float(), mask),
        dual_clip_fraction=_masked_mean(dual_clip_mask.float(), mask),
        approx_kl=_masked_mean(logprobs - base, mask).detach(),
        importance_weight=_masked_mean(ratio, mask).detach(),
    )
    return loss, stats


def reinforce_loss(logprobs: Tensor, advantages: Tensor, loss_mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """REINFORCE: `loss = mean over loss_mask of -(A_t * logp_t)` (ReMax trains with it).

    Stats: `logprob` and `advantage`, their means over the mask (detached).
    """
    mask = loss_mask.bool()
    advantages = advantages.detach()
    loss = _masked_mean(-advantages * logprobs, mask)
    return loss, {"logprob": _masked_mean(logprobs, mask).detach(), "advantage": _masked_mean(advantages, mask)}


def _over_tokens(fn: Callable[..., Tensor], chunk_size: int, logits: Tensor, *aligned: Tensor) -> Tensor:
    """`fn(logits_chunk [n, V], *aligned_chunks [n])` over chunks of tokens, so the float32
    `[n, V]` temporaries exist for one chunk at a time; returns `logits.shape[:-1]`."""
    flat = logits.reshape(-1, logits.shape[-1])
    aligned = tuple(a.reshape(-1) for a in aligned)
    outs = [fn(flat[i : i + chunk_size], *(a[i : i + chunk_size] for a in aligned))
            for i in range(0, flat.shape[0], chunk_size)]
    out = torch.cat(outs) if outs else flat.new_zeros(0, dtype=torch.float32)
    return out.reshape(logits.shape[:-1])


def _chunk_stats(chunk: Tensor, inv_temperature: float) -> tuple[Tensor, Tensor]:
    """Per row of `chunk` ([n, V]): logsumexp and entropy of softmax(chunk * inv_temperature), in float32."""
    z = chunk.float()
    if inv_temperature != 1.0:
        z = z * inv_temperature
    m = z.amax(dim=-1, keepdim=True)
    e = torch.exp(z - m)
    s = e.sum(dim=-1)
    lse = m.squeeze(-1) + s.log()
    # H = lse - sum_v p_v z_v; a -inf logit (masked vocabulary) has p_v = 0 and adds 0 (nansum drops 0 * -inf)
    return lse, lse - torch.nansum(e * z, dim=-1) / s


def _chunk_logsumexp_grad(chunk: Tensor, lse: Tensor, grad: Tensor, inv_temperature: float) -> Tensor:
    """d(sum_i grad_i lse_i)/d chunk = softmax(chunk * inv_temperature) * grad * inv_temperature, in chunk's dtype."""
    z = chunk.float()
    if inv_temperature != 1.0:
        z = z * inv_temperature
    return (torch.exp(z - lse[:, None]) * (grad * inv_temperature)[:, None]).to(chunk.dtype)


class _VocabKernels:
    """The two per-chunk functions above, eager or compiled into fused kernels (`use_compiled_vocab_kernels`):
    eager, each elementwise step is a pass over a float32 `[n, V]` temporary; compiled, the bfloat16 logits are
    read once or twice per chunk. A compilation that fails falls back to eager, once, with a warning."""

    def __init__(self):
        self.use_eager()

    def use_eager(self) -> None:
        self.stats, self.grad = _chunk_stats, _chunk_logsumexp_grad
        self.compiled = False

    def compile(self) -> None:
        self.stats = torch.compile(_chunk_stats, dynamic=True)
        self.grad = torch.compile(_chunk_logsumexp_grad, dynamic=True)
        self.compiled = True

    def call(self, name: str, *args):
        try:
            return getattr(self, name)(*args)
        except torch.OutOfMemoryError:
            raise  # the data's size, not the compiler: eager would need more memory still
        except Exception as e:  # noqa: BLE001 (a compiler failure of any kind: the eager functions are exact)
            if not self.compiled:
                raise
            import logging

            logging.getLogger("areal_pipeline.trainer").warning(
                "compiled logprob kernels failed (%s: %s); running them eagerly", type(e).__name__, e)
            self.use_eager()
            return getattr(self, name)(*args)


VOCAB_KERNELS = _VocabKernels()


def use_compiled_vocab_kernels(enabled: bool = True) -> None:
    """Compile the per-token logsumexp/entropy/gradient over the vocabulary (the trainer does on CUDA)."""
    if enabled and not VOCAB_KERNELS.compiled:
        VOCAB_KERNELS.compile()
    elif not enabled:
        VOCAB_KERNELS.use_eager()


def entropy_from_logits(logits: Tensor, chunk_size: int = 1024, temperature: float = 1.0) -> Tensor:
    """Per-token entropy `H = -sum_v p_v log p_v`, with `p = softmax(logits / temperature)` in float32, over
    chunks of tokens (no float32 copy of the whole logits)."""
    return _over_tokens(lambda chunk: VOCAB_KERNELS.call("stats", chunk, 1.0 / temperature)[1], chunk_size,
                        logits.detach())


def logprobs_and_entropy(logits: Tensor, labels: Tensor, temperature: float = 1.0, chunk_size: int = 1024,
                         rows: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """`log_softmax(logits / temperature)[label]` per token (differentiable) and the entropy of that
    distribution (detached), from one pass over each chunk of the logits.

    `logits` is `[..., V]`, `labels` is `logits.shape[:-1]`. The logprob is `z[label] - logsumexp(z)`: gathering
    instead of normalising the whole row, and a logsumexp that keeps nothing of its float32 work for backward,
    leave autograd only the logits themselves (no `[N, V]` log-softmax, no float32 copy). With `rows` (`[N]`),
    `logits` is `[R, V]` and token i reads row `rows[i]`: rows that several tokens share are normalised once.
    """
    if rows is None:
        shape = logits.shape[:-1]
        flat = logits.reshape(-1, logits.shape[-1])
        rows = torch.arange(flat.shape[0], device=flat.device)
        logp, entropy = logprobs_and_entropy(flat, labels.reshape(-1), temperature, chunk_size, rows)
        return logp.reshape(shape), entropy.reshape(shape)
    lse, entropy = _ChunkedVocabStats.apply(logits, temperature, chunk_size)
    return logits[rows, labels].float() / temperature - lse[rows], entropy[rows]


def gather_logprobs(logits: Tensor, labels: Tensor, temperature: float = 1.0, chunk_size: int = 1024,
                    rows: Optional[Tensor] = None) -> Tensor:
    """`log_softmax(logits / temperature)[label]` per token (`logprobs_and_entropy` without the entropy)."""
    return logprobs_and_entropy(logits, labels, temperature, chunk_size, rows)[0]


class _ChunkedVocabStats(torch.autograd.Function):
    """(logsumexp, entropy) of each row of `[N, V]` logits in float32, chunk by chunk; only the logsumexp has a
    gradient. Its backward recomputes each chunk's softmax from the logits, so only the logits (which the model's
    output holds anyway) and the `[N]` logsumexp are saved; autograd's own would keep every chunk's float32 `[n, V]`."""

    @staticmethod
    def forward(ctx, logits: Tensor, temperature: float, chunk_size: int) -> tuple[Tensor, Tensor]:
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        entropy = torch.empty_like(lse)
        for i in range(0, logits.shape[0], chunk_size):
            lse[i : i + chunk_size], entropy[i : i + chunk_size] = VOCAB_KERNELS.call(
                "stats", logits[i : i + chunk_size], 1.0 / temperature)
        ctx.save_for_backward(logits, lse)
        ctx.mark_non_differentiable(entropy)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return lse, entropy

    @staticmethod
    def backward(ctx, grad_lse: Tensor, _grad_entropy: Tensor):
        logits, lse = ctx.saved_tensors
        n = ctx.chunk_size
        grad = torch.empty_like(logits)
        for i in range(0, logits.shape[0], n):
            grad[i : i + n] = VOCAB_KERNELS.call("grad", logits[i : i + n], lse[i : i + n], grad_lse[i : i + n],
                                                 1.0 / ctx.temperature)
        return grad, None, None
