"""GiGPO: group-in-group credit for multi-step agents (Feng et al. 2025, "Group-in-Group Policy Optimization for LLM
Agent Training"; verl-agent's `core_gigpo.py`).

GRPO gives every step of an episode the episode's advantage. GiGPO adds a step-level one: the steps of a group's
trajectories that act from the same environment state (an "anchor state") form a step group, and a step's discounted
return is compared with the others of its step group:

    A^E_i      = GRPO's episode advantage of trajectory i (its reward against its group's)
    R^i_t      = sum_{k >= t} gamma^(k - t) r^i_k                      r^i_k: the reward of step k (`step_rewards`)
    A^S_(i,t)  = (R^i_t - mean_{(j,u) ~ (i,t)} R^j_u) / F              (j,u) ~ (i,t): same prompt, same state
    A_(i,t)    = A^E_i + omega * A^S_(i,t)                              on every token of step t

F is the step group's standard deviation (`norm="std"`) or 1 (`norm="none"`, the paper's "mean_norm"). A step whose
state no other step of its group met has A^S = 0: there is nothing to compare it with.

Tensors are `[B, T]` over token positions. A step is a maximal run of generated tokens (`loss_mask` 1): a model turn,
between which the environment's tokens (mask 0) always stand. `step_states` holds, on each of a step's tokens, an
integer key of the state it acted from, and `step_rewards` the reward the environment gave the step; statistics count
each step once, whatever its length in tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor

from areal_pipeline.config import PPOConfig
from areal_pipeline.training.advantages import compute_advantages, normalize_advantages, segment_mean_std

NORMS = ("std", "none")


def step_starts(loss_mask: Tensor) -> Tensor:
    """`[B, T]` bool: the first token of each step (a generated token right after a non-generated one, or first)."""
    mask = loss_mask.bool()
    before = torch.nn.functional.pad(mask[:, :-1], (1, 0), value=False)
    return mask & ~before


def step_index(loss_mask: Tensor) -> Tensor:
    """`[B, T]` long: each generated token's step, numbered across the whole batch from 0 (-1 off steps)."""
    starts = step_starts(loss_mask).reshape(-1).long()
    index = torch.cumsum(starts, 0) - 1
    return torch.where(loss_mask.bool().reshape(-1), index, -1).reshape(loss_mask.shape)


def step_returns(step_rewards: Tensor, loss_mask: Tensor, gamma: float) -> tuple[Tensor, Tensor]:
    """`(returns, rows)`, one entry per step in batch order (`step_index`): each step's discounted return
    `R_t = r_t + gamma * R_{t+1}` within its row, and the row it belongs to."""
    starts = step_starts(loss_mask)
    rows = torch.arange(loss_mask.shape[0]).unsqueeze(1).expand_as(loss_mask)[starts]
    rewards = step_rewards[starts].double()
    returns = torch.zeros_like(rewards)
    following = 0.0
    for s in reversed(range(rewards.shape[0])):
        same_row = s + 1 < rewards.shape[0] and bool(rows[s + 1] == rows[s])
        following = float(rewards[s]) + (gamma * following if same_row else 0.0)
        returns[s] = following
    return returns, rows


def step_advantages(step_rewards: Tensor, step_states: Tensor, loss_mask: Tensor, group_ids: Tensor,
                    gamma: float = 0.95, norm: str = "std", eps: float = 1e-6) -> Tensor:
    """`A^S` on every generated token (0 elsewhere): each step's discounted return against its step group's (same
    group id, same state key), `(R - mean) / (std + eps)` with the unbiased std (`norm="std"`) or `R - mean`
    (`"none"`)."""
    if norm not in NORMS:
        raise ValueError(f"ppo.gigpo_norm must be one of {NORMS}, got {norm!r}")
    starts = step_starts(loss_mask)
    if not bool(starts.any()):
        return torch.zeros(loss_mask.shape, dtype=torch.float32)
    returns, rows = step_returns(step_rewards, loss_mask, gamma)
    keys = torch.stack([group_ids[rows].long(), step_states[starts].long()], dim=1)
    step_group = torch.unique(keys, dim=0, return_inverse=True)[1]
    count, mean, std = segment_mean_std(returns, torch.ones_like(returns), step_group)
    advantage = returns - mean
    if norm == "std":
        advantage = advantage / (std + eps)
    advantage = torch.where(count > 1, advantage, 0.0)
    index = step_index(loss_mask)
    per_token = advantage[index.clamp(min=0)]
    return torch.where(index >= 0, per_token, 0.0).to(torch.float32)


def combine(episode_advantages: Tensor, step_advantages_: Tensor, loss_mask: Tensor, omega: float) -> Tensor:
    """`A = A^E + omega * A^S` on generated tokens, 0 elsewhere."""
    return (episode_advantages + omega * step_advantages_) * loss_mask


def gigpo_advantages(batch: dict[str, Tensor], ppo_cfg: PPOConfig) -> dict[str, Tensor]:
    """`A = A^E + omega * A^S`, then `ppo.adv_norm`: A^E is GRPO's advantage (`compute_advantages` without
    `ppo.adv_norm`, which applies to the sum), A^S the step advantages. Needs `step_rewards` and `step_states`
    ([B, T]) in the batch: a workflow that records them."""
    missing = [name for name in ("step_rewards", "step_states") if batch.get(name) is None]
    if missing:
        raise ValueError("ppo.advantage=gigpo needs each step's state and return (step_states, step_rewards), and this "
                         "rollout has none: use a workflow that records them (rollout.workflow=grid_world, or your "
                         "own that sets Trajectory.step_states / step_rewards)")
    loss_mask = batch["loss_mask"].float()
    no_norm = dataclasses.replace(ppo_cfg.adv_norm, mean_level="none", std_level="none")
    out = compute_advantages(batch, dataclasses.replace(ppo_cfg, adv_norm=no_norm))
    step = step_advantages(batch["step_rewards"], batch["step_states"], loss_mask, batch["group_ids"],
                           ppo_cfg.gigpo_discount, ppo_cfg.gigpo_norm)
    advantages = combine(out["advantages"], step, loss_mask, ppo_cfg.gigpo_step_weight)
    out["step_advantages"] = step
    out["advantages"] = normalize_advantages(advantages, loss_mask, ppo_cfg.adv_norm, batch.get("group_ids"))
    return out


def anchor_key(state: str) -> int:
    """A state's integer key: stable across processes and runs (not Python's salted `hash`), within int64."""
    import hashlib

    return int.from_bytes(hashlib.blake2b(state.encode(), digest_size=8).digest(), "little") >> 1


def per_token(values: list[float], spans: list[tuple[int, int]], length: int,
              fill: Optional[float] = 0.0) -> list:
    """Per-token values: each step's value on its tokens (`spans`: [start, end) of each step), `fill` elsewhere."""
    if len(values) != len(spans):
        raise ValueError(f"{len(values)} step values for {len(spans)} steps")
    out = [fill] * length
    for (start, end), value in zip(spans, values):
        out[start:end] = [value] * (end - start)
    return out
