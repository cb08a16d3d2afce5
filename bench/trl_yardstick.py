"""The yardstick: TRL's GRPOTrainer on the same model, data, reward and group size as the pipeline, and the
time each takes to reach a reward, as a user starts each.

    python bench/trl_yardstick.py [--config configs/tiny_cpu.yaml] [--thresholds 0.5 0.7] [--skip-ours]
                                  [--trl-threads N] [key=value ...]

Both start from the same warm-started embedded model (built before any clock starts) and run the config's
`total_iterations` steps of `rollout.batch_size` prompts x `rollout.gconfig.n_samples` samples, at the same
learning rate, temperature and completion length, with no KL term. Each clock starts when its command starts
(the interpreter, imports and set-up count, as a user waits for them):
- TRL: a Python process running GRPOTrainer (generating with `model.generate` in its own process);
- ours through the flow: `areal-pipeline train` (Prefect flow, temporary API server unless PREFECT_API_URL is
  set), a new interpreter; an iteration's reward is known when its `iter_<k>/metrics.json` is written (its mtime);
- ours, plain loop (`run_plain` in this process, start-up of servers and trainer included, no Prefect).
Needs `pip install --no-deps trl accelerate`. The last line is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from time_to_reward import measure_pipeline, summary  # noqa: E402


def reward(completions, answer, **_) -> list[float]:
    from areal_pipeline.rewards import math_reward

    return [math_reward(c[0]["content"], a) for c, a in zip(completions, answer)]


def trl_worker(config: str, overrides: list[str], out_dir: Path) -> None:
    """The TRL run, in a process of its own: one line per step, `step <i> <unix time> <reward>`."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from areal_pipeline.data.datasets import load_records
    from areal_pipeline.model import load_model, load_tokenizer, resolve_model_path
    from areal_pipeline.run_spec import load_config

    print(f"imported {time.time()}", flush=True)  # the end of its imports: `trl_imports_seconds`
    cfg = load_config(config, overrides)
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

    class Clock(TrainerCallback):
        def on_log(self, _args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                print(f"step {state.global_step} {time.time()} {logs['reward']}", flush=True)

    trainer = GRPOTrainer(model=load_model(model_path), reward_funcs=reward, args=args, train_dataset=data,
                          processing_class=load_tokenizer(model_path), callbacks=[Clock()])
    print(f"ready {time.time()}", flush=True)
    trainer.train()


def measure_trl(config: str, overrides: list[str], thresholds, threads: int) -> dict:
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    started = time.time()
    done = subprocess.run([sys.executable, __file__, "--trl-worker", "--config", config, *overrides],
                          capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the TRL run failed:\n{done.stderr[-3000:]}")
    lines = [line.split() for line in done.stdout.splitlines()]
    log = [(float(t) - started, float(r)) for word, _, t, r in (x for x in lines if x and x[0] == "step")]
    ready = next(float(x[1]) for x in lines if x and x[0] == "ready") - started
    imported = next(float(x[1]) for x in lines if x and x[0] == "imported") - started
    for i, (s, r) in enumerate(log, start=1):
        print(f"trl step {i:3d}  {s:7.1f}s  reward {r:.3f}")
    figures = summary("trl", [r for _, r in log], [s for s, _ in log], thresholds, ready)
    figures["trl_imports_seconds"] = round(imported, 2)
    return figures


CLI = str(Path(sys.executable).with_name("areal-pipeline"))


def measure_flow(config: str, overrides: list[str], thresholds, env: dict) -> dict:
    """`areal-pipeline train` from its start: an iteration ends when its metrics.json is written."""
    from areal_pipeline.metrics import read_metrics
    from areal_pipeline.run_spec import load_config

    label = "flow"
    run_id = f"run_id=yardstick-{label}"
    cfg = load_config(config, [*overrides, run_id])
    started = time.time()
    done = subprocess.run([CLI, "train", "--config", config, *overrides, run_id], capture_output=True, text=True,
                          check=False, env=env)
    wall = time.time() - started
    if done.returncode != 0:
        raise SystemExit(f"the flow run failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    records = read_metrics(cfg.run_dir / "metrics.jsonl")
    seconds = [(cfg.run_dir / f"iter_{r['iteration']}" / "metrics.json").stat().st_mtime - started for r in records]
    rewards = [r["reward_mean"] for r in records]
    for r, s in zip(records, seconds):
        print(f"{label} iteration {r['iteration']:3d}  {s:7.1f}s  reward {r['reward_mean']:.3f}")
    # start-up: until the first iteration's nodes began (its end less their time)
    first_nodes = sum(v for key, v in records[0].items() if key.startswith("time_"))
    return {**summary(label, rewards, seconds, thresholds, seconds[0] - first_nodes),
            f"{label}_command_seconds": round(wall, 2)}


def main() -> None:
    import tempfile

    from areal_pipeline.model import resolve_model_path
    from areal_pipeline.run_spec import load_config

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/tiny_cpu.yaml")
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.5, 0.7])
    p.add_argument("--skip-ours", action="store_true", help="only the TRL run")
    p.add_argument("--trl-threads", type=int, default=0,
                   help="torch threads of the TRL process (0: torch's default); on a busy machine 1 is faster")
    p.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = p.parse_args()
    if args.trl_worker:
        return trl_worker(args.config, args.overrides, Path(tempfile.mkdtemp(prefix="bench-trl-out-")))

    work = Path(tempfile.mkdtemp(prefix="bench-trl-"))
    # One model directory for all runs, built (warm start included) before any clock starts.
    overrides = [f"output_dir={work}", *args.overrides]
    cfg = load_config(args.config, overrides)
    started = time.perf_counter()
    resolve_model_path(cfg.model, cfg.output_dir, cfg.seed)
    figures = {"model_build_seconds": round(time.perf_counter() - started, 2)}
    figures.update(measure_trl(args.config, overrides, args.thresholds, args.trl_threads))
    if not args.skip_ours:
        figures.update(measure_flow(args.config, overrides, args.thresholds, dict(os.environ)))
        figures.update(measure_pipeline(args.config, [*overrides, "run_id=yardstick-plain"], args.thresholds))
        for t in args.thresholds:
            trl = figures[f"trl_seconds_to_reward_{t}"]
            for ours, name in (("flow", "speedup_flow"), ("ours", "speedup_plain")):
                mine = figures[f"{ours}_seconds_to_reward_{t}"]
                figures[f"{name}_to_reward_{t}"] = round(trl / mine, 2) if mine and trl else None
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
