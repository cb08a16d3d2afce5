"""How rewards become advantages, beside the loss (loss_registry.py): `ppo.advantage` names one of `ADVANTAGES`, or a
user's own as "module:attr" or "path/to/file.py:attr" (loaded by `user_code.load_attr`, as every extension point is).
An algorithm is a loss and/or an advantage plus a config. The registered advantages, for generated token t of
trajectory i (the math: advantages.py, gigpo.py), each then normalised by `ppo.adv_norm`:

    grpo    A_i,t = GAE_t(r_i,t)      r_i,t = -kl_ctl * KL_i,t, plus (r_i - mean_g r) / (std_g r + eps) on i's last
                                      token; g: i's group (the prompt's samples) or the batch, per `ppo.reward_norm`
    remax   A_i,t = r_i - r_greedy    r_greedy: the reward of the prompt's greedy completion
    gigpo   A_i,t = A^E_i,t + omega * A^S_i,t
                                      A^E: grpo's; A^S: the return of t's step against those of the steps of i's
                                      group taken from the same environment state

and the losses (loss_registry.py, math in losses.py): `ppo` (the clipped surrogate; GRPO is `grpo` with it, the
default) and `reinforce` (-A_i,t * log pi(token t); ReMax is `ppo.advantage: remax` with `ppo.loss: reinforce`,
configs/remax.yaml, on the ordinary single-turn workflow).

An advantage is made from the run's `ppo` config section by a builder, `build(ppo_cfg) -> Advantage`:

    Advantage.fn(batch) -> batch                      `batch`: one iteration's rollout as tensors, name -> tensor:
                                                      rewards [B], loss_mask [B, T], logprobs [B, T], group_ids [B]
                                                      (the rows of one prompt share one), no_eos [B], and where
                                                      present ref_logprobs [B, T] (ppo.kl_ctl != 0), token_returns
                                                      [B, T] (a workflow's per-turn returns), baseline_rewards [B],
                                                      step_states (int64) and step_rewards [B, T] (a multi-step
                                                      environment's states and step rewards: gigpo);
                                                      returns it with advantages, returns, token_rewards, kl [B, T]
                                                      and task_rewards [B] added (advantages.compute_advantages)
    Advantage.greedy_baseline                         True: the rollout plays one more episode per prompt, greedily,
                                                      whose reward each of the prompt's trajectories keeps as
                                                      `baseline_reward` (batch["baseline_rewards"]); it is not trained

A builder may carry `config_problems(cfg, key)`, yielding what it requires of the rest of the config (checked at load,
as a workflow's own). One of your own, named in the config, with nothing of the package changed:

    # my_advantages.py (importable where the run starts: its directory, or PYTHONPATH)
    from areal_pipeline.training.advantage_registry import Advantage
    from areal_pipeline.training.advantages import compute_advantages

    def clipped_grpo(ppo_cfg) -> Advantage:
        def fn(batch):
            out = compute_advantages(batch, ppo_cfg)
            return {**out, "advantages": out["advantages"].clamp(-2, 2)}
        return Advantage(fn)

    areal-pipeline train --config configs/tiny_cpu.yaml ppo.advantage=my_advantages:clipped_grpo

This module imports no torch: the config names an advantage before any trainer runs.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, NamedTuple

ADVANTAGES: dict[str, str] = {
    "grpo": "areal_pipeline.training.advantage_registry:grpo",
    "remax": "areal_pipeline.training.advantage_registry:remax",
    "gigpo": "areal_pipeline.training.advantage_registry:gigpo",
}


class Advantage(NamedTuple):
    fn: Callable[[dict[str, Any]], dict[str, Any]]
    greedy_baseline: bool = False


def grpo(ppo_cfg) -> Advantage:
    """The configurable default (AReaL's `compute_advantages`): rewards shaped (`ppo.reward_bias`, `reward_scaling`,
    `reward_clip`) and normalised per `ppo.reward_norm` (over the prompt's group: GRPO), a KL penalty per token
    (`ppo.kl_ctl`), GAE (`ppo.discount`, `ppo.gae_lambda`), then `ppo.adv_norm`. A workflow's per-turn returns
    (`token_returns`, multi_turn's) replace the shaped reward where given."""
    def fn(batch):
        from areal_pipeline.training.advantages import compute_advantages

        return compute_advantages(batch, ppo_cfg)
    return Advantage(fn)


def remax(ppo_cfg) -> Advantage:
    """ReMax (Li et al. 2023): the reward minus the reward of the prompt's greedy completion, on every generated
    token, unshaped (`advantages.remax_advantages`); the KL penalty and `ppo.adv_norm` as in `grpo`."""
    def fn(batch):
        from areal_pipeline.training.advantages import remax_advantages

        return remax_advantages(batch, ppo_cfg)
    return Advantage(fn, greedy_baseline=True)


def _remax_config_problems(cfg, key) -> Iterator[str]:
    """ReMax's advantages are unnormalised +-1 signals, for the REINFORCE loss; PPO's clipped ratio would clip them.
    Its greedy baseline episode is scored by the workflow, which a group score would replace for the others only."""
    if cfg.ppo.loss == "ppo":
        yield (f"{key('ppo.loss')}='ppo': must be reinforce (or a loss of your own, module:attr) with "
               f"{key('ppo.advantage')}=remax")
    if cfg.rollout.group_reward:
        yield (f"{key('rollout.group_reward')}={cfg.rollout.group_reward}: ReMax's baseline episode (its greedy "
               "completion) is scored by the workflow, not the group reward; use another "
               f"{key('ppo.advantage')}")


remax.config_problems = _remax_config_problems


def gigpo(ppo_cfg) -> Advantage:
    """GiGPO (Feng et al. 2025): GRPO's episode advantage plus `ppo.gigpo_step_weight` times a step-level one, each
    step's discounted return (`ppo.gigpo_discount`) against the steps of its group that acted from the same
    environment state (`gigpo.gigpo_advantages`); then `ppo.adv_norm`. Needs a workflow that records step states."""
    def fn(batch):
        from areal_pipeline.training.gigpo import gigpo_advantages

        return gigpo_advantages(batch, ppo_cfg)
    return Advantage(fn)


def _gigpo_config_problems(cfg, key) -> Iterator[str]:
    """GiGPO's step groups come from the environment's states: the workflow must record them."""
    from areal_pipeline.workflows import is_builtin

    if is_builtin(cfg.rollout.workflow) and cfg.rollout.workflow != "grid_world":
        yield (f"{key('ppo.advantage')}=gigpo needs a workflow that records each step's environment state; "
               f"{key('rollout.workflow')}={cfg.rollout.workflow!r} records none (grid_world does, or a workflow of "
               "your own that sets Trajectory.step_states and step_rewards)")
    if cfg.rollout.group_reward:
        yield (f"{key('ppo.advantage')}=gigpo with {key('rollout.group_reward')}={cfg.rollout.group_reward!r}: a group "
               "reward replaces each trajectory's reward, not the environment's step rewards GiGPO credits steps with")


gigpo.config_problems = _gigpo_config_problems


def advantage_builder(name: str) -> Callable[[Any], Advantage]:
    """The builder `ppo.advantage` names: a registered name, or "module:attr" / "path/to/file.py:attr" (user_code)."""
    from areal_pipeline.user_code import load_builder

    return load_builder(name, ADVANTAGES, "ppo.advantage", "advantage", "areal_pipeline/training/advantage_registry.py",
                        "Advantage")


def make_advantage(ppo_cfg) -> Advantage:
    """The advantage `ppo_cfg.advantage` names, built from `ppo_cfg`."""
    advantage = advantage_builder(ppo_cfg.advantage)(ppo_cfg)
    if not isinstance(advantage, Advantage):
        raise TypeError(f"advantage '{ppo_cfg.advantage}': its builder returned {type(advantage).__name__}, not an "
                        "advantage_registry.Advantage(fn, greedy_baseline=False)")
    return advantage


def advantage_config_problems(cfg, key) -> Iterator[str]:
    """What the selected advantage requires of the rest of the config (its builder's optional `config_problems`)."""
    config_problems = getattr(advantage_builder(cfg.ppo.advantage), "config_problems", None)
    if config_problems is not None:
        yield from config_problems(cfg, key)
