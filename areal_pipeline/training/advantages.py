"""Rewards -> per-token advantages, as AReaL's `PPOActor.compute_advantages` does.

Per-token tensors are `[B, T]`, indexed by token position in each trajectory's `input_ids`:
`logprobs[:, t] = log p(token t | tokens < t)` and `loss_mask[:, t] = 1` exactly on
model-generated tokens. Everything else (prompt, environment/tool turns, padding) has mask 0 and
is skipped by the recursions below, so a multi-turn episode is one decision sequence.

The pipeline, for one iteration's batch:

    r      = normalize_rewards(transform_rewards(rewards))          [B]
    kl     = kl_estimate(logprobs, ref_logprobs)                    [B, T]
    r_tok  = -kl_ctl * kl, plus r on each row's last generated token
    A, R   = GAE(r_tok, values) over generated tokens only
    A      = normalize_advantages(A)

A workflow's own per-token returns (`token_returns`, multi_turn's discounted per-turn rewards) and ReMax's
baseline-subtracted reward take the place of the shaped reward and its GAE (`returns_as_advantages`); GiGPO adds a
step-level term to this (gigpo.py). Which of these a run uses is `ppo.advantage` (advantage_registry.py).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor

from areal_pipeline.config import NormConfig, PPOConfig

_LEVELS = ("group", "batch", "none")
_KL_ESTIMATORS = ("k1", "k2", "k3")


def transform_rewards(r: Tensor, bias: float, scaling: float, clip: float) -> Tensor:
    """`clamp((r + bias) * scaling, -clip, clip)`."""
    return torch.clamp((r + bias) * scaling, -clip, clip)


def segment_mean_std(x: Tensor, w: Tensor, seg: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per element of flat `x`: count, mean and unbiased std of the weight-1 elements of its segment (a GRPO group,
    the batch, a GiGPO step group).

    Segments with fewer than two elements get std 0 (there is no spread to measure).
    """
    n = int(seg.max()) + 1
    count = x.new_zeros(n).index_add_(0, seg, w)[seg]
    mean = x.new_zeros(n).index_add_(0, seg, x * w)[seg] / count.clamp(min=1)
    sq_dev = x.new_zeros(n).index_add_(0, seg, w * (x - mean) ** 2)[seg]
    std = torch.where(count > 1, sq_dev / (count - 1).clamp(min=1), 0.0).sqrt()
    return count, mean, std


def _normalize(x: Tensor, mask: Tensor, group_ids: Optional[Tensor], cfg: NormConfig) -> Tensor:
    """`(x - mean) / (std + eps)` over the entries where `mask` is 1; entries outside stay 0.

    `group_ids` ([B]) labels the rows of `x` ([B] or [B, T]). A "none" level skips that part
    (no centring, or no division). Statistics are taken in float64.
    """
    for name in ("mean_level", "std_level"):
        level = getattr(cfg, name)
        if level not in _LEVELS:
            raise ValueError(f"{name} must be one of {_LEVELS}, got {level!r}")
        if level == "group" and group_ids is None:
            raise ValueError(f"{name}='group' needs group_ids")
    if x.numel() == 0:
        return x

    w = mask.double().reshape(-1)
    flat = torch.where(w > 0, x.detach().double().reshape(-1), 0.0)

    def segments(level: str) -> Tensor:
        if level == "batch":
            return torch.zeros_like(flat, dtype=torch.long)
        rows = group_ids.reshape(-1, *([1] * (x.dim() - 1))).expand_as(x).reshape(-1)
        return torch.unique(rows, return_inverse=True)[1]

    out = flat
    if cfg.mean_level != "none":
        count, mean, _ = segment_mean_std(flat, w, segments(cfg.mean_level))
        if cfg.mean_leave_one_out:
            # baseline_i = mean of the others = (n * mean - x_i) / (n - 1). A sample with no
            # peers keeps itself as baseline (advantage 0), as a plain mean of one would:
            # dividing a raw reward by the std of nothing would blow it up.
            others = (count * mean - flat) / (count - 1).clamp(min=1)
            mean = torch.where(count > 1, others, flat)
        out = out - mean
    if cfg.std_level != "none":
        _, _, std = segment_mean_std(flat, w, segments(cfg.std_level))
        out = out / (std + cfg.eps)
    return (out * w).reshape(x.shape).to(x.dtype)


def normalize_rewards(r: Tensor, group_ids: Optional[Tensor], cfg: NormConfig) -> Tensor:
    """Sequence rewards `[B]` -> `(r - mean) / (std + eps)`.

    The mean is over the sample's group (samples of one prompt), the whole batch, or nothing
    (`mean_level`); with `mean_leave_one_out` (RLOO) it is the mean of the *other* samples.
    The std (unbiased) is over the group, the batch, or nothing (`std_level`). A group of one
    sample gets advantage 0 under group-level centring, with or without leave-one-out.
    """
    return _normalize(r, torch.ones_like(r), group_ids, cfg)


def kl_estimate(logp: Tensor, ref_logp: Tensor, kind: str) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from a sample of pi (Schulman's k1, k2, k3).

    With `log_r = ref_logp - logp`:
        k1 = -log_r = logp - ref_logp
        k2 = 0.5 * log_r^2
        k3 = exp(log_r) - log_r - 1        (AReaL's "low_var_kl")
    k3's log-ratio is clamped to [-20, 20] and its value to at most 10, as AReaL does, so a
    token the reference finds far likelier cannot overflow the reward.
    """
    log_r = ref_logp - logp
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r**2
    if kind == "k3":
        log_r = log_r.clamp(-20.0, 20.0)
        return (log_r.exp() - log_r - 1).clamp(max=10.0)
    raise ValueError(f"kl estimator must be one of {_KL_ESTIMATORS}, got {kind!r}")


def _last_generated(loss_mask: Tensor) -> tuple[Tensor, Tensor]:
    """(index of each row's last generated token, whether the row has one)."""
    mask = loss_mask.bool()
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(mask, positions, -1).max(dim=-1).values.clamp(min=0), mask.any(dim=-1)


def token_rewards(
    task_reward: Tensor,
    kl: Tensor,
    loss_mask: Tensor,
    kl_ctl: float,
    no_eos: Optional[Tensor] = None,
    mask_no_eos_with_zero: bool = False,
) -> Tensor:
    """`r[b, t] = -kl_ctl * kl[b, t]` on generated tokens, `+ task_reward[b]` on row b's last one.

    With `mask_no_eos_with_zero`, rows that did not end with EOS (`no_eos`, i.e. truncated) get
    task reward 0: an unfinished answer is not judged.
    """
    rewards = -kl_ctl * kl * loss_mask
    if mask_no_eos_with_zero and no_eos is not None:
        task_reward = torch.where(no_eos.bool(), 0.0, task_reward)
    last, has_generated = _last_generated(loss_mask)
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    rewards[rows, last] += torch.where(has_generated, task_reward, 0.0).to(rewards.dtype)
    return rewards


def discounted_advantages(
    rewards: Tensor,
    values: Optional[Tensor],
    loss_mask: Tensor,
    discount: float,
    gae_lambda: float,
) -> tuple[Tensor, Tensor]:
    """GAE over the generated tokens of each row; returns `(advantages, returns)`.

    With t' the next generated token after t (tokens with loss_mask 0 are skipped):
        delta_t = r_t + discount * V_t' - V_t
        A_t     = delta_t + discount * gae_lambda * A_t'
    and V = A = 0 after the last generated token. `values=None` means V = 0 (critic-free GRPO).
    `returns = advantages + values`; advantages are 0 where loss_mask is 0.
    """
    if values is None:
        values = torch.zeros_like(rewards)
    mask = loss_mask.bool()
    advantages = torch.zeros_like(rewards)
    next_value = rewards.new_zeros(rewards.shape[0])
    next_adv = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + discount * next_value - values[:, t]
        adv = delta + discount * gae_lambda * next_adv
        m = mask[:, t]
        advantages[:, t] = torch.where(m, adv, 0.0)
        next_adv = torch.where(m, adv, next_adv)
        next_value = torch.where(m, values[:, t], next_value)
    return advantages, advantages + values


def normalize_advantages(
    adv: Tensor, loss_mask: Tensor, cfg: NormConfig, group_ids: Optional[Tensor] = None
) -> Tensor:
    """Token-level `(A - mean) / (std + eps)` over the generated tokens of the whole batch
    (level "batch") or of each group's rows (level "group", needs `group_ids` [B]).

    Masked-out positions stay 0 and do not enter the statistics.
    """
    return _normalize(adv, loss_mask, group_ids, cfg)


def compute_advantages(batch: dict[str, Tensor], cfg: PPOConfig) -> dict[str, Tensor]:
    """Add `advantages`, `returns`, `token_rewards`, `kl` ([B, T]) and `task_rewards` ([B]).

    Reads `rewards` [B], `loss_mask` [B, T], `logprobs` [B, T] (behaviour policy) and, when
    present, `ref_logprobs` [B, T], `values` [B, T], `group_ids` [B], `no_eos` [B], and `token_returns`
    [B, T], which take the place of the shaped rewards (`returns_as_advantages`).
    """
    if batch.get("token_returns") is not None:
        return returns_as_advantages(batch, batch["token_returns"], cfg)
    loss_mask = batch["loss_mask"].float()
    group_ids = batch.get("group_ids")

    task = transform_rewards(batch["rewards"].float(), cfg.reward_bias, cfg.reward_scaling, cfg.reward_clip)
    task = normalize_rewards(task, group_ids, cfg.reward_norm)

    ref_logprobs = batch.get("ref_logprobs")
    if ref_logprobs is None:
        if cfg.kl_ctl != 0:
            raise ValueError("kl_ctl != 0 needs ref_logprobs in the batch")
        kl = torch.zeros_like(loss_mask)
    else:
        kl = kl_estimate(batch["logprobs"].float(), ref_logprobs.float(), cfg.kl_estimator) * loss_mask

    rewards = token_rewards(task, kl, loss_mask, cfg.kl_ctl, batch.get("no_eos"), cfg.mask_no_eos_with_zero)
    advantages, returns = discounted_advantages(rewards, batch.get("values"), loss_mask, cfg.discount, cfg.gae_lambda)
    advantages = normalize_advantages(advantages, loss_mask, cfg.adv_norm, group_ids)
    return {
        **batch,
        "advantages": advantages,
        "returns": returns,
        "token_rewards": rewards,
        "kl": kl,
        "task_rewards": task,
    }


_NO_NORM = NormConfig(mean_level="none", std_level="none")


def returns_as_advantages(batch: dict[str, Tensor], token_returns: Tensor, cfg: PPOConfig) -> dict[str, Tensor]:
    """`compute_advantages` for returns already shaped and discounted per token ([B, T]): the trajectory reward gets
    no transform, normalisation or GAE; only the KL penalty (if any) still goes through GAE, and `cfg.adv_norm`
    applies to the sum. `task_rewards` are the raw rewards."""
    unshaped = dataclasses.replace(cfg, reward_bias=0.0, reward_scaling=1.0, reward_norm=_NO_NORM, adv_norm=_NO_NORM)
    plain = {key: value for key, value in batch.items() if key != "token_returns"}
    out = compute_advantages({**plain, "rewards": torch.zeros_like(batch["rewards"])}, unshaped)
    returns = token_returns * out["loss_mask"]
    out["advantages"] = normalize_advantages(out["advantages"] + returns, out["loss_mask"], cfg.adv_norm,
                                             batch.get("group_ids"))
    out["returns"] = out["returns"] + returns
    out["rewards"] = out["task_rewards"] = batch["rewards"]
    return out


def remax_advantages(batch: dict[str, Tensor], cfg: PPOConfig) -> dict[str, Tensor]:
    """ReMax: `rewards - baseline_rewards` (the prompt's greedy completion's reward) on every generated token, as
    returns (`returns_as_advantages`): unshaped, undiscounted; `cfg.adv_norm` still applies."""
    if batch.get("token_returns") is not None:
        raise ValueError("ppo.advantage=remax takes one reward per trajectory, but the workflow gave per-turn returns "
                         "(token_returns): use it with a single-reward workflow (rlvr), or ppo.advantage=grpo")
    baseline = batch.get("baseline_rewards")
    if baseline is None:
        raise ValueError("ppo.advantage=remax needs each trajectory's baseline_reward (the rollout's greedy episode of "
                         "its prompt), and this rollout has none: it was not rolled out with ppo.advantage=remax")
    advantage = batch["rewards"].float() - baseline.float()
    return returns_as_advantages(batch, advantage[:, None] * batch["loss_mask"].float(), cfg)


def advantage_stats(batch: dict[str, Tensor]) -> dict[str, float]:
    """Logging figures from `compute_advantages`' output: raw reward mean/std over sequences,
    advantage mean/std/min/max and KL mean over generated tokens (0.0 when there are none)."""
    rewards = batch["rewards"].double()
    mask = batch["loss_mask"].bool()
    adv = batch["advantages"][mask].double()
    kl = batch["kl"][mask].double()

    def _or_zero(x: Tensor, fn) -> float:
        return float(fn(x)) if x.numel() else 0.0

    return {
        "reward_mean": _or_zero(rewards, torch.mean),
        "reward_std": _or_zero(rewards, lambda x: x.std(correction=0)),
        "advantage_mean": _or_zero(adv, torch.mean),
        "advantage_std": _or_zero(adv, lambda x: x.std(correction=0)),
        "advantage_min": _or_zero(adv, torch.min),
        "advantage_max": _or_zero(adv, torch.max),
        "kl_mean": _or_zero(kl, torch.mean),
    }
