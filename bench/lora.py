"""LoRA against full fine-tuning on the same batches, through the trainer process: the update's time, what the
update keeps beside the weights, the reference, the push and the checkpoint.

    python bench/lora.py [--shape tiny] [--rank 8] [--updates 4] [--trajectories 64]
    python bench/lora.py --shape qwen2.5-0.5b --device cuda --trajectories 64 --prompt-len 512   (on a GPU)

For each of `full` and `lora` (trainer.lora.enabled, rank `--rank`, every linear layer): the median seconds of
`--updates` PPO updates after a warm-up one (GRPO-shaped batches, bench/train_throughput.py's), the trained
parameters and the bytes their gradients and Adam moments take (fp32: 3 x 4 bytes a parameter), the trainer ranks'
peak resident memory (VmHWM; on CUDA the update's peak GPU memory too), the reference logprobs' first call (full:
a second copy of the model loaded; LoRA: the actor with its adapters off), the bytes and seconds of a checkpoint
(LoRA's: the adapters, their optimizer state and the merged policy), and `--pushes` pushes to a real CPU server as a
run makes them (disk sync, trainer.lora.push=auto): full fine-tuning writes and loads the whole model, LoRA the
adapter alone (the server merges it into its base), each followed by the probe that verifies it (the served
logprobs against the trainer's). The last line is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import asyncio
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


def measure_pushes(cfg, model_dir: str, client, batch_dir: Path, out: Path, count: int) -> dict:
    """`count` pushes of new versions to a CPU server the way a run makes them, each verified: the median seconds of
    the trainer's write, the server's load and the probe, the bytes sent and the probe's largest mean difference."""
    from areal_pipeline.config import adapter_push
    from areal_pipeline.inference.adapters import ServedAdapter
    from areal_pipeline.inference.backend import engine_for
    from areal_pipeline.inference.launcher import launch_servers
    from areal_pipeline.inference.weight_check import probe_ids, verify_served
    from areal_pipeline.model import load_tokenizer

    adapter = adapter_push(cfg)
    (server,) = launch_servers(model_dir, cfg.inference, 1, out / "logs", experiment=cfg)
    probe = probe_ids(load_tokenizer(model_dir))
    write_s, load_s, probe_s, sent, diffs = [], [], [], [], []

    async def pushes() -> None:  # one event loop: the client's connections belong to it
        engine = engine_for([server.address], cfg.inference, adapter=ServedAdapter() if adapter else None)
        try:
            first = (await asyncio.to_thread(client.call, "status"))["version"] + 1
            for k in range(first, first + count):
                await asyncio.to_thread(client.call, "train", batch_dir=str(batch_dir), iteration=k)
                path = Path(cfg.trainer.weights_dir) / f"v{k}"
                started = time.perf_counter()
                await asyncio.to_thread(client.call, "save_adapter" if adapter else "save_weights", path=str(path))
                write_s.append(time.perf_counter() - started)
                sent.append(directory_bytes(path))
                started = time.perf_counter()
                await engine.update_weights(str(path), k)
                load_s.append(time.perf_counter() - started)
                started = time.perf_counter()
                expected = (await asyncio.to_thread(client.call, "probe_logp", input_ids=probe))["logprobs"]
                diffs.append(max((await verify_served(engine, probe, expected, k, 1e-3)).values()))
                probe_s.append(time.perf_counter() - started)
        finally:
            await engine.close()
    try:
        asyncio.run(pushes())
    finally:
        server.stop()
    return {"push": "adapter" if adapter else "full weights", "push_bytes": statistics.median(sent),
            "push_write_s": round(statistics.median(write_s), 4), "push_load_s": round(statistics.median(load_s), 4),
            "probe_s": round(statistics.median(probe_s), 4), "probe_max_mean_diff": max(diffs)}


def measure(cfg, model_dir: str, batch_dir: Path, rollout_dir: Path, updates: int, out: Path, count: int) -> dict:
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
        client.call("save", path=str(out / "checkpoint"))
        checkpoint_s = time.perf_counter() - started
        pushes = measure_pushes(cfg, model_dir, client, batch_dir, out, count)
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
            "reference_first_call_s": round(reference_s, 3), **pushes,
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
    p.add_argument("--pushes", type=int, default=5, help="pushes to a CPU server, each verified")
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
            variant_cfg = load_config(None, [*base, f"trainer.weights_dir={root / variant / 'weights'}", *extra])
            results[variant] = measure(variant_cfg, model_dir, batch_dir, root / "data" / "rollout", args.updates,
                                       root / variant, args.pushes)
            r = results[variant]
            print(f"{variant}: update {r['update_s']:.3f} s, {r['trained_params']:,} trained parameters "
                  f"({r['grad_and_adam_mib']:.1f} MiB of gradients and Adam moments), trainer peak RSS "
                  f"{r['trainer_peak_rss_mib']:.0f} MiB, reference first call {r['reference_first_call_s']:.2f} s, "
                  f"push ({r['push']}) {r['push_bytes'] / 2**20:.2f} MiB: written {r['push_write_s']:.3f} s, "
                  f"loaded {r['push_load_s']:.3f} s, verified {r['probe_s']:.3f} s (probe {r['probe_max_mean_diff']:.2g}), "
                  f"checkpoint "
                  f"{r['checkpoint_bytes'] / 2**20:.1f} MiB in {r['checkpoint_s']:.2f} s"
                  + (f" (adapter {r['adapter_bytes'] / 2**20:.2f} MiB)" if r["adapter_bytes"] else ""), flush=True)
        full, lora = results["full"], results["lora"]
        print(json.dumps({"shape": args.shape, "device": args.device, "rank": args.rank, **results,
                          "update_speedup": round(full["update_s"] / lora["update_s"], 2),
                          "push_bytes_ratio": round(lora["push_bytes"] / full["push_bytes"], 4),
                          "push_speedup": round((full["push_write_s"] + full["push_load_s"])
                                                / (lora["push_write_s"] + lora["push_load_s"]), 2),
                          "trained_params_ratio": round(lora["trained_params"] / full["trained_params"], 4)}))


if __name__ == "__main__":
    main()
