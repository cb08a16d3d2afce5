"""The yardstick: TRL's GRPOTrainer on the same model, data, reward and group size as the pipeline, and the
time each takes to reach a reward, as a user starts each.

    python bench/trl_yardstick.py [--config configs/tiny_cpu.yaml] [--thresholds 0.5 0.7] [--skip-ours]
                                  [--trl-threads N] [--stall-seconds 120] [--stall-factor 10] [key=value ...]

Both start from the same warm-started embedded model (built before any clock starts) and run the config's
`total_iterations` steps of `rollout.batch_size` prompts x `rollout.gconfig.n_samples` samples, at the same
learning rate, temperature and completion length, with no KL term. Each clock starts when its command starts
(the interpreter, imports and set-up count, as a user waits for them):
- TRL: a Python process running GRPOTrainer (generating with `model.generate` in its own process);
- ours through the flow: `areal-pipeline train` (Prefect flow, temporary API server unless PREFECT_API_URL is
  set), a new interpreter; an iteration's reward is known when its `iter_<k>/metrics.json` is written (its mtime);
- ours, plain loop (`run_plain` in this process, start-up of servers and trainer included, no Prefect).
Needs the TRL the yardstick is measured against: `pip install --no-deps -r bench/requirements-trl.txt` (TRL 1.16.0;
accelerate is the project's own pin), or that file installed with `--target DIR` and DIR on PYTHONPATH to leave
the environment as it is; the versions a run used are in its figures (`trl_version`, `trl_accelerate_version`).
TRL's defaults that differ from the pipeline's are set explicitly (fp32, no gradient checkpointing: TRL's GRPOConfig
defaults to bf16 autocast and recomputed activations, which the pipeline's CPU trainer does not do).

Each side's progress is printed as it comes (a TRL step, a flow iteration's metrics.json, a plain iteration). A side
that makes no progress for `--stall-seconds` (120) or `--stall-factor` (10) times its slowest step so far, whichever
is longer, is stopped: its Python stacks (TRL's worker) and the tail of its output are printed and the bench exits 1
naming the side, its last step and the seconds waited. The last line is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

if "--trl-worker" in sys.argv:  # the bench asks a stalled worker for its threads' Python stacks (into its stderr)
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from time_to_reward import measure_pipeline, summary  # noqa: E402


def reward(completions, answer, **_) -> list[float]:
    from areal_pipeline.rewards import math_reward

    return [math_reward(c[0]["content"], a) for c, a in zip(completions, answer)]


def trl_worker(config: str, overrides: list[str], out_dir: Path) -> None:
    """The TRL run, in a process of its own: one line per step, `step <i> <unix time> <reward>`."""
    import accelerate
    import transformers
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from areal_pipeline.data.datasets import load_records
    from areal_pipeline.model import load_model, load_tokenizer, resolve_model_path
    from areal_pipeline.run_spec import load_config

    # the end of its imports (`trl_imports_seconds`) and the versions measured
    print(f"imported {time.time()} {trl.__version__} {accelerate.__version__} {transformers.__version__}", flush=True)
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
        # Set, not left to TRL's defaults (which TRL may change): as the pipeline's CPU trainer, fp32 weights and
        # no recomputed activations (GRPOConfig's defaults are bf16 autocast and gradient checkpointing, ~1.6x
        # the step on this model); one generation per update, used once; plain sampling; the clip range.
        bf16=False, fp16=False, gradient_checkpointing=False,
        steps_per_generation=1, num_iterations=1, epsilon=cfg.ppo.eps_clip,
        top_k=0, top_p=1.0, min_p=None, repetition_penalty=1.0, mask_truncated_completions=False,
        use_vllm=False, use_transformers_paged=False,
    )

    class Clock(TrainerCallback):
        def on_log(self, _args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                print(f"step {state.global_step} {time.time()} {logs['reward']}", flush=True)

    trainer = GRPOTrainer(model=load_model(model_path), reward_funcs=reward, args=args, train_dataset=data,
                          processing_class=load_tokenizer(model_path), callbacks=[Clock()])
    print(f"ready {time.time()}", flush=True)
    trainer.train()


class Watch:
    """One side's progress: each step printed as it comes; no step within the allowance stops the bench.

    The allowance is `stall_seconds`, or `stall_factor` times the slowest step so far if longer (a step's time
    counts from the previous step or mark, the worker's `ready`; a first step counted from the command's start is
    start-up, not a step)."""

    def __init__(self, side: str, stall_seconds: float, stall_factor: float):
        self.side, self.stall_seconds, self.stall_factor = side, stall_seconds, stall_factor
        self.started = self.last = time.time()
        self.slowest, self.steps, self.marked = 0.0, 0, False
        self.what = "its start"

    def mark(self, what: str, at: float) -> None:
        self.last, self.what, self.marked = at, what, True

    def step(self, i: int, at: float, reward: float) -> None:
        if self.steps or self.marked:
            self.slowest = max(self.slowest, at - self.last)
        self.last, self.steps = at, i
        self.what = f"step {i} (reward {reward:.3f}) at {at - self.started:.1f}s"
        print(f"{self.side} step {i:3d}  {at - self.started:7.1f}s  reward {reward:.3f}", flush=True)

    def allowance(self) -> float:
        return max(self.stall_seconds, self.stall_factor * self.slowest)

    def left(self) -> float:
        return self.last + self.allowance() - time.time()

    def stalled(self, cpu_seconds: Optional[float], details: str, waited: Optional[float] = None) -> SystemExit:
        waited = time.time() - self.last if waited is None else waited
        why = (f"{self.stall_factor:g}x its slowest step, {self.slowest:.1f}s" if self.allowance() > self.stall_seconds
               else f"--stall-seconds {self.stall_seconds:g}")
        cpu = ""
        if cpu_seconds is not None:
            busy = ("busy: a step far slower than before, or one that does not end" if cpu_seconds > 0.5 * waited
                    else "mostly idle: blocked or starved of CPU")
            cpu = (f"; in that wait its processes used {cpu_seconds:.0f} s of CPU ({100 * cpu_seconds / waited:.0f}% "
                   f"of a core, {busy})")
        return SystemExit(f"the {self.side} run stopped progressing: nothing for {waited:.0f} s after {self.what} "
                          f"(allowed {self.allowance():.1f} s: {why}){cpu}; it was stopped.\n{details}")


def _cpu_seconds(pid: int) -> Optional[float]:
    """CPU seconds used so far by a process and its children (None once it is gone)."""
    import psutil

    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
    except psutil.Error:
        return None
    total = 0.0
    for proc in procs:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def _stop(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM to the process group (SIGKILL without grace), SIGKILL after `grace` seconds."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM if grace else signal.SIGKILL)
            proc.wait(timeout=grace or 10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass


def _tail(path: Path, chars: int = 3000) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return text[-chars:]


def measure_trl(config: str, overrides: list[str], thresholds, threads: int, stall: tuple[float, float]) -> dict:
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    # as the pipeline's services get it (processes.py): idle OpenMP threads sleep rather than spin
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    err = Path(tempfile.mkdtemp(prefix="bench-trl-worker-")) / "stderr.txt"
    watch = Watch("trl", *stall)
    started = watch.started
    with open(err, "w") as err_file:
        proc = subprocess.Popen([sys.executable, __file__, "--trl-worker", "--config", config, *overrides],
                                stdout=subprocess.PIPE, stderr=err_file, text=True, env=env, start_new_session=True)
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    log, marks, versions = [], {}, []
    cpu_at_mark = 0.0
    try:  # its own session (its group killed on a stall): stopped here too when this process is interrupted
        while True:
            try:
                line = lines.get(timeout=max(0.0, watch.left()))
            except queue.Empty:
                cpu, waited = _cpu_seconds(proc.pid), time.time() - watch.last
                try:
                    os.kill(proc.pid, signal.SIGUSR1)  # faulthandler: its threads' Python stacks, into its stderr
                    time.sleep(2)
                except ProcessLookupError:
                    pass
                _stop(proc, grace=0)
                raise watch.stalled(None if cpu is None else cpu - cpu_at_mark,
                                    f"its stderr (stacks last):\n{_tail(err, 6000)}", waited) from None
            if line is None:
                break
            x = line.split()
            if not x:
                continue
            if x[0] in ("imported", "ready"):
                marks[x[0]] = float(x[1]) - started
                versions = x[2:] if x[0] == "imported" else versions
                watch.mark(f"its {x[0]} mark at {marks[x[0]]:.1f}s", float(x[1]))
            elif x[0] == "step":
                watch.step(int(x[1]), float(x[2]), float(x[3]))
                log.append((float(x[2]) - started, float(x[3])))
            else:
                continue
            cpu_at_mark = _cpu_seconds(proc.pid) or cpu_at_mark
    finally:
        _stop(proc, grace=0)
    if proc.wait() != 0 or not log:
        raise SystemExit(f"the TRL run failed (exit status {proc.returncode}, {len(log)} steps):\n{_tail(err)}")
    figures = summary("trl", [r for _, r in log], [s for s, _ in log], thresholds, marks["ready"])
    figures["trl_imports_seconds"] = round(marks["imported"], 2)
    if versions:
        figures.update(dict(zip(("trl_version", "trl_accelerate_version", "trl_transformers_version"), versions)))
    return figures


CLI = str(Path(sys.executable).with_name("areal-pipeline"))


def _iteration_done(run_dir: Path, k: int) -> Optional[tuple[float, float]]:
    """(the time its metrics.json was written, its reward) once iteration k has ended, else None."""
    path = run_dir / f"iter_{k}" / "metrics.json"
    try:
        return path.stat().st_mtime, json.loads(path.read_text())["reward_mean"]
    except (OSError, ValueError, KeyError):  # not there yet, or being written
        return None


def measure_flow(config: str, overrides: list[str], thresholds, env: dict, stall: tuple[float, float]) -> dict:
    """`areal-pipeline train` from its start: an iteration ends when its metrics.json is written."""
    from areal_pipeline.metrics import read_metrics
    from areal_pipeline.run_spec import load_config

    label = "flow"
    run_id = f"run_id=yardstick-{label}"
    cfg = load_config(config, [*overrides, run_id])
    out = Path(tempfile.mkdtemp(prefix="bench-flow-")) / "output.txt"
    watch = Watch(label, *stall)
    started = watch.started
    with open(out, "w") as out_file:
        proc = subprocess.Popen([CLI, "train", "--config", config, *overrides, run_id], stdout=out_file,
                                stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    cpu_at_mark, k = 0.0, 1
    try:  # its own session (its group stopped on a stall): stopped here too when this process is interrupted
        while proc.poll() is None or _iteration_done(cfg.run_dir, k):
            done = _iteration_done(cfg.run_dir, k)
            if done:
                watch.step(k, *done)
                k += 1
                cpu_at_mark = _cpu_seconds(proc.pid) or cpu_at_mark
            elif watch.left() <= 0:
                cpu, waited = _cpu_seconds(proc.pid), time.time() - watch.last
                _stop(proc, grace=30)
                raise watch.stalled(None if cpu is None else cpu - cpu_at_mark,
                                    f"its output's tail:\n{_tail(out)}", waited)
            else:
                time.sleep(0.2)
    finally:
        _stop(proc, grace=30)
    wall = time.time() - started
    if proc.returncode != 0:
        raise SystemExit(f"the flow run failed (exit status {proc.returncode}):\n{_tail(out, 6000)}")
    records = read_metrics(cfg.run_dir / "metrics.jsonl")
    seconds = [(cfg.run_dir / f"iter_{r['iteration']}" / "metrics.json").stat().st_mtime - started for r in records]
    rewards = [r["reward_mean"] for r in records]
    # start-up: until the first iteration's nodes began (its end less their time)
    first_nodes = sum(v for key, v in records[0].items() if key.startswith("time_"))
    return {**summary(label, rewards, seconds, thresholds, seconds[0] - first_nodes),
            f"{label}_command_seconds": round(wall, 2)}


def measure_plain(config: str, overrides: list[str], thresholds, stall: tuple[float, float]) -> dict:
    """The plain loop in this process (`time_to_reward.measure_pipeline`), watched by a thread: a stall ends the
    bench (its children killed, exit status 1)."""
    import psutil

    from areal_pipeline.run_spec import load_config

    run_dir = load_config(config, overrides).run_dir
    watch = Watch("plain", *stall)
    finished = threading.Event()

    def guard() -> None:
        k = 1
        while not finished.wait(0.5):
            done = _iteration_done(run_dir, k)
            if done:
                watch.step(k, *done)
                k += 1
            elif watch.left() <= 0:
                print(watch.stalled(None, "").code, file=sys.stderr, flush=True)
                for child in psutil.Process().children(recursive=True):
                    try:
                        child.kill()
                    except psutil.Error:
                        pass
                os._exit(1)

    threading.Thread(target=guard, daemon=True).start()
    try:
        return measure_pipeline(config, overrides, thresholds)
    finally:
        finished.set()


def main() -> None:
    from areal_pipeline.model import resolve_model_path
    from areal_pipeline.run_spec import load_config

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/tiny_cpu.yaml")
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.5, 0.7])
    p.add_argument("--skip-ours", action="store_true", help="only the TRL run")
    p.add_argument("--trl-threads", type=int, default=0,
                   help="torch threads of the TRL process (0: torch's default); on a busy machine 1 is faster")
    p.add_argument("--stall-seconds", type=float, default=120.0,
                   help="a side with no new step for this long (or --stall-factor times its slowest step, if longer) "
                        "is stopped and the bench fails")
    p.add_argument("--stall-factor", type=float, default=10.0)
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
    stall = (args.stall_seconds, args.stall_factor)
    figures.update(measure_trl(args.config, overrides, args.thresholds, args.trl_threads, stall))
    if not args.skip_ours:
        figures.update(measure_flow(args.config, overrides, args.thresholds, dict(os.environ), stall))
        figures.update(measure_plain(args.config, [*overrides, "run_id=yardstick-plain"], args.thresholds, stall))
        for t in args.thresholds:
            trl = figures[f"trl_seconds_to_reward_{t}"]
            for ours, name in (("flow", "speedup_flow"), ("ours", "speedup_plain")):
                mine = figures[f"{ours}_seconds_to_reward_{t}"]
                figures[f"{name}_to_reward_{t}"] = round(trl / mine, 2) if mine and trl else None
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
