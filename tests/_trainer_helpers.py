"""What the trainer tests share: a rollout and batch with stale behaviour logprobs, the config, a plain forward
of the model, PPO written out by hand, and this process as a one-rank world."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from areal_pipeline.data.shards import write_shards
from areal_pipeline.data.trajectory import Trajectory
from areal_pipeline.model import load_model
from areal_pipeline.run_spec import load_config
from areal_pipeline.training.losses import gather_logprobs
from areal_pipeline.training.batches import write_batch
from areal_pipeline.utils import find_free_port

# Behaviour logprob = the model's + STALENESS[j % 4] on completion token j: PPO ratios exp(-offset) of 0.61 and
# 1.65 lie outside [0.8, 1.2] (a known share clipped on each side), 0.90 and 1.11 inside; all far enough from the
# bounds that no rounding moves a token across one. A batch of the model's own logprobs has ratio 1 everywhere,
# where the normalised advantages make every PPO loss about 0 whatever the engine computes.
STALENESS = (0.5, -0.5, 0.1, -0.1)


def make_batch(model_dir: Path, out: Path, seed: int, cfg, **rollout) -> Path:
    """`make_rollout`'s rollout turned into a batch by the advantages step."""
    write_batch(make_rollout(model_dir, out, seed, **rollout), out / "batch", cfg.ppo, run_id="t", iteration=0)
    return out / "batch"


def make_rollout(model_dir: Path, out: Path, seed: int, n_prompts: int = 6, group: int = 4,
                 prompt_lengths=(3, 12), completion_lengths=(1, 20), completion_vocab: int = 256,
                 staleness: tuple[float, ...] = STALENESS) -> Path:
    """Rollout shards of random completions with stale behaviour logprobs (`staleness`; () for the model's
    own)."""
    rng = random.Random(seed)
    model = load_model(model_dir)
    trajectories = []
    for p in range(n_prompts):
        prompt = [rng.randrange(256) for _ in range(rng.randrange(*prompt_lengths))]
        for k in range(group):
            completion = [rng.randrange(completion_vocab) for _ in range(rng.randrange(*completion_lengths))]
            ids = prompt + completion
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0]
            lp = gather_logprobs(logits[:-1], torch.tensor(ids[1:])).tolist()
            n = len(prompt)
            trajectories.append(Trajectory(
                prompt_id=f"p{p}", group_id=f"p{p}", sample_idx=k, input_ids=ids,
                loss_mask=[0] * n + [1] * len(completion),
                logprobs=[0.0] * n + [v + stale_offset(j, staleness) for j, v in enumerate(lp[n - 1:])],
                versions=[-1] * n + [0] * len(completion), reward=float(rng.random() < 0.5),
                stop_reason="stop"))
    write_shards(trajectories, out / "rollout", run_id="t", iteration=0)
    return out / "rollout"


def stale_offset(j: int, staleness: tuple[float, ...] = STALENESS) -> float:
    """What make_batch adds to the model's logprob of completion token j."""
    return staleness[j % len(staleness)] if staleness else 0.0


def trainer_config(tmp_path: Path, *overrides: str):
    return load_config(None, [f"output_dir={tmp_path}", "trainer.optimizer.lr=1e-3", "total_iterations=4",
                              "trainer.mb_max_tokens=96", *overrides])


def hand_ppo_loss(logprobs, old_logprobs, advantages, loss_mask, eps_clip: float) -> tuple[float, float]:
    """PPO's clipped objective written out token by token over per-sequence lists: (token-mean loss over the
    mask, share of the masked tokens where the clipped term wins)."""
    total, clipped, count = 0.0, 0, 0
    for lp_row, old_row, adv_row, mask_row in zip(logprobs, old_logprobs, advantages, loss_mask):
        for lp, old, adv, m in zip(lp_row, old_row, adv_row, mask_row):
            if not m:
                continue
            ratio = math.exp(lp - old)
            unclipped, bounded = -adv * ratio, -adv * min(max(ratio, 1 - eps_clip), 1 + eps_clip)
            total += max(unclipped, bounded)
            clipped += bounded > unclipped
            count += 1
    return total / count, clipped / count


def plain_logprobs(model_dir: Path, sequences: list[list[int]]) -> list[list[float]]:
    """Each sequence's per-token logprobs (0 at its first token) from one ordinary forward of the unsharded model."""
    model = load_model(model_dir)
    out = []
    with torch.no_grad():
        for ids in sequences:
            logits = model(torch.tensor([ids])).logits[0]
            out.append([0.0] + gather_logprobs(logits[:-1], torch.tensor(ids[1:])).tolist())
    return out


def weights(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "model.safetensors"))


@pytest.fixture(scope="module")
def single_process_group():
    """This test process as a world of one (real gloo), for in-process engine checks."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{find_free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
