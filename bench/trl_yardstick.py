"""The yardstick: TRL's GRPOTrainer on the same model, data, reward and group size as the pipeline, and the
time each takes to reach a reward.

    python bench/trl_yardstick.py [--config configs/tiny_cpu.yaml] [--thresholds 0.5 0.7] [--skip-ours]
                                  [--trl-threads N] [key=value ...]

Both start from the same warm-started embedded model (built before the clock starts) and run the config's
`total_iterations` steps of `rollout.batch_size` prompts x `rollout.gconfig.n_samples` samples, at the same
learning rate, temperature and completion length, with no KL term. TRL generates with `model.generate` in
its own process; the pipeline with its inference server. Needs `pip install --no-deps trl accelerate`.
The last line is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from time_to_reward import measure_pipeline, summary  # noqa: E402


def reward(completions, answer, **_) -> list[float]:
    from areal_pipeline.rewards import math_reward

    return [math_reward(c[0]["content"], a) for c, a in zip(completions, answer)]


def measure_trl(cfg, out_dir: Path, thresholds) -> dict:
    started = time.perf_counter()  # importing TRL counts, as the pipeline's start-up counts its processes'
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from areal_pipeline.data.datasets import load_records
    from areal_pipeline.model import load_model, load_tokenizer, resolve_model_path

    model_path = resolve_model_path(cfg.model, cfg.output_dir, cfg.seed)
    records = load_records(cfg.dataset, cfg.dataset.train_split, cfg.seed)
    data = Dataset.from_list([{"prompt": r["messages"], "answer": r["answer"]} for r in records])
    g = cfg.rollout.gconfig
    args = GRPOConfig(
        output_dir=str(out_dir), use_cpu=True, seed=cfg.seed, report_to="none", save_strategy="no",
        logging_steps=1, disable_tqdm=True, max_steps=cfg.total_iterations,
        per_device_train_batch_size=cfg.rollout.batch_size * g.n_samples, gradient_accumulation_steps=1,
        num_generations=g.n_samples, max_completion_length=g.max_new_tokens, temperature=g.temperature,
        learning_rate=cfg.trainer.optimizer.lr, lr_scheduler_type="constant_with_warmup",
        warmup_steps=int(cfg.trainer.optimizer.warmup_steps_proportion * cfg.total_iterations),
        weight_decay=cfg.trainer.optimizer.weight_decay, max_grad_norm=cfg.trainer.optimizer.gradient_clipping,
        beta=0.0, loss_type="dapo",  # token-level loss over the batch, as the pipeline's PPO loss
    )
    log: list[tuple[float, float]] = []

    class Clock(TrainerCallback):
        def on_log(self, _args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                log.append((time.perf_counter() - started, logs["reward"]))

    trainer = GRPOTrainer(model=load_model(model_path), reward_funcs=reward, args=args, train_dataset=data,
                          processing_class=load_tokenizer(model_path), callbacks=[Clock()])
    startup = time.perf_counter() - started
    trainer.train()
    rewards, seconds = [r for _, r in log], [s for s, _ in log]
    for i, (s, r) in enumerate(log, start=1):
        print(f"trl step {i:3d}  {s:7.1f}s  reward {r:.3f}")
    return summary("trl", rewards, seconds, thresholds, startup)


def main() -> None:
    import tempfile

    from areal_pipeline.config import load_config
    from areal_pipeline.model import resolve_model_path

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/tiny_cpu.yaml")
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.5, 0.7])
    p.add_argument("--skip-ours", action="store_true", help="only the TRL run")
    p.add_argument("--trl-threads", type=int, default=0,
                   help="torch threads of the TRL process (0: torch's default); on a busy machine 1 is faster")
    p.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-trl-"))
    # One model directory for both runs, built (warm start included) before any clock starts.
    overrides = [f"output_dir={work}", *args.overrides]
    cfg = load_config(args.config, overrides)
    started = time.perf_counter()
    resolve_model_path(cfg.model, cfg.output_dir, cfg.seed)
    figures = {"model_build_seconds": round(time.perf_counter() - started, 2)}
    if args.trl_threads:
        import torch

        torch.set_num_threads(args.trl_threads)
    figures.update(measure_trl(cfg, work / "trl", args.thresholds))
    if not args.skip_ours:
        figures.update(measure_pipeline(args.config, overrides, args.thresholds))
        for t in args.thresholds:
            ours, trl = figures[f"ours_seconds_to_reward_{t}"], figures[f"trl_seconds_to_reward_{t}"]
            figures[f"speedup_to_reward_{t}"] = round(trl / ours, 2) if ours and trl else None
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
