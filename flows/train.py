"""The `train` flow: set-up nodes, then one child flow run `<run>/iter-<k>` per RL iteration.

    rollout -> advantages -> ppo_update -> broadcast_weights -> checkpoint -> evaluate (every eval_freq)

Running `train` again with the same run id (or retrying a failed flow run from the UI/CLI) skips every
finished node: each node's output is complete on disk and its Prefect cache key is derived from it, so the run
continues from the node that failed. Servers and the trainer are stopped in every outcome.

Consecutive iteration runs overlap in their bookkeeping, never in their nodes: a flow run costs ~150 ms of API
calls to start and ~70 ms to finish (metrics, artifacts, final state) on SQLite, as much as a fifth of a
default iteration. So iteration k+1's run starts while iteration k's ppo_update runs, and its first node waits
until k's last node is done; iteration k reports while k+1 works. At most two iteration runs are in flight. In
asynchronous mode (eta > 0) iteration k+1's rollout and advantages also run during k's update (AHEAD_NODES), and
its own update is the node that waits.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from prefect import flow, get_run_logger
from prefect.futures import wait
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
from prefect.states import Cancelled

import tasks
from areal_pipeline import shutdown
from areal_pipeline.config import save_config, to_dict
from areal_pipeline.metrics import write_tensorboard
from areal_pipeline.pipeline import Pipeline, newest_completed_iteration, resolve_run_config, run_lock
from areal_pipeline.utils import atomic_write_text
from flows import artifacts, control, events
from tasks import registry

# The node during which the next iteration's run may start its bookkeeping: the longest one.
NEXT_RUN_STARTS_DURING = "ppo_update"


@dataclass
class Handoff:
    """What iteration k tells iteration k+1 of the same train run."""
    next_may_start: threading.Event = field(default_factory=threading.Event)
    nodes_done: threading.Event = field(default_factory=threading.Event)
    reported: threading.Event = field(default_factory=threading.Event)
    launched_at: float = field(default_factory=time.perf_counter)
    nodes_done_at: Optional[float] = None
    failed: bool = False

    def finish_unrun(self, failed: bool) -> None:
        """The iteration's call returned without running its body: Prefect handed back the iteration's earlier
        finished run (a retried train run calls its finished iterations again, see `planned_iterations`)."""
        self.failed = failed
        for event in (self.next_may_start, self.nodes_done, self.reported):
            event.set()


_HANDOFFS: dict[tuple[str, int], Handoff] = {}


@flow(name="iteration", flow_run_name="{run_id}/iter-{k}", persist_result=True, result_serializer="json")
def iteration(run_id: str, k: int) -> Any:
    """One RL iteration of run `run_id`: policy k - 1 -> k."""
    pipeline = registry.get(run_id)
    handoff, previous = _HANDOFFS.get((run_id, k)), _HANDOFFS.get((run_id, k - 1))
    due = pipeline.due_nodes(k)
    # the first node that needs iteration k - 1 to be done: the rollout, or in asynchronous mode the update
    waits_before = next(name for name in due if name not in pipeline.ahead_nodes)
    results: dict[str, Any] = {}
    try:
        for name in due:
            if name == waits_before and previous is not None:
                previous.nodes_done.wait()
                if previous.failed:
                    return Cancelled(message=f"iteration {k - 1} failed, so iteration {k} did not finish")
            if name == NEXT_RUN_STARTS_DURING and handoff is not None:
                handoff.next_may_start.set()
            results[name] = getattr(tasks, name)(run_id, k)
    finally:
        if handoff is not None:
            handoff.failed = len(results) < len(due)
            handoff.nodes_done_at = time.perf_counter()
            handoff.next_may_start.set()
            handoff.nodes_done.set()
    try:
        if previous is not None:
            previous.reported.wait()  # metrics.jsonl and the artifacts stay in iteration order
        record = pipeline.record_metrics(k, results)
        if pipeline.cfg.tensorboard:
            write_tensorboard([record], pipeline.paths.run_dir / "tensorboard")
        artifacts.publish_iteration(pipeline, k, record)
        events.iteration_completed(run_id, k, record)
        get_run_logger().info("iteration %d: reward %.3f, %s", k, record["reward_mean"],
                              ", ".join(f"{n} {s:.2f}s" for n, s in pipeline.step_seconds.get(k, {}).items()))
        return record
    finally:
        if handoff is not None:
            handoff.reported.set()


def record_orchestration(pipeline: Pipeline, k: int, period: float) -> None:
    """What the iteration cost beyond its nodes' own work: Prefect's share (`iter_<k>/orchestration.json`).
    `period` is the time from the previous iteration's last node to this one's."""
    work = sum(pipeline.step_seconds.get(k, {}).values())
    atomic_write_text(pipeline.paths.iteration(k) / "orchestration.json", json.dumps(
        {"wall_seconds": period, "node_seconds": work, "overhead_seconds": period - work}) + "\n")


@contextlib.contextmanager
def _stop_everything_on_sigterm() -> Iterator[None]:
    """During a flow run Prefect's own SIGTERM handler replaces the command's (it raises TerminationSignal, so
    that the run is recorded as crashed). Ahead of it, stop the run's processes in the handler itself: that
    exception alone can be lost (raised while the main thread runs a finalizer, Python prints "Exception
    ignored" and a run went on to its end with exit code 0), and with the services stopped the node in flight
    and every later one fail at once and are not retried, whatever the exception does."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread receives signals
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)

    def stop(signum, frame):
        shutdown.on_stop_signal(signum)
        if callable(previous):
            previous(signum, frame)
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run_iterations(pipeline: Pipeline, first: int, last: int, progress) -> None:
    """Iterations first..last as child flow runs, each started while the one before it updates."""
    run_id, total = pipeline.cfg.run_id, pipeline.cfg.total_iterations
    in_flight: list[tuple[int, Future]] = []
    failure: Optional[BaseException] = None

    def finish_oldest() -> None:
        nonlocal failure
        k, future = in_flight.pop(0)
        handoff = _HANDOFFS[(run_id, k)]
        try:
            future.result()
        except BaseException as error:  # the later run in flight sees the failure and does not run its nodes
            failure = failure or error
            if not handoff.nodes_done.is_set():
                handoff.finish_unrun(failed=True)
        else:
            if not handoff.nodes_done.is_set():
                handoff.finish_unrun(failed=False)
                artifacts.update_progress(progress, total, k)
                return
            before = _HANDOFFS.get((run_id, k - 1))
            # the period since the previous iteration's nodes ended, or since this one's launch when that one did
            # not run here
            started = before.nodes_done_at if before is not None and before.nodes_done_at else handoff.launched_at
            record_orchestration(pipeline, k, handoff.nodes_done_at - started)
            artifacts.update_progress(progress, total, k)

    with ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"{run_id}-iteration") as pool:
        try:
            for k in range(first, last + 1):
                control.hold_while_paused(run_id)  # paused in Prefect: start nothing new until resumed
                handoff = _HANDOFFS[(run_id, k)] = Handoff()
                # the child run needs the parent's flow run context (and the heartbeat setting) in its thread
                future = pool.submit(contextvars.copy_context().run, iteration, run_id, k)
                in_flight.append((k, future))
                while not handoff.next_may_start.wait(0.1) and not future.done():
                    pass
                # a failed iteration is waited for here: no later run is started only to be cancelled
                while len(in_flight) > 1 or (in_flight and (in_flight[-1][1].done() or handoff.failed)):
                    finish_oldest()
                if failure is not None:
                    break
        except BaseException:
            # Ctrl-C or SIGTERM reached this thread: stop the services first, so that the node in flight fails
            # at once (and is not retried) instead of being waited for
            pipeline.services.stop()
            raise
        finally:
            while in_flight:
                finish_oldest()
            for key in [key for key in _HANDOFFS if key[0] == run_id]:
                del _HANDOFFS[key]
    if failure is not None:
        raise failure


def planned_iterations(cfg) -> tuple[int, int]:
    """The iterations this flow run trains, (first, last), fixed when it first runs.

    A retry of a failed train run (the UI's Retry button, `prefect flow-run retry`) runs the same flow run again,
    and Prefect matches the retried run's child-flow calls to the earlier child runs by the order of the calls:
    its n-th `iteration` call gets the n-th earlier child run (a finished one is handed back without running).
    So a retry must call the same iterations as the first attempt, from the same first one, and must not
    recompute the end of a run started with `iterations=N` from the iterations finished since."""
    from prefect.context import FlowRunContext

    flow_run = FlowRunContext.get().flow_run
    plan_path = cfg.run_dir / "flow_runs" / f"{flow_run.id}.json"
    if plan_path.is_file():
        plan = json.loads(plan_path.read_text())
        if flow_run.run_count > 1:
            get_run_logger().info("retry %d of flow run %s: iterations %d..%d as first planned",
                                  flow_run.run_count - 1, flow_run.name, plan["first"], plan["last"])
    else:
        plan = {"first": newest_completed_iteration(cfg.run_dir) + 1, "last": cfg.total_iterations}
        atomic_write_text(plan_path, json.dumps(plan) + "\n")
    return plan["first"], plan["last"]


def _start_services(pipeline: Pipeline) -> None:
    """The start-up nodes run together (each mostly waits for its processes to come up), and the rollout's
    own set-up (tokenizer, reward workers) loads meanwhile. All of them end before this returns, so a failure
    never leaves a process starting after the flow's teardown."""
    run_id = pipeline.cfg.run_id
    started = [node.submit(run_id) for node in (tasks.start_tool_servers, tasks.start_inference_servers,
                                                   tasks.start_trainer)]
    try:
        pipeline.warm_up()
    finally:
        wait(started)
    for future in started:
        future.result()


@flow(name="train", persist_result=True, result_serializer="json")
def train(config_path: str = "configs/tiny_cpu.yaml", overrides: Optional[list[str]] = None,
          run_id: Optional[str] = None, iterations: Optional[int] = None) -> dict[str, Any]:
    """Train `config_path` (+ dotted `overrides`) as run `run_id` (default: the config's). `iterations`
    continues the run for that many more iterations after its newest finished one; without it the run goes
    to the config's `total_iterations`."""
    cfg = resolve_run_config(config_path, overrides, run_id, iterations)
    logger = get_run_logger()
    with run_lock(cfg.run_dir):
        pipeline = Pipeline(cfg)
        registry.register(pipeline)
        save_config(cfg, cfg.run_dir / "config.yaml")  # how the run was made; what a branch of it starts from
        try:
            tasks.prepare_dataset(cfg.run_id)
            _start_services(pipeline)
            first, cfg.total_iterations = planned_iterations(cfg)
            if first > 1:
                logger.info("run %s: iterations 1..%d are finished; continuing at %d", cfg.run_id, first - 1, first)
            progress = artifacts.start_progress(cfg.total_iterations, first - 1)
            # A flow waits for its heartbeat thread on exit (~1 s): too much for one child run per iteration.
            with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
                # run events, and Prefect's Cancel / Pause of this flow run (see flows/control.py)
                with control.watch(pipeline, first, cfg.total_iterations, to_dict(cfg)) as watched:
                    with _stop_everything_on_sigterm():
                        _run_iterations(pipeline, first, cfg.total_iterations, progress)
            if watched.cancelled is not None:
                return control.cancelled_state(watched)
            summary = artifacts.publish_curve(pipeline) or {}
            logger.info("run %s finished: %s", cfg.run_id, summary)
            return {"run_id": cfg.run_id, "run_dir": str(cfg.run_dir), **summary}
        finally:
            pipeline.close()
            pipeline.services.stop()
            registry.unregister(cfg.run_id)
