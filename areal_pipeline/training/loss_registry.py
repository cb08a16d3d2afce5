"""The policy losses the trainer trains with: `ppo.loss` names one of `LOSSES`, or a user's own as "module:attr" or
"path/to/file.py:attr" (loaded by `user_code.load_attr`, as every extension point is).

A loss is made from the run's `ppo` config section by a builder, `build(ppo_cfg) -> Loss`:

    Loss.fn(logprobs, entropy, mb) -> (loss, stats)   per-token [N] tensors of a packed micro-batch `mb` (its
                                                      batch columns in `mb.tensors`); `stats`: name -> scalar
                                                      tensor, averaged into the update's record
    Loss.weight(mb) -> float                          the micro-batch's weight in the update's mean (e.g. its
                                                      number of loss tokens), so 1 and N ranks train alike
    Loss.columns                                      the per-token batch columns `fn` reads ("loss_mask",
                                                      "advantages", "logprobs", "prox_logprobs", ...)
    Loss.policy_columns                               those of `columns` that are the policy's own logprobs
                                                      before the update (a proximal policy, e.g. decoupled
                                                      PPO's "prox_logprobs"): the trainer fills them in, from
                                                      the training forward itself where the update is one
                                                      minibatch (its weights are still the pre-update ones),
                                                      else by a forward pass before the update

A loss of your own is a builder in your module, named in the config, with nothing of the package changed:

    # my_losses.py (importable where the run starts: its directory, or PYTHONPATH)
    from areal_pipeline.training.loss_registry import Loss
    from areal_pipeline.training.losses import reinforce_loss

    def clipped_reinforce(ppo_cfg) -> Loss:
        def fn(logprobs, entropy, mb):
            return reinforce_loss(logprobs, mb.tensors["advantages"].clamp(-1, 1), mb.tensors["loss_mask"])
        return Loss(fn, weight=lambda mb: float(mb.tensors["loss_mask"].sum()), columns=("loss_mask", "advantages"))

    areal-pipeline train --config configs/tiny_cpu.yaml ppo.loss=my_losses:clipped_reinforce

The registered builders below are written the same way, on the math of losses.py; their advantages are
advantage_registry.py's. This module imports no torch: the config names a loss before any trainer runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, NamedTuple

if TYPE_CHECKING:
    from areal_pipeline.training.packing import MicroBatch

LOSSES: dict[str, str] = {
    "ppo": "areal_pipeline.training.loss_registry:ppo",
    "reinforce": "areal_pipeline.training.loss_registry:reinforce",
}


class Loss(NamedTuple):
    fn: Callable[..., Any]
    weight: Callable[..., float]
    columns: tuple[str, ...]
    policy_columns: tuple[str, ...] = ()


def tokens_in_loss(mb: MicroBatch) -> float:
    """A micro-batch's weight in an update's mean: its loss tokens."""
    return float(mb.tensors["loss_mask"].sum())


def ppo(ppo_cfg) -> Loss:
    """PPO's clipped objective (`losses.ppo_actor_loss`), decoupled (a proximal policy between the behaviour and
    the current one) where `ppo_cfg.use_decoupled_loss` says so."""
    from areal_pipeline.training.losses import ppo_actor_loss

    decoupled = ppo_cfg.use_decoupled_loss
    uses_prox = decoupled or ppo_cfg.recompute_logprob

    def fn(logp, entropy, mb):
        t = mb.tensors
        # Without the decoupled loss, a recomputed logprob simply replaces the behaviour one as "old".
        old = t["prox_logprobs"] if uses_prox and not decoupled else t["logprobs"]
        return ppo_actor_loss(
            logp, old, t["advantages"], t["loss_mask"], eps_clip=ppo_cfg.eps_clip,
            eps_clip_higher=ppo_cfg.eps_clip_higher, c_clip=ppo_cfg.c_clip,
            proximal_logprobs=t["prox_logprobs"] if decoupled else None,
            behav_imp_weight_cap=ppo_cfg.behav_imp_weight_cap,
            importance_sampling_level=ppo_cfg.importance_sampling_level, seq_ids=mb.seq_ids)

    prox = ("prox_logprobs",) if uses_prox else ()
    return Loss(fn, tokens_in_loss, ("loss_mask", "logprobs", "advantages") + prox, policy_columns=prox)


def reinforce(ppo_cfg) -> Loss:
    """REINFORCE (`losses.reinforce_loss`): ReMax trains with it."""
    from areal_pipeline.training.losses import reinforce_loss

    def fn(logp, entropy, mb):
        return reinforce_loss(logp, mb.tensors["advantages"], mb.tensors["loss_mask"])
    return Loss(fn, tokens_in_loss, ("loss_mask", "advantages"))


def loss_builder(name: str) -> Callable[[Any], Loss]:
    """The builder `ppo.loss` names: a registered name, or "module:attr" / "path/to/file.py:attr" (user_code)."""
    from areal_pipeline.user_code import load_builder

    return load_builder(name, LOSSES, "ppo.loss", "loss", "areal_pipeline/training/loss_registry.py", "Loss")


def make_loss(ppo_cfg) -> Loss:
    """The loss `ppo_cfg.loss` names, built from `ppo_cfg`."""
    loss = loss_builder(ppo_cfg.loss)(ppo_cfg)
    if not isinstance(loss, Loss):
        raise TypeError(f"loss '{ppo_cfg.loss}': its builder returned {type(loss).__name__}, not a "
                        "loss_registry.Loss(fn, weight, columns)")
    if not set(loss.policy_columns) <= set(loss.columns):
        raise ValueError(f"loss '{ppo_cfg.loss}': policy_columns {loss.policy_columns} must be among its columns "
                         f"{loss.columns}")
    return loss
