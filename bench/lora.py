"""LoRA against full fine-tuning on the same batches, through the trainer process: the update's time, what the
update keeps beside the weights, the reference, the push and the checkpoint.

    python bench/lora.py [--shape tiny] [--rank 8] [--updates 4] [--trajectories 64]
    python bench/lora.py --shape qwen2.5-0.5b --device cuda --trajectories 64 --prompt-len 512   (on a GPU)

For each of `full` and `lora` (trainer.lora.enabled, rank `--rank`, every linear layer): the median seconds of
`--updates` PPO updates after a warm-up one (GRPO-shaped batches, bench/train_throughput.py's), the trained
parameters and the bytes their gradients and Adam moments take (fp32: 3 x 4 bytes a parameter), the trainer ranks'
peak resident memory (VmHWM; on CUDA the update's peak GPU memory too), the reference logprobs' first call (full:
a second copy of the model loaded; LoRA: the actor with its adapters off), and the bytes and seconds of a push
(`save_weights`: the policy the servers load, merged with LoRA) and of a checkpoint (LoRA's: the adapters, their
optimizer state and the merged policy). The last line is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from train_throughput import build_model, grpo_batch  # noqa: E402


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def trainer_peak_rss_mib(process) -> float:
    """The largest VmHWM among the trainer's processes (its ranks), MiB."""
    import psutil

    peak = 0
    for proc in [psutil.Process(process.popen.pid), *psutil.Process(process.popen.pid).children(recursive=True)]:
        try:
            for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peak = max(peak, int(line.split()[1]))
        except OSError:
            continue
    return peak / 1024


def trained_parameters(model_dir: str, lora_cfg) -> int:
    from areal_pipeline.model import load_model
    from areal_pipeline.training import lora

    model = load_model(model_dir)
    if lora_cfg.enabled:
        model = lora.wrap(model, lora_cfg, seed=1)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def measure(cfg, model_dir: str, batch_dir: Path, rollout_dir: Path, updates: int, out: Path) -> dict:
    from areal_pipeline.training.client import launch_trainer

    process, client = launch_trainer(cfg, model_dir, out / "logs")
    try:
        client.call("train", batch_dir=str(batch_dir), iteration=1)  # warm-up
        stats = [client.call("train", batch_dir=str(batch_dir), iteration=k)["stats"]
                 for k in range(2, 2 + updates)]
        started = time.perf_counter()
        client.call("compute_logp", shard_dir=str(rollout_dir), out_path=str(out / "ref.parquet"), model="ref")
        reference_s = time.perf_counter() - started
        started = time.perf_counter()
        client.call("save_weights", path=str(out / "push"))
        push_s = time.perf_counter() - started
        started = time.perf_counter()
        client.call("save", path=str(out / "checkpoint"))
        checkpoint_s = time.perf_counter() - started
        peak_rss = trainer_peak_rss_mib(process)
    finally:
        process.stop()
    params = trained_parameters(model_dir, cfg.trainer.lora)
    peaks = [s["peak_memory_gib"] for s in stats if "peak_memory_gib" in s]
    adapter = out / "checkpoint" / "adapter"
    return {"update_s": round(statistics.median(s["seconds"] for s in stats), 4),
            "trained_params": params, "grad_and_adam_mib": round(params * 12 / 2**20, 2),
            "trainer_peak_rss_mib": round(peak_rss, 1),
            "peak_gpu_memory_gib": round(max(peaks), 2) if peaks else None,
            "reference_first_call_s": round(reference_s, 3),
            "push_bytes": directory_bytes(out / "push"), "push_s": round(push_s, 3),
            "checkpoint_bytes": directory_bytes(out / "checkpoint"), "checkpoint_s": round(checkpoint_s, 3),
            "adapter_bytes": directory_bytes(adapter) if adapter.is_dir() else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="tiny", choices=["tiny", "qwen2.5-0.5b"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--updates", type=int, default=4)
    p.add_argument("--trajectories", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--answer-len", type=int, default=8)
    args = p.parse_args()
    from areal_pipeline.run_spec import load_config

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = str(build_model(args.shape, root / "model"))
        base = [f"output_dir={root}", f"trainer.device={args.device}", "ppo.kl_ctl=0", "trainer.optimizer.lr=1e-4",
                "total_iterations=100"]
        cfg = load_config(None, base)
        batch_dir = grpo_batch(root / "data", args.trajectories, 8, args.prompt_len, args.answer_len, cfg)
        results = {}
        for variant, extra in (("full", []), ("lora", ["trainer.lora.enabled=true", f"trainer.lora.rank={args.rank}"])):
            variant_cfg = load_config(None, [*base, f"trainer.weights_dir={root}", *extra])
            results[variant] = measure(variant_cfg, model_dir, batch_dir, root / "data" / "rollout", args.updates,
                                       root / variant)
            r = results[variant]
            print(f"{variant}: update {r['update_s']:.3f} s, {r['trained_params']:,} trained parameters "
                  f"({r['grad_and_adam_mib']:.1f} MiB of gradients and Adam moments), trainer peak RSS "
                  f"{r['trainer_peak_rss_mib']:.0f} MiB, reference first call {r['reference_first_call_s']:.2f} s, "
                  f"push {r['push_bytes'] / 2**20:.1f} MiB in {r['push_s']:.2f} s, checkpoint "
                  f"{r['checkpoint_bytes'] / 2**20:.1f} MiB in {r['checkpoint_s']:.2f} s"
                  + (f" (adapter {r['adapter_bytes'] / 2**20:.2f} MiB)" if r["adapter_bytes"] else ""), flush=True)
        full, lora = results["full"], results["lora"]
        print(json.dumps({"shape": args.shape, "device": args.device, "rank": args.rank, **results,
                          "update_speedup": round(full["update_s"] / lora["update_s"], 2),
                          "trained_params_ratio": round(lora["trained_params"] / full["trained_params"], 4)}))


if __name__ == "__main__":
    main()
