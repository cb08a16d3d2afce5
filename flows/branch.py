"""The `branch` flow: a new run from another run's policy after iteration K (areal_pipeline/branching.py).

    reference_parent        the branch's run directory: the parent's iterations 1..K (and in a replay its rollout
                            shards after K) referenced, config.yaml, branch.json
    restore_parent_policy   where the parent saved no checkpoint at K: its policy K made from an older one plus
                            the updates after it, under the parent's config
    train                   the `train` flow, as a child run of this one: iterations K+1.. of the new run

In the UI the branch's flow run carries the tags `branch` (or `replay`) and `branch-of:<parent>`, a markdown
artifact links the parent's train flow runs, and the train run of the new run is its child.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

from prefect import flow, get_run_logger, runtime, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from areal_pipeline.branching import (BranchError, BranchPlan, plan_branch, prepare_branch, regenerated_rollouts,
                                      restore_parent_policy)
from flows import labels, run_logs
from flows.artifacts import artifact_key
from flows.train import train


@task(name="reference_parent", cache_policy=NO_CACHE)
def reference_parent(plan: BranchPlan) -> dict[str, Any]:
    return prepare_branch(plan)


@task(name="restore_parent_policy", cache_policy=NO_CACHE)
def restore_parent_policy_task(plan: BranchPlan) -> dict[str, Any]:
    return restore_parent_policy(plan)


def _tag_and_link(plan: BranchPlan, record: dict[str, Any]) -> None:
    """What the UI shows of the lineage: tags on this flow run, and an artifact linking the parent's runs."""
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext
    from prefect.settings import PREFECT_UI_URL

    flow_run = FlowRunContext.get().flow_run
    tags = sorted({*flow_run.tags, plan.mode, f"branch-of:{plan.parent_run_id}",
                   *([f"rescored:{plan.rescored}"] if plan.rescored else [])})
    with get_client(sync_client=True) as client:
        client.update_flow_run(flow_run.id, tags=tags)
    ui = PREFECT_UI_URL.value()
    links = "\n".join(f"- [{flow_run_id}]({ui}/runs/flow-run/{flow_run_id})" if ui else f"- `{flow_run_id}`"
                      for flow_run_id in record["parent_flow_runs"]) or "- (none recorded)"
    what = ("retrains iterations {a}..{b} on the parent's recorded rollouts" if plan.mode == "replay"
            else "trains iterations {a}..{b} afresh").format(a=plan.at + 1, b=plan.last)
    create_markdown_artifact(
        key=artifact_key(plan.cfg.run_id, "lineage"),
        markdown=(f"# {plan.cfg.run_id}: {plan.mode} of `{plan.parent_run_id}` at iteration {plan.at}\n\n"
                  f"Iterations 1..{plan.at} are the parent's (hard links to `{record['parent_run_dir']}`); the "
                  f"{plan.mode} {what}, starting from {record['start_checkpoint']}.\n\n"
                  f"{_rescored_line(record)}"
                  f"Overrides: `{' '.join(plan.overrides) or '(none)'}`\n\n"
                  f"## The parent's train flow runs up to iteration {plan.at}\n{links}\n"),
        description=f"{plan.cfg.run_id}: {plan.mode} of {plan.parent_run_id} at {plan.at}")


def _rescored_line(record: dict[str, Any]) -> str:
    rescored = record.get("rescored_from")
    if not rescored:
        return ""
    return (f"Rescored from: the parent's rollouts scored again by `{rescored['scorer']}` (`areal-pipeline rescore "
            f"--name {rescored['name']}`): the same episodes, new rewards.\n\n")


@flow(name="branch", flow_run_name="{run_id}: {mode} of {parent_run_id} at {at}", persist_result=True,
      result_serializer="json")
def branch(parent_run_id: str, at: int, run_id: str, overrides: Optional[list[str]] = None,
           output_dir: str = "runs", mode: str = "branch", iterations: Optional[int] = None,
           rescored: Optional[str] = None) -> Any:
    """Branch run `parent_run_id` (in `output_dir`) after iteration `at` as run `run_id`, with dotted `overrides`
    on the parent's config; `mode` "replay" retrains the parent's later iterations on its recorded rollouts
    instead of rolling out afresh. `iterations`: how many after `at` (default: the config's total_iterations, or
    in a replay every iteration the parent recorded)."""
    if mode not in ("branch", "replay"):
        raise BranchError(f"mode {mode!r}: choose branch or replay")
    run_logs.keep_completed_task_runs_from_the_api()
    logger = get_run_logger()
    plan = plan_branch(Path(output_dir) / parent_run_id, at, run_id, overrides, mode == "replay", iterations,
                       rescored)
    record = reference_parent(plan)
    if record["needs_restore"]:
        restore_parent_policy_task(plan)
    _tag_and_link(plan, record)
    logger.info("%s %s of %s at iteration %d: training %d..%d (%s)", plan.mode, run_id, parent_run_id, at, at + 1,
                plan.last, record["start_checkpoint"])
    with labels.crashed_if_forced_to_exit(runtime.flow_run.id):  # this flow run too, not only the train run's
        result = train(config_path=str(plan.run_dir / "config.yaml"), run_id=run_id)
    regenerated = regenerated_rollouts(plan)
    if regenerated:  # a referenced shard went bad during the run: it is not the parent's data any more
        logger.warning("replay %s: the rollouts of iterations %s were generated again (their referenced shards "
                       "were found corrupt): those iterations did not train on the parent's data", run_id,
                       regenerated)
    return {**result, "parent_run_id": parent_run_id, "at": at, "mode": plan.mode, "regenerated": regenerated,
            "rescored": rescored}


def main(args) -> None:
    """`areal-pipeline branch`: checks the branch first (a clear error, nothing started), then runs the flow against
    the configured Prefect API or a temporary one, and prints where the new run is."""
    from areal_pipeline.config import ConfigError
    from areal_pipeline.console import quiet_console
    from areal_pipeline.metrics import read_metrics, summarize
    from flows.api_server import prefect_api
    from flows.events import listening

    mode = "replay" if args.replay else "branch"
    try:
        plan = plan_branch(Path(args.output_dir) / args.parent, args.at, args.run_id, args.overrides, args.replay,
                           args.iterations, getattr(args, "rescored", None))
        # the run directory first (the flow's reference_parent then finds it made): the log file goes into it
        prepare_branch(plan)
    except (BranchError, ConfigError) as error:
        sys.exit(f"branch error: {error}")
    with quiet_console(args.run_id, plan.run_dir, args.verbose) as progress, listening(progress):
        with prefect_api():
            result = branch(parent_run_id=args.parent, at=args.at, run_id=args.run_id, overrides=args.overrides,
                            output_dir=args.output_dir, mode=mode, iterations=args.iterations,
                            rescored=getattr(args, "rescored", None))
    summary = summarize(read_metrics(plan.run_dir / "metrics.jsonl")[args.at:])
    print(f"\n{mode} {args.run_id} of {args.parent} at iteration {args.at}: iterations {args.at + 1}..{plan.last} "
          f"in {plan.run_dir}")
    if summary:
        print(f"  mean reward, first {summary['window']} new iterations: {summary['reward_first']:.3f}")
        print(f"  mean reward, last {summary['window']} iterations:      {summary['reward_last']:.3f}")
    if result.get("regenerated"):
        print(f"  WARNING: iterations {result['regenerated']} were rolled out again (their shards went bad)")
    if plan.rescored:
        print(f"  on the parent's rollouts re-scored as {plan.rescored!r}")
    print(f"  parent recorded in {plan.run_dir / 'branch.json'}")
