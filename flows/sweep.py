"""The `sweep` flow: one `train` flow run per combination of config values, at most `max_parallel` at once.

    areal-pipeline sweep --config C trainer.optimizer.lr=1e-3,5e-4 rollout.gconfig.n_samples=4,8 --max-parallel 2

Each combination is its own run (`<base>-lr=1e-3-n_samples=4`: its own run directory, run lock and flow run) and
runs in a process of its own, as a worker runs a deployment's flow run: the sweep's task for it creates the
`train` flow run through the API, as a child of that task (the UI shows the train runs under the sweep), and
starts `python -c "from flows.sweep import child_main; child_main()"`, which runs exactly that flow run
(flows/created_runs.py).

Why processes and not subflow calls in threads of this process: a train run is a process-sized thing. It keeps
an inference server, a trainer and a Prefect client busy from one interpreter, so runs in threads of one process
would share one GIL (each run's rollout client and Prefect bookkeeping waiting on the others'); stop signals reach
only the main thread, which is where a run installs the handler that stops its services (flows/overlap.py);
and one run that crashes the interpreter (or is killed for memory) would take the others with it. In processes,
N runs are N interpreters on N cores, each stopped, retried and logged on its own.

A stop signal to the sweep stops its runs (SIGTERM to each: they record themselves as crashed and stop their
services); a run whose sweep was killed outright exits by itself (utils.exit_when_parent_dies).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

from areal_pipeline import shutdown

CHILD_FLAG = "--child"
# How the sweep starts a run: `-c` rather than `-m flows.sweep`, since every process multiprocessing starts (the
# run's forked services) imports the main module first, and this one's import is Prefect's
CHILD_COMMAND = "from flows.sweep import child_main; child_main()"
LOG_NAME = "sweep.log"  # a run's terminal output, in <run_dir>/logs/ (its full log is train.log beside it)


class SweepError(ValueError):
    """A sweep that cannot be planned: the message names what is wrong."""


# ---------------------------------------------------------------- planning (no Prefect call: before any server)

def parse_axes(axes: list[str]) -> list[tuple[str, list[str]]]:
    """`key=v1,v2,...` -> (key, [v1, v2, ...]), in the order given."""
    parsed: list[tuple[str, list[str]]] = []
    for axis in axes:
        key, sep, values = axis.partition("=")
        key = key.strip()
        if not sep or not key or not values:
            raise SweepError(f"'{axis}': expected key=v1,v2,... (a dotted config key and comma-separated values)")
        if key == "run_id":
            raise SweepError("run_id cannot be swept: each run's id is --run-id (or the config's run_id) followed "
                             "by its values")
        if key in {k for k, _ in parsed}:
            raise SweepError(f"'{key}' is given twice: give all its values in one key=v1,v2,...")
        items = [v.strip() for v in values.split(",")]
        if any(not v for v in items):
            raise SweepError(f"'{axis}': an empty value")
        if len(set(items)) != len(items):
            raise SweepError(f"'{axis}': a value is repeated (two runs would be the same run)")
        parsed.append((key, items))
    return parsed


def _label(value: str) -> str:
    """A value as it can stand in a run id (a directory name): path separators and spaces become '_'."""
    return re.sub(r"[^A-Za-z0-9._=+-]+", "_", value).strip("_") or "_"


def plan(config_path: str, axes: list[str], run_id: Optional[str] = None,
         iterations: Optional[int] = None) -> list[dict[str, Any]]:
    """The runs of a sweep, each {run_id, overrides, values, run_dir}, with every run's config loaded and checked (an
    unknown key or a bad value fails here, before anything starts, with the config loader's own message)."""
    from areal_pipeline.config import ConfigError
    from areal_pipeline.run_spec import load_config, resolve_run_config

    parsed = parse_axes(axes)
    base = run_id or load_config(config_path, []).run_id
    varying = [key for key, values in parsed if len(values) > 1]
    short = {key: key.rsplit(".", 1)[-1] for key in varying}
    if len(set(short.values())) < len(short):  # two keys that end alike: name them in full
        short = {key: key for key in varying}
    runs = []
    for combination in itertools.product(*[[(key, v) for v in values] for key, values in parsed]):
        overrides = [f"{key}={value}" for key, value in combination]
        name = "-".join([base, *(f"{short[key]}={_label(value)}" for key, value in combination if key in short)])
        try:
            cfg = resolve_run_config(config_path, overrides, name, iterations)
        except ConfigError as e:
            raise ConfigError(f"sweep run {name}: {e}") from None
        runs.append({"run_id": name, "overrides": overrides, "values": dict(combination),
                     "run_dir": str(cfg.run_dir)})
    if len({r["run_dir"] for r in runs}) < len(runs):
        raise SweepError("two combinations give the same run id (values that differ only in characters a run id "
                         "cannot hold): " + ", ".join(r["run_id"] for r in runs))
    return runs


def format_table(rows: list[dict[str, Any]]) -> str:
    """The runs' final figures: state, iterations, mean reward of the first vs last iterations, eval pass@1
    first vs last, and each run's wall time."""
    def num(value: Optional[float]) -> str:
        return "-" if value is None else f"{value:.3f}"

    header = ["run", "state", "iters", "reward first", "reward last", "pass@1 first", "pass@1 last", "wall"]
    lines = [[r["run_id"], r["state"], str(r.get("iterations", 0)), num(r.get("reward_first")),
              num(r.get("reward_last")), num(r.get("eval_pass_at_1_first")), num(r.get("eval_pass_at_1_last")),
              f"{r['wall_s']:.0f} s" if r.get("wall_s") is not None else "-"] for r in rows]
    widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header))]
    fmt = lambda row: "  ".join(cell.ljust(w) if i < 2 else cell.rjust(w)  # noqa: E731
                                for i, (cell, w) in enumerate(zip(row, widths)))
    return "\n".join([fmt(header), fmt(["-" * w for w in widths]), *map(fmt, lines)])


# ---------------------------------------------------------------- the flow

from prefect import flow, get_run_logger, runtime, task  # noqa: E402
from prefect.artifacts import create_table_artifact  # noqa: E402
from prefect.cache_policies import NO_CACHE  # noqa: E402
from prefect.futures import wait  # noqa: E402
from prefect.task_runners import ThreadPoolTaskRunner  # noqa: E402

_children: dict[int, subprocess.Popen] = {}  # the runs in flight, by pid
last_rows: list[dict[str, Any]] = []  # the figures of this process's last sweep, for the command to print
_children_lock = threading.Lock()
# a stopped run exits within shutdown.FORCED_EXIT_AFTER_S of the signal and its final reports' deadline after that
RUN_STOP_GRACE_S = shutdown.FORCED_EXIT_AFTER_S + shutdown.FINAL_REPORTS_DEADLINE_S + 2.0


def signal_runs() -> list[subprocess.Popen]:
    """SIGTERM to every run in flight: each stops its services and records its flow run as crashed."""
    with _children_lock:
        children = list(_children.values())
    for child in children:
        if child.poll() is None:
            try:
                os.kill(child.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    return children


def stop_runs(grace: float = RUN_STOP_GRACE_S) -> None:
    """`signal_runs`, then SIGKILL to the groups of those still there after `grace` (by then each run has ended
    itself: areal_pipeline/shutdown.py)."""
    children = signal_runs()
    deadline = time.monotonic() + grace
    for child in children:
        try:
            child.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _final_state(flow_run_id: Any, returncode: int):
    """The run's flow run state as the API has it, once its process has ended with `returncode`. Where the process
    left it unfinished (it was killed, or its forced exit after a stop signal came before Prefect recorded the
    crash), the flow run and those below it are recorded Crashed first. After a stop signal: quick calls (the API
    may be what is gone, and nothing may wait on it then), None when it does not answer."""
    from prefect import get_client

    from flows.labels import crash_unfinished_runs, quick_client

    quick = shutdown.requested_by() is not None
    try:
        with quick_client() if quick else get_client(sync_client=True) as client:
            flow_run = client.read_flow_run(flow_run_id)
            crashed = crash_unfinished_runs(
                client, flow_run, f"its process ended (exit code {returncode}) before recording its end")
            if not crashed:
                return flow_run.state
            logging.getLogger(__name__).warning("flow runs left unfinished by an ended process, marked Crashed: %s",
                                                ", ".join(crashed))
            return client.read_flow_run(flow_run_id).state
    except Exception:
        if not quick:
            raise
        return None


@task(name="run", task_run_name="{run_id}", cache_policy=NO_CACHE)
def run_one(config_path: str, run_id: str, overrides: list[str], iterations: Optional[int], run_dir: str,
            api_url: str) -> dict[str, Any]:
    """One combination: its `train` flow run (a child of this task run), run by a process of its own; its
    final figures."""
    from uuid import uuid4

    from prefect import Task, get_client
    from prefect.client.schemas.objects import TaskRunResult
    from prefect.context import FlowRunContext, TaskRunContext
    from prefect.states import Pending

    from areal_pipeline.metrics import read_metrics, summarize
    from flows.train import train

    parameters = {"config_path": config_path, "overrides": overrides, "run_id": run_id, "iterations": iterations}
    # What Prefect does for a subflow called in a task: a tracking task run, created at once through the API (this
    # task's own run may reach the database seconds later, batched), that the flow run hangs under; the server
    # keeps its state in step with the flow run's. Its key is new on every call, as Prefect's own for a subflow
    # called in a task: a retried sweep gives each combination a new train run, not the earlier one's tracker.
    tracker = Task(name=train.name, fn=train.fn, version=train.version)
    key = f"{run_id}-{uuid4().hex}"
    with get_client(sync_client=True) as client:
        tracking_run = client.create_task_run(
            tracker, flow_run_id=FlowRunContext.get().flow_run.id, dynamic_key=key, name=f"{train.name}-{key}",
            state=Pending(), task_inputs={"__parents__": [TaskRunResult(id=TaskRunContext.get().task_run.id)]})
        flow_run = client.create_flow_run(train, name=run_id, parameters=parameters, tags=["sweep"],
                                          parent_task_run_id=tracking_run.id)
    log = Path(run_dir) / "logs" / LOG_NAME
    log.parent.mkdir(parents=True, exist_ok=True)
    from areal_pipeline.utils import PARENT_PID_ENV
    from flows.created_runs import environment_for

    env = {**os.environ, "PREFECT_API_URL": api_url, **environment_for(flow_run.id), PARENT_PID_ENV: str(os.getpid())}
    started = time.monotonic()
    with open(log, "ab") as out:
        child = subprocess.Popen([sys.executable, "-c", CHILD_COMMAND], env=env,
                                 stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)  # a terminal's Ctrl-C reaches the sweep, which stops it
    with _children_lock:
        _children[child.pid] = child
    get_run_logger().info("run %s: flow run %s, pid %d, output in %s", run_id, flow_run.id, child.pid, log)
    print(f"  started  {run_id} (pid {child.pid}; its output: {log})", flush=True)
    try:
        returncode = child.wait()  # after a stop signal stop_runs (registered below) ends it within its grace
    finally:
        with _children_lock:
            _children.pop(child.pid, None)
    wall = time.monotonic() - started
    state = _final_state(flow_run.id, returncode)
    summary = summarize(read_metrics(Path(run_dir) / "metrics.jsonl"))
    summary.pop("agent", None)
    row = {"run_id": run_id, "state": state.name if state else "unknown", "exit_code": returncode,
           "wall_s": round(wall, 1), "flow_run_id": str(flow_run.id), "log": str(log), **summary}
    if returncode != 0 or state is None or not state.is_completed():
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.is_file() else []
        row["error"] = f"exit code {returncode}, flow run {row['state']}" + (f": {tail[0]}" if tail else "")
    print(f"  finished {run_id}: {row['state']} in {wall:.0f} s", flush=True)
    return row


def _sweep_run_name() -> str:
    from prefect.runtime import flow_run

    from areal_pipeline.run_spec import load_config

    params = flow_run.parameters
    return f"sweep/{params.get('run_id') or load_config(params['config_path'], []).run_id}"


def _stop_runs_hook(flow, flow_run, state) -> None:
    """The sweep's on_crashed / on_cancellation hook: its runs in flight stop too."""
    signal_runs()


@flow(name="sweep", flow_run_name=_sweep_run_name, on_crashed=[_stop_runs_hook], on_cancellation=[_stop_runs_hook])
def sweep(config_path: str = "configs/tiny_cpu.yaml", axes: Optional[list[str]] = None,
          run_id: Optional[str] = None, iterations: Optional[int] = None, max_parallel: int = 1) -> list[dict]:
    """A `train` run for each combination of `axes` (the cartesian product), at most `max_parallel` at once, each
    in a process of its own; a table artifact of their figures.

    Args:
        config_path: The runs' config file (relative to the directory the flow runs in).
        axes: Dotted keys and their values, key=v1,v2,... (a single value applies to every run), e.g.
            trainer.optimizer.lr=1e-3,5e-4.
        run_id: The base of the runs' ids (default: the config's run_id); each run is BASE-key=value[-...].
        iterations: As train's: iterations each run adds after its newest finished one.
        max_parallel: Runs at once.
    """
    from prefect.settings import PREFECT_API_URL

    from areal_pipeline import shutdown
    from areal_pipeline.model import resolve_model_path
    from areal_pipeline.run_spec import load_config
    from flows import labels, overlap

    with labels.crashed_if_forced_to_exit(runtime.flow_run.id):  # marked Crashed if forced to exit
        if max_parallel < 1:
            raise SweepError(f"max_parallel={max_parallel}: must be >= 1")
        config_path = str(Path(config_path).resolve())
        runs = plan(config_path, list(axes or []), run_id, iterations)
        logger = get_run_logger()
        logger.info("sweep of %d runs, at most %d at once: %s", len(runs), max_parallel,
                    ", ".join(r["run_id"] for r in runs))
        # An embedded model is built on first use: once here, not by concurrent runs racing to write it.
        built = set()
        for r in runs:
            cfg = load_config(config_path, r["overrides"] + [f"run_id={r['run_id']}"])
            key = (cfg.output_dir, repr(cfg.model), cfg.seed)
            if key not in built:
                resolve_model_path(cfg.model, cfg.output_dir, cfg.seed)
                built.add(key)
        api_url = PREFECT_API_URL.value()
        # A stop signal reaches this process only (each run is in a session of its own): pass it on to the runs at
        # once, or the task runner would wait for them to finish. During a flow run SIGTERM goes to Prefect's handler;
        # stop_everything_on_sigterm stops the runs inside the task runner's block, before it waits for them.
        stopping = shutdown.register("the sweep's runs",
                                     lambda: threading.Thread(target=stop_runs, name="stop-runs", daemon=True).start())
        try:
            with ThreadPoolTaskRunner(max_workers=max_parallel) as runner, overlap.stop_everything_on_sigterm():
                futures = [runner.submit(run_one, parameters={
                    "config_path": config_path, "run_id": r["run_id"], "overrides": r["overrides"],
                    "iterations": iterations, "run_dir": r["run_dir"], "api_url": api_url}) for r in runs]
                wait(futures)
        finally:
            shutdown.unregister(stopping)
        rows = []
        for r, future in zip(runs, futures):
            state = future.state
            if state.is_completed():
                rows.append(future.result())
            else:
                rows.append({"run_id": r["run_id"], "state": state.name, "error": str(state.message)})
        last_rows[:] = rows
        logger.info("sweep results:\n%s", format_table(rows))
        from flows.artifacts import artifact_key

        base = run_id or load_config(config_path, []).run_id
        create_table_artifact(key=artifact_key(base, "sweep"),
                              table=[{k: v for k, v in row.items() if k not in ("log",)} for row in rows],
                              description="sweep: the final figures of its runs")
        failed = [row for row in rows if row.get("error")]
        if failed:
            raise RuntimeError(f"{len(failed)} of {len(rows)} runs failed: "
                               + "; ".join(f"{row['run_id']}: {row['error']}" for row in failed))
        return rows


# ---------------------------------------------------------------- the processes

def child_main() -> None:
    """A sweep's run: the `train` flow run the sweep created (flows/created_runs.py), as `areal-pipeline train`
    runs one (stop signals, services forked from the forkserver, the progress line and train.log)."""
    from areal_pipeline import shutdown
    from areal_pipeline.services import start_forkserver
    from areal_pipeline.utils import exit_when_parent_dies

    shutdown.install_handlers()
    start_forkserver()
    exit_when_parent_dies()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from areal_pipeline.console import quiet_console
    from areal_pipeline.run_spec import resolve_run_config
    from flows.api_server import deliver_queued_logs_and_events
    from flows.created_runs import run_created_flow_run
    from flows.events import listening
    from flows.train import train

    @contextlib.contextmanager
    def console(params: dict[str, Any]):
        cfg = resolve_run_config(params["config_path"], params.get("overrides"), params.get("run_id"),
                                 params.get("iterations"))
        with quiet_console(cfg.run_id, cfg.run_dir, live=False) as progress, listening(progress):
            yield

    try:
        run_created_flow_run(train, around=console)
    except KeyboardInterrupt:
        signum = shutdown.requested_by() or signal.SIGINT
        print(f"interrupted by {signal.Signals(signum).name}: servers and trainer were stopped", file=sys.stderr)
        deliver_queued_logs_and_events()
        sys.exit(shutdown.exit_status(signum))
    deliver_queued_logs_and_events()


def main(args: argparse.Namespace) -> None:
    """`areal-pipeline sweep`: the runs are planned (every config checked) before anything starts; then the
    sweep runs against PREFECT_API_URL, else against one temporary API server that all its runs share."""
    from areal_pipeline import shutdown
    from flows.api_server import TemporaryAPIServer, configured_api_url, prefect_api

    if args.max_parallel < 1:
        sys.exit(f"sweep: --max-parallel must be >= 1, got {args.max_parallel}")
    try:
        runs = plan(args.config, args.axes, args.run_id, args.iterations)
    except SweepError as e:
        sys.exit(f"sweep error: {e}")
    print(f"sweep: {len(runs)} runs, at most {args.max_parallel} at once: " + ", ".join(r["run_id"] for r in runs),
          flush=True)
    # the terminal shows the runs starting and ending, warnings and the table; --verbose every log record
    muted = [] if args.verbose else [h for h in logging.getLogger().handlers if type(h) is logging.StreamHandler]
    levels = [h.level for h in muted]
    for handler in muted:
        handler.setLevel(logging.WARNING)
    last_rows.clear()
    # After a stop signal each run has its own FORCED_EXIT_AFTER_S to record its end through the API; the sweep,
    # which holds that API (a temporary server exits with it), must outlast them.
    shutdown.FORCED_EXIT_AFTER_S = RUN_STOP_GRACE_S + 8.0
    try:
        with prefect_api(None if configured_api_url() else TemporaryAPIServer()) as url:
            print(f"Prefect API: {url}", flush=True)
            try:
                sweep(config_path=args.config, axes=args.axes, run_id=args.run_id, iterations=args.iterations,
                      max_parallel=args.max_parallel)
            finally:
                stop_runs()  # after a stop signal: the runs record their end while the API is still there
                if last_rows:
                    print("\n" + format_table(last_rows), flush=True)
    finally:
        for handler, level in zip(muted, levels):
            handler.setLevel(level)


if __name__ == "__main__":
    if sys.argv[1:] == [CHILD_FLAG]:
        child_main()
    else:
        sys.exit(f"usage: areal-pipeline sweep ... (python -m flows.sweep {CHILD_FLAG} runs one sweep run)")
