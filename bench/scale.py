"""How an iteration's cost grows with the batch: one iteration of the default task through the Prefect flow at
`--prompts` prompts x `--samples` samples, against each of `--servers` inference servers.

    python bench/scale.py [--prompts 32 256 1024 4096] [--servers 1 2 4] [--samples 8] [--profile] [overrides ...]

Each point is a fresh run directory and a process of its own (its peak memory is that point's), which runs the
`train` flow in process, as `areal-pipeline train` does, against a temporary Prefect API server; the embedded model
and the data set are built before any point starts. The figures cover the iteration alone, from the start of the
iteration's child flow run to its report (`flows.overlap.run_iterations`), set-up and teardown excluded:
- wall seconds and episodes per second;
- CPU per episode of the orchestrating process (getrusage: all its threads) and of its whole process tree (the API
  server, inference servers, trainer, reward workers);
- the Prefect API requests and events of the iteration;
- files written under the run directory: those created or changed (a walk before and after the iteration), plus
  the episode journal's segment files, which the iteration deletes again before it ends (`journal_records`: the
  groups appended to them); and the process's fsyncs
  and renames (`os.fsync`, `os.replace`): a shared file system's metadata traffic;
- the orchestrating process's peak RSS (its whole life; set-up's part is the same at every size).
Episode counts are prompts x samples. `--profile`: py-spy (`pip install --target /tmp/pyspy py-spy`, or on PATH)
samples the orchestrating process during the iteration of the largest point with the fewest servers (py-spy's own
CPU then competes with that point's processes); its collapsed stacks are written beside the run, and the leaf
functions with the most samples printed.
The last line is one JSON object: every point, and `cpu_per_episode_growth` and `files_per_episode_growth`, the
one-server figures per episode at 4096 prompts against 256 (or at the largest size measured, named in `growth_of`).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

BASE_OVERRIDES = ["total_iterations=1", "eval_freq=0", "save_freq=1000000", "iterations_per_flow_run=1"]


def files_under(root: Path) -> dict[str, int]:
    """Every file under `root`, with its modification time."""
    found = {}
    for directory, _, names in os.walk(root):
        for name in names:
            path = os.path.join(directory, name)
            try:
                found[path] = os.stat(path).st_mtime_ns
            except FileNotFoundError:  # removed while walked
                pass
    return found


def tree_cpu_seconds(skip: set[int]) -> dict[int, float]:
    me = psutil.Process()
    seconds = {}
    for proc in me.children(recursive=True):
        if proc.pid in skip:
            continue
        try:
            times = proc.cpu_times()
            seconds[proc.pid] = times.user + times.system
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return seconds


def self_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure_point(args) -> None:
    """One point, in this process: its figures as the last line."""
    import flows  # noqa: F401  (the project's Prefect defaults, before Prefect is imported)
    import areal_pipeline.rollout.journal as journal_module
    from areal_pipeline.rollout.journal import EpisodeJournal
    from flows import overlap
    from flows.api_server import prefect_api
    from flows.train import train
    from orchestration_overhead import APICalls  # bench/ is this script's directory, first on sys.path

    prompts, servers = args.point
    run_id = f"p{prompts}-s{servers}"
    run_dir = Path(args.work) / run_id
    calls, counts, figures = APICalls(), collections.Counter(), {}
    counting = [False]

    def counted(name, call):
        def wrapper(*a, **kw):
            if counting[0]:
                counts[name] += 1
            return call(*a, **kw)
        return wrapper

    os.fsync, os.replace = counted("fsyncs", os.fsync), counted("renames", os.replace)
    journal_module._new_segment = counted("journal_files", journal_module._new_segment)  # a segment: a file
    EpisodeJournal.write = counted("journal_records", EpisodeJournal.write)  # a group appended to one
    run_iterations = overlap.run_iterations

    def measured_iterations(*a, **kw):
        profiler = start_profiler(run_dir.with_suffix(".pyspy.txt")) if args.profile else None
        before, tree_before = files_under(run_dir), tree_cpu_seconds({profiler.pid} if profiler else set())
        calls.requests.clear(), calls.events.clear(), counts.clear()
        counting[0] = calls.counting = True
        cpu_before, started = self_cpu_seconds(), time.perf_counter()
        try:
            return run_iterations(*a, **kw)
        finally:
            wall, cpu = time.perf_counter() - started, self_cpu_seconds() - cpu_before
            counting[0] = calls.counting = False
            tree_after = tree_cpu_seconds({profiler.pid} if profiler else set())
            if profiler is not None:
                profiler.send_signal(signal.SIGINT)
                profiler.wait(60)
            after = files_under(run_dir)
            changed = sum(1 for path, mtime in after.items() if before.get(path) != mtime)
            episodes = prompts * args.samples
            tree = cpu + sum(t - tree_before.get(pid, 0.0) for pid, t in tree_after.items())
            figures.update({
                "prompts": prompts, "servers": servers, "episodes": episodes, "wall_s": round(wall, 2),
                "episodes_per_s": round(episodes / wall, 1),
                "cpu_s": round(cpu, 2), "cpu_ms_per_episode": round(1000 * cpu / episodes, 3),
                "tree_cpu_ms_per_episode": round(1000 * tree / episodes, 3),
                "api_requests": sum(calls.requests.values()), "events": sum(calls.events.values()),
                "files_written": changed + counts["journal_files"], "journal_files": counts["journal_files"],
                "journal_records": counts["journal_records"],
                "files_left": len(after) - len(before), "fsyncs": counts["fsyncs"], "renames": counts["renames"],
                "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                "requests_by_route": dict(calls.requests.most_common(8)),
            })
            figures["files_per_episode"] = round(figures["files_written"] / episodes, 4)

    overlap.run_iterations = measured_iterations
    overrides = [f"output_dir={args.work}", f"run_id={run_id}", *BASE_OVERRIDES, f"rollout.batch_size={prompts}",
                 f"rollout.gconfig.n_samples={args.samples}", f"inference.num_servers={servers}", *args.overrides]
    with prefect_api():
        train(config_path=args.config, overrides=overrides)
    metrics = json.loads((run_dir / "iter_1" / "metrics.json").read_text())
    figures["reward_mean"] = metrics.get("reward_mean")
    print(json.dumps(figures), flush=True)


def start_profiler(output: Path) -> subprocess.Popen:
    """py-spy sampling this process (every thread, without pausing it) until SIGINT."""
    spy = shutil.which("py-spy") or "/tmp/pyspy/bin/py-spy"
    env = {**os.environ, "PYTHONPATH": "/tmp/pyspy"}
    proc = subprocess.Popen([spy, "record", "--pid", str(os.getpid()), "--rate", "100", "--nonblocking",
                             "--format", "raw", "--output", str(output)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1)  # attached before the iteration starts
    return proc


def top_leaves(collapsed: Path, count: int = 15) -> list[tuple[str, float]]:
    """The functions py-spy found on top of the stack most often, with their share of the samples."""
    leaves, total = collections.Counter(), 0
    for line in collapsed.read_text().splitlines():
        stack, _, samples = line.rpartition(" ")
        leaves[stack.split(";")[-1]] += int(samples)
        total += int(samples)
    return [(name, round(n / total, 3)) for name, n in leaves.most_common(count)]


def growth(points: list[dict]) -> dict:
    one = {p["prompts"]: p for p in points if p["servers"] == 1}
    if 256 not in one or max(one) <= 256:
        return {}
    top = 4096 if 4096 in one else max(one)
    return {"growth_of": f"{top} against 256 prompts, 1 server",
            "cpu_per_episode_growth": round(one[top]["cpu_ms_per_episode"] / one[256]["cpu_ms_per_episode"], 3),
            "files_per_episode_growth": round(one[top]["files_per_episode"] / one[256]["files_per_episode"], 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/tiny_cpu.yaml")
    p.add_argument("--prompts", type=int, nargs="+", default=[32, 256, 1024, 4096])
    p.add_argument("--servers", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--profile", action="store_true", help="py-spy the largest one-server point's iteration")
    p.add_argument("--point", type=int, nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    if args.point:
        return measure_point(args)

    from areal_pipeline.model import resolve_model_path
    from areal_pipeline.pipeline import Pipeline
    from areal_pipeline.run_spec import load_config

    work = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    cfg = load_config(args.config, [f"output_dir={work}", *args.overrides])
    resolve_model_path(cfg.model, cfg.output_dir, cfg.seed)  # the embedded model, built once for every point
    Pipeline(cfg).prepare_dataset()
    points, largest = [], max(args.prompts)
    for prompts in sorted(args.prompts):
        for servers in sorted(args.servers):
            profiled = args.profile and prompts == largest and servers == min(args.servers)
            command = [sys.executable, __file__, "--point", str(prompts), str(servers), "--work", str(work),
                       "--config", args.config, "--samples", str(args.samples), *(["--profile"] if profiled else []),
                       *args.overrides]
            log = work / f"p{prompts}-s{servers}.log"
            with open(log, "w") as out:
                done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT)
            lines = log.read_text().splitlines()
            if done.returncode != 0 or not lines:
                raise SystemExit(f"point {prompts} prompts, {servers} servers failed (log {log}):\n"
                                 + "\n".join(lines[-30:]))
            point = json.loads(lines[-1])
            points.append(point)
            print(f"{prompts} prompts x {args.samples}, {servers} server(s): "
                  + ", ".join(f"{k} {v}" for k, v in point.items() if k not in ("prompts", "servers")), flush=True)
            if profiled:
                print("py-spy, leaf functions by share of samples: "
                      + json.dumps(top_leaves(work / f"p{prompts}-s{servers}.pyspy.txt")), flush=True)
    print(json.dumps({"samples": args.samples, "load_after": round(os.getloadavg()[0], 2), "points": points,
                      **growth(points)}))


if __name__ == "__main__":
    main()
