"""Training throughput: trained tokens/s of one PPO update through the trainer process, packed vs padded
micro-batches, 1 vs 2 ranks (gloo on CPU, NCCL on GPU), and shared prompt prefixes on vs off.

    python bench/train_throughput.py [--trajectories 128] [--min-len 16] [--max-len 256] [--updates 3]

Lengths are spread uniformly (as agent trajectories are), which is where padding wastes compute; those
trajectories share no prompt. The shared-prefix variants train on GRPO-shaped batches instead: groups of
`--group` samples of one prompt (`--prompt-len` tokens) with short answers (up to `--answer-len`), as on the
default task, where the prompt is most of every sequence.
The last line is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from pathlib import Path

from areal_pipeline.config import load_config
from areal_pipeline.data.shards import write_shards
from areal_pipeline.data.trajectory import Trajectory
from areal_pipeline.model import build_tiny_model
from areal_pipeline.training.client import launch_trainer
from areal_pipeline.training.ppo import write_batch


def synthetic_batch(out: Path, n: int, min_len: int, max_len: int, cfg, seed: int = 0) -> Path:
    """Groups of 8 trajectories of random tokens, each with its own prompt and length."""
    rng = random.Random(seed)
    samples = []
    for _ in range(n):
        prompt_len = rng.randrange(8, 32)
        gen = max(1, rng.randrange(min_len, max_len + 1) - prompt_len)
        samples.append(([rng.randrange(256) for _ in range(prompt_len + gen)], prompt_len, rng.random() < 0.5))
    return _write_batch(out, samples, 8, cfg)


def grpo_batch(out: Path, n: int, group: int, prompt_len: int, answer_len: int, cfg, seed: int = 0) -> Path:
    """Groups of `group` trajectories that share their random prompt, with answers of 1..answer_len tokens."""
    rng = random.Random(seed)
    samples = []
    for _ in range(n // group):
        prompt = [rng.randrange(256) for _ in range(prompt_len)]
        for _ in range(group):
            answer = [rng.randrange(256) for _ in range(rng.randrange(1, answer_len + 1))]
            samples.append((prompt + answer, prompt_len, rng.random() < 0.5))
    return _write_batch(out, samples, group, cfg)


def _write_batch(out: Path, samples: list[tuple[list[int], int, bool]], group: int, cfg) -> Path:
    """(tokens, prompt length, rewarded) samples, `group` to a prompt id -> rollout and batch shards."""
    trajectories = []
    for i, (ids, n, rewarded) in enumerate(samples):
        gen = len(ids) - n
        trajectories.append(Trajectory(
            prompt_id=f"p{i // group}", group_id=f"p{i // group}", sample_idx=i % group, input_ids=ids,
            loss_mask=[0] * n + [1] * gen, logprobs=[0.0] * n + [-5.5] * gen, versions=[-1] * n + [0] * gen,
            reward=float(rewarded), stop_reason="stop"))
    write_shards(trajectories, out / "rollout", run_id="bench", iteration=0)
    write_batch(out / "rollout", out / "batch", cfg.ppo, run_id="bench", iteration=0)
    return out / "batch"


def measure(cfg, model_dir: str, batch_dir: Path, updates: int, log_dir: Path) -> float:
    process, client = launch_trainer(cfg, model_dir, log_dir)
    try:
        client.call("train", batch_dir=str(batch_dir), iteration=1)  # warm-up
        rates = [client.call("train", batch_dir=str(batch_dir), iteration=k)["stats"]["tokens_per_s"]
                 for k in range(2, 2 + updates)]
    finally:
        process.stop()
    return statistics.median(rates)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trajectories", type=int, default=128)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--updates", type=int, default=3)
    p.add_argument("--mb-max-tokens", type=int, default=4096)
    p.add_argument("--model", default="", help="HF model dir (default: the embedded tiny model)")
    p.add_argument("--group", type=int, default=8, help="samples per prompt of the GRPO-shaped batch")
    p.add_argument("--prompt-len", type=int, default=56, help="its prompt length (the default task's: ~55)")
    p.add_argument("--answer-len", type=int, default=8, help="its longest answer (the default task's: 8)")
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-train-"))
    model_dir = args.model or str(build_tiny_model(work / "tiny"))
    base = [f"output_dir={work}", f"total_iterations={args.updates + 1}",
            f"trainer.mb_max_tokens={args.mb_max_tokens}"]
    batch_dir = synthetic_batch(work, args.trajectories, args.min_len, args.max_len, load_config(None, base))
    grpo_dir = grpo_batch(work / "grpo", 2 * args.trajectories, args.group, args.prompt_len, args.answer_len,
                          load_config(None, base))
    variants = {
        "packed_1rank": (batch_dir, ["trainer.nproc=1"]),
        "padded_1rank": (batch_dir, ["trainer.nproc=1", "trainer.pack_sequences=false"]),
        "packed_2ranks": (batch_dir, ["trainer.nproc=2"]),
        "grpo_shared_prefix": (grpo_dir, ["trainer.nproc=1"]),
        "grpo_no_shared_prefix": (grpo_dir, ["trainer.nproc=1", "trainer.share_prefix=false"]),
    }
    rates = {}
    for name, (data, overrides) in variants.items():
        cfg = load_config(None, base + overrides)
        rates[name] = measure(cfg, model_dir, data, args.updates, work / name)
        print(f"{name}: {rates[name]:,.0f} trained tokens/s", flush=True)
    print(json.dumps({
        "trajectories": args.trajectories,
        "tokens_per_s": round(rates["packed_1rank"], 1),
        "padded_tokens_per_s": round(rates["padded_1rank"], 1),
        "two_ranks_tokens_per_s": round(rates["packed_2ranks"], 1),
        "packed_vs_padded": round(rates["packed_1rank"] / rates["padded_1rank"], 3),
        "two_ranks_vs_one": round(rates["packed_2ranks"] / rates["packed_1rank"], 3),
        "grpo_tokens_per_s": round(rates["grpo_shared_prefix"], 1),
        "shared_prefix_vs_not": round(rates["grpo_shared_prefix"] / rates["grpo_no_shared_prefix"], 3),
    }))


if __name__ == "__main__":
    main()
