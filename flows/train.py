"""The `train` flow: set-up nodes, then one child flow run `<run>/iter-<k>` per RL iteration (or per
`iterations_per_flow_run` iterations, `<run>/iter-<k>..<k+n-1>`), whose nodes are the steps of
`areal_pipeline.steps` in their order, each handed the outputs of the steps before it that it needs:

    rollout -> [ref_logprobs] -> advantages -> [proximal_logprobs] -> ppo_update -> broadcast_weights
            -> checkpoint (every save_freq) and evaluate (every eval_freq)

Running `train` again with the same run id (or retrying a failed flow run from the UI/CLI) skips every
finished node: each node's output is complete on disk and its Prefect cache key is derived from it, so the run
continues from the node that failed. Servers and the trainer are stopped in every outcome.

Consecutive iteration runs overlap in their bookkeeping, never in their nodes (flows/overlap.py).
"""

from __future__ import annotations

import importlib
import json
from typing import Any, Optional

from prefect import flow, get_run_logger, runtime
from prefect.futures import wait
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
from prefect.states import Cancelled

import tasks
from areal_pipeline.config import save_config, to_dict
from areal_pipeline.console import run_log_file
from areal_pipeline.metrics import initial_record
from areal_pipeline.pipeline import Pipeline
from areal_pipeline.run_context import context_of
from areal_pipeline.run_dir import newest_completed_iteration, run_lock
from areal_pipeline.run_spec import load_run
from areal_pipeline.steps import BY_NAME, due_steps, run_steps
from areal_pipeline.utils import atomic_write_text
from flows import artifacts, control, labels, overlap, run_logs, tracking
from tasks import runs
from tasks.runs import LiveRun

# What Prefect imports at a process's first flow and task run (its engines, and FastAPI's encoder for parameters):
# `areal-pipeline train` imports them while the API server comes up, off the path between it and the first iteration.
FIRST_RUN_IMPORTS = ("prefect.flow_engine", "prefect.task_engine", "prefect.utilities.visualization", "fastapi.encoders")


def preimport_first_run() -> None:
    for module in FIRST_RUN_IMPORTS:
        try:
            importlib.import_module(module)
        except ImportError:  # another Prefect version: it imports what it needs when it needs it
            pass


def _iteration_run_name() -> str:
    parameters = runtime.flow_run.parameters
    k, until = parameters["k"], parameters.get("until")
    return f"{parameters['run_id']}/iter-{k}" + (f"..{until}" if until not in (None, k) else "")


@flow(name="iteration", flow_run_name=_iteration_run_name, persist_result=True, result_serializer="json")
def iteration(run_id: str, k: int, until: Optional[int] = None) -> Any:
    """Iteration k of run `run_id` (policy k - 1 -> k), or iterations k..until in one flow run
    (`iterations_per_flow_run`): each iteration's nodes are its own task runs, as in a run of one."""
    run = runs.get(run_id)
    labels.tag_iteration_run(run.tags)
    try:
        if until is None or until == k:
            return _one_iteration(run, k)
        done = set(run.pipeline.paths.completed_iterations())  # a retried flow run: its finished iterations stay done
        # every node output of this flow run lives until it ends: Prefect finds a task input's upstream task run by
        # the `id()` of an earlier result (and of the objects in it), so a freed output of iteration k whose id a
        # later iteration's object reused would draw a false edge from k
        outputs_of_this_run: list[dict[str, Any]] = []
        overlap.run_group(lambda i: None if i in done else _one_iteration(run, i, outputs_of_this_run), run, k, until)
    except overlap.PreviousIterationFailed as failed:
        return Cancelled(message=str(failed))
    return {"iterations": [k, until]}


def _one_iteration(run: LiveRun, k: int, kept: Optional[list] = None) -> Any:
    """One RL iteration, step by step (areal_pipeline/steps.py): each node is handed the outputs of the nodes it
    needs, which are the edges the Prefect UI draws. `turn` makes the node that needs policy k - 1 wait for
    iteration k - 1 (and raises PreviousIterationFailed if it failed), and lets iteration k + 1 start meanwhile
    (flows/overlap.py)."""
    with overlap.turn(run, k) as turn:
        outputs = run_steps(lambda step, inputs: turn.node(
            step.name, lambda: tasks.call_node(step, run.context, k, inputs)), due_steps(run.pipeline, k))
        if kept is not None:
            kept.append(outputs)
    return turn.report(lambda: _report(run, k, outputs))


def _report(run: LiveRun, k: int, outputs: dict[str, Any]) -> dict[str, Any]:
    """Iteration k's metrics record, its artifacts and its event."""
    pipeline = run.pipeline
    record = pipeline.record_metrics(k, outputs)
    tracking.log(run, record)  # W&B, MLflow, TensorBoard, where enabled
    artifacts.publish_iteration(run, k, record)
    if run.events is not None:  # in iteration order: after its metrics
        run.events.iteration_completed(k, record)
    get_run_logger().info("iteration %d: reward %.3f, %s", k, record["reward_mean"],
                          ", ".join(f"{n} {s:.2f}s" for n, s in pipeline.step_seconds.get(k, {}).items()))
    return record


def planned_iterations(cfg) -> tuple[int, int, int]:
    """The iterations this flow run trains, (first, last, iterations per flow run), fixed when it first runs.

    A retry of a failed train run (the UI's Retry button, `prefect flow-run retry`) runs the same flow run again,
    and Prefect matches the retried run's child-flow calls to the earlier child runs by the order of the calls:
    its n-th `iteration` call gets the n-th earlier child run (a finished one is handed back without running).
    So a retry must call the same iterations as the first attempt, from the same first one, in the same units,
    and must not recompute the end of a run started with `iterations=N` from the iterations finished since."""
    from prefect.context import FlowRunContext

    flow_run = FlowRunContext.get().flow_run
    plan_path = cfg.run_dir / "flow_runs" / f"{flow_run.id}.json"
    if plan_path.is_file():
        plan = json.loads(plan_path.read_text())
        if flow_run.run_count > 1:
            get_run_logger().info("retry %d of flow run %s: iterations %d..%d as first planned",
                                  flow_run.run_count - 1, flow_run.name, plan["first"], plan["last"])
    else:
        plan = {"first": newest_completed_iteration(cfg.run_dir) + 1, "last": cfg.total_iterations,
                "per_run": cfg.iterations_per_flow_run}
        atomic_write_text(plan_path, json.dumps(plan) + "\n")
    return plan["first"], plan["last"], plan.get("per_run", 1)


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


@flow(name="train", flow_run_name=labels.train_run_name, persist_result=True, result_serializer="json",
      **overlap.STOP_HOOKS)
def train(config_path: str = "configs/tiny_cpu.yaml", overrides: Optional[list[str]] = None,
          run_id: Optional[str] = None, iterations: Optional[int] = None) -> dict[str, Any]:
    """RL training of a run: its set-up, then a child flow run per iteration (rollout -> advantages -> ppo_update
    -> broadcast_weights -> checkpoint -> evaluate). A run id found partly trained goes on from its last finished
    node; one found finished does nothing.

    Args:
        config_path: The run's config file (relative to the directory the flow runs in), e.g. configs/tiny_cpu.yaml.
        overrides: Dotted key=value overrides of the config, e.g. trainer.optimizer.lr=5e-4 or seed=3.
        run_id: The run's id, its directory under output_dir (default: the config's run_id).
        iterations: Train this many iterations after the run's newest finished one (default: up to the config's
            total_iterations). The learning-rate schedule stays the one the run was configured with.
    """
    spec = load_run(config_path, overrides, run_id, iterations)
    cfg = spec.cfg
    run_logs.keep_completed_task_runs_from_the_api()
    logger = get_run_logger()
    # the run's log file, whoever started the flow run (a command opened it already; a deployment run opens it)
    with run_lock(cfg.run_dir), run_log_file(cfg.run_dir, header=f"flow run {runtime.flow_run.name}"), \
            labels.crashed_if_forced_to_exit(runtime.flow_run.id):
        # the plan first (a Retry's is its first attempt's): the trainer, the saved config and every node read the
        # run's length from it
        first, cfg.total_iterations, per_run = planned_iterations(cfg)
        pipeline = Pipeline(spec)
        run = runs.register(pipeline)
        save_config(cfg, cfg.run_dir / "config.yaml")  # how the run was made; what a branch of it starts from
        status = "failed"  # what the trackers are told at the end
        try:
            leftovers = labels.crash_leftover_runs(cfg.run_id)
            if leftovers:
                logger.warning("run %s: %s were left running by a process that is gone: marked Crashed",
                               cfg.run_id, ", ".join(leftovers))
            run.tags = labels.label_train_run(cfg, config_path)
            tracking.start(run)
            tasks.prepare_dataset(cfg.run_id)
            _start_services(pipeline)
            run.context = context_of(pipeline).to_dict()  # what every node is handed
            if first > 1:
                logger.info("run %s: iterations 1..%d are finished; continuing at %d", cfg.run_id, first - 1, first)
            if pipeline.wants_initial_evaluation(first):  # policy 0's pass@1, where the curve starts: evaluate-0
                tasks.call_node(BY_NAME["evaluate"], run.context, 0, (None,))
                tracking.log(run, initial_record(pipeline.paths))  # pass@1 at step 0 in the trackers too
            progress = artifacts.Progress(cfg.total_iterations, first - 1)
            # the run's table and curves, while it runs and however it ends (flows/artifacts.py)
            # A flow waits for its heartbeat thread on exit (up to its period): too much for a child run per iteration.
            with artifacts.RunArtifacts(run) as published, \
                    temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
                # run events, and Prefect's Cancel / Pause of this flow run (see flows/control.py)
                with control.watch(run, first, cfg.total_iterations, to_dict(cfg)) as watched:
                    with overlap.stop_everything_on_sigterm(), control.stop_if_the_api_is_gone(watched):
                        overlap.run_iterations(lambda k, until: iteration(cfg.run_id, k, until if until > k else None),
                                               run, first, cfg.total_iterations, per_run, progress)
            if watched.cancelled is not None:
                status = "cancelled"
                return control.cancelled_state(watched)
            summary = published.summary
            logger.info("run %s finished: %s", cfg.run_id, summary)
            status = "completed"
            return {"run_id": cfg.run_id, "run_dir": str(cfg.run_dir), **summary}
        finally:
            tracking.finish(run, status)
            pipeline.close()
            pipeline.services.stop()
            runs.unregister(cfg.run_id)
