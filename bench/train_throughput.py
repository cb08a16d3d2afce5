"""Training throughput: trained tokens/s of one PPO update through the trainer process, packed vs padded
micro-batches, 1 vs 2 ranks (gloo on CPU, NCCL on GPU), and shared prompt prefixes on vs off.

    python bench/train_throughput.py [--trajectories 128] [--min-len 16] [--max-len 256] [--updates 3]
    python bench/train_throughput.py --device cuda --shape qwen2.5-0.5b --min-len 4096 --max-len 4096 \
        --trajectories 64 --mb-max-tokens 16384 32768 --variants packed_1rank --profile-dir prof   (on a GPU)

Lengths are spread uniformly (as agent trajectories are), which is where padding wastes compute; those
trajectories share no prompt. The shared-prefix variants train on GRPO-shaped batches instead: groups of
`--group` samples of one prompt (`--prompt-len` tokens) with short answers (up to `--answer-len`), as on the
default task, where the prompt is most of every sequence.
`--shape qwen2.5-0.5b` trains a model of Qwen2.5-0.5B's shape (24 layers, hidden 896, vocab 151936) built from a
config with random weights (nothing downloaded); `--device cuda` trains in bfloat16 mixed precision (one rank: two
ranks on one GPU are refused) and adds the update's peak GPU memory and its MFU: model FLOPs per trained token,
6 x (non-embedding parameters + the output projection) + 12 x layers x hidden x mean sequence length (attention),
times tokens/s, over `--peak-tflops` (an H100 SXM's dense bfloat16: 989).
Several `--mb-max-tokens` measure each variant at each budget (`<variant>_mb<N>` in the figures; MFU and peak memory
per budget on a GPU). `--profile-dir DIR` profiles one more update of each measurement after the timed ones
(torch's profiler in the trainer, AREAL_TRAINER_PROFILE) and writes its operator table to DIR.
The last line is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from pathlib import Path
from typing import Optional

from areal_pipeline.data.shards import write_shards
from areal_pipeline.data.trajectory import Trajectory
from areal_pipeline.model import build_byte_tokenizer, build_tiny_model
from areal_pipeline.run_spec import load_config
from areal_pipeline.training.client import launch_trainer
from areal_pipeline.training.profiling import PROFILE_ENV, PROFILE_ITERATIONS_ENV
from areal_pipeline.utils import environment
from areal_pipeline.training.batches import write_batch


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


SHAPES = {  # Qwen2Config fields; vocab_size None: the byte tokenizer's
    "tiny": None,
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                         tie_word_embeddings=True),
}


def build_model(shape: str, out: Path) -> Path:
    """A model of `shape` with random weights, as a Hugging Face directory (the byte tokenizer beside it)."""
    if SHAPES[shape] is None:
        return build_tiny_model(out)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_byte_tokenizer()
    config = Qwen2Config(**SHAPES[shape], eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         torch_dtype="float32")
    Qwen2ForCausalLM(config).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def flops_per_token(model_dir: str, mean_length: float) -> float:
    """Training FLOPs per token: 6 x (non-embedding parameters + output projection) + 12 x L x h x mean length."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    head = c.head_dim if getattr(c, "head_dim", None) else c.hidden_size // c.num_attention_heads
    kv = c.num_key_value_heads * head
    per_layer = (c.hidden_size * (c.hidden_size + 2 * kv) + c.hidden_size * c.hidden_size  # q, k, v, o
                 + 3 * c.hidden_size * c.intermediate_size)  # gate, up, down
    dense = c.num_hidden_layers * per_layer + c.vocab_size * c.hidden_size
    return 6 * dense + 12 * c.num_hidden_layers * c.hidden_size * mean_length


def measure(cfg, model_dir: str, batch_dir: Path, updates: int, log_dir: Path,
            profile_dir: Optional[Path] = None) -> dict:
    """Median tokens/s over `updates` updates after a warm-up one, and the largest peak GPU memory (GiB);
    with `profile_dir`, one more update, profiled (not timed), whose operator table is written there."""
    profiled = 2 + updates
    env = {PROFILE_ENV: str(profile_dir), PROFILE_ITERATIONS_ENV: str(profiled)} if profile_dir else {}
    with environment(**env):  # the trainer process inherits them
        process, client = launch_trainer(cfg, model_dir, log_dir)
    try:
        client.call("train", batch_dir=str(batch_dir), iteration=1)  # warm-up
        stats = [client.call("train", batch_dir=str(batch_dir), iteration=k)["stats"] for k in range(2, 2 + updates)]
        if profile_dir:
            client.call("train", batch_dir=str(batch_dir), iteration=profiled)
    finally:
        process.stop()
    peaks = [s["peak_memory_gib"] for s in stats if "peak_memory_gib" in s]
    return {"tokens_per_s": statistics.median(s["tokens_per_s"] for s in stats),
            "peak_memory_gib": max(peaks) if peaks else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trajectories", type=int, default=128)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--updates", type=int, default=3)
    p.add_argument("--mb-max-tokens", type=int, nargs="+", default=[4096], help="micro-batch token budget(s)")
    p.add_argument("--model", default="", help="HF model dir (default: the embedded tiny model)")
    p.add_argument("--group", type=int, default=8, help="samples per prompt of the GRPO-shaped batch")
    p.add_argument("--prompt-len", type=int, default=56, help="its prompt length (the default task's: ~55)")
    p.add_argument("--answer-len", type=int, default=8, help="its longest answer (the default task's: 8)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--shape", default="tiny", choices=sorted(SHAPES), help="the model built when --model is not given")
    p.add_argument("--variants", nargs="+", default=None, help="which to measure (default: all that fit the device)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="the device's peak for MFU (H100 SXM bf16)")
    p.add_argument("--profile-dir", type=Path, default=None, help="profile one more update of each measurement")
    p.add_argument("overrides", nargs="*", help="config overrides for every variant, key=value (e.g. trainer.compile=false)")
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-train-"))
    model_dir = args.model or str(build_model(args.shape, work / args.shape))
    base = [f"output_dir={work}", f"total_iterations={args.updates + 2}", f"trainer.device={args.device}",
            *args.overrides]
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
    chosen = args.variants or [name for name in variants if args.device == "cpu" or name != "packed_2ranks"]
    unknown = sorted(set(chosen) - set(variants))
    if unknown:
        p.error(f"unknown variants {unknown}; valid: {', '.join(variants)}")
    results = {}
    budgets = args.mb_max_tokens
    for mb in budgets:
        for name in chosen:
            label = name if len(budgets) == 1 else f"{name}_mb{mb}"
            data, overrides = variants[name]
            cfg = load_config(None, base + overrides + [f"trainer.mb_max_tokens={mb}"])
            try:
                results[label] = measure(cfg, model_dir, data, args.updates, work / label,
                                         args.profile_dir / label if args.profile_dir else None)
            except Exception as e:  # e.g. out of memory at a large budget: the other measurements still count
                print(f"{label}: failed: {e}", flush=True)
                results[label] = {"tokens_per_s": None, "peak_memory_gib": None, "error": str(e)[-300:]}
                continue
            print(f"{label}: {results[label]['tokens_per_s']:,.0f} trained tokens/s"
                  + (f", peak {results[label]['peak_memory_gib']:.1f} GiB" if results[label]["peak_memory_gib"] else ""),
                  flush=True)
    rates = {name: r["tokens_per_s"] for name, r in results.items() if r["tokens_per_s"] is not None}
    figures = {"trajectories": args.trajectories, "device": args.device, "shape": args.model or args.shape,
               **({"overrides": args.overrides} if args.overrides else {}),
               **{f"{name}_tokens_per_s": round(rate, 1) for name, rate in rates.items()},
               **{f"{name}_error": r["error"] for name, r in results.items() if "error" in r}}
    for mb in budgets:
        label = "packed_1rank" if len(budgets) == 1 else f"packed_1rank_mb{mb}"
        if label not in rates:
            continue
        suffix = "" if mb == budgets[0] else f"_mb{mb}"
        figures["tokens_per_s" + suffix] = round(rates[label], 1)
        if args.device == "cuda":
            mean_length = (args.min_len + args.max_len) / 2
            flops = flops_per_token(model_dir, mean_length) * rates[label]
            figures["mfu" + suffix] = round(flops / (args.peak_tflops * 1e12), 4)
            figures["peak_memory_gib" + suffix] = round(results[label]["peak_memory_gib"], 2)
    for ratio, (a, b) in {"packed_vs_padded": ("packed_1rank", "padded_1rank"),
                          "two_ranks_vs_one": ("packed_2ranks", "packed_1rank"),
                          "shared_prefix_vs_not": ("grpo_shared_prefix", "grpo_no_shared_prefix")}.items():
        if len(budgets) == 1 and a in rates and b in rates:
            figures[ratio] = round(rates[a] / rates[b], 3)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
