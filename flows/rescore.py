"""The `rescore` flow: a run's stored rollouts scored again by another reward, with no generation
(areal_pipeline/rescoring.py).

    rescore_iteration-<k>   iteration k's rollout shards -> <run_dir>/rescored/<name>/iter_<k>/rollout/ (a rerun
                            keeps those already written and intact)
    lineage                 <run_dir>/rescored/<name>/rescore.json

In the UI the flow run carries the tags `rescore` and `rescore-of:<run>`, and a markdown artifact gives the lineage
(the run, the reward, each iteration's mean reward before and after). `areal-pipeline branch --replay --rescored
<name>` trains on the new shards.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any, Optional

from prefect import flow, get_run_logger, runtime, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from areal_pipeline.rescoring import (RescoreError, RescorePlan, check_sources, plan_rescore, rescore_iteration,
                                      write_lineage)
from flows import labels
from flows.artifacts import artifact_key
from tasks.judge_limit import shared_judge_limit


@task(name="rescore_iteration", task_run_name="rescore_iteration-{k}", cache_policy=NO_CACHE)
def rescore_iteration_task(plan: RescorePlan, k: int) -> dict[str, Any]:
    return rescore_iteration(plan, k)


def _tag_and_record(plan: RescorePlan, record: dict[str, Any]) -> None:
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext

    flow_run = FlowRunContext.get().flow_run
    tags = sorted({*flow_run.tags, "rescore", f"rescore-of:{plan.run_id}", f"rescored:{plan.name}"})
    with get_client(sync_client=True) as client:
        client.update_flow_run(flow_run.id, tags=tags)
    rows = "\n".join(f"| {s['iteration']} | {s['trajectories']} | {s['reward_mean_before']:.3f} | "
                     f"{s['reward_mean_after']:.3f} | {s['advantage_sign_flips']:.2f} | {_r(s)} |"
                     for s in record["iterations"])
    create_markdown_artifact(
        key=artifact_key(plan.run_id, f"rescored-{plan.name}"),
        markdown=(f"# {plan.run_id}: rescored by `{plan.scorer}` as `{plan.name}`\n\n"
                  f"From the rollout shards of run `{plan.run_id}` (`{record['parent_run_dir']}`), no generation; "
                  f"the new shards are in `{plan.out_dir}`. Train on them with `areal-pipeline branch --from "
                  f"{plan.run_id} --at K --replay --rescored {plan.name} --run-id NEW`.\n\n"
                  "| iteration | trajectories | reward before | reward after | advantage sign flips "
                  f"| r(before, after) |\n|---|---|---|---|---|---|\n{rows}\n"),
        description=f"{plan.run_id} rescored by {plan.scorer}")


def _r(summary: dict[str, Any]) -> str:
    r = summary.get("reward_correlation")
    return "-" if r is None else f"{r:.2f}"


@flow(name="rescore", flow_run_name="{run_id}: rescored by {scorer}", persist_result=True, result_serializer="json")
def rescore(run_id: str, scorer: str, output_dir: str = "runs", reward: Optional[str] = None,
            group_reward: Optional[str] = None, iterations: Optional[str] = None, name: Optional[str] = None,
            overrides: Optional[list[str]] = None) -> dict[str, Any]:
    """Score run `run_id`'s stored rollouts (in `output_dir`) again with `reward` (a reward function, "module:attr")
    or `group_reward` (a group reward: "judge" or "module:attr"), over `iterations` ("A:B"; default all), into
    rescored/<name>/ beside them. `scorer` names the reward in the flow run's name."""
    with labels.crashed_if_forced_to_exit(runtime.flow_run.id):  # marked Crashed if forced to exit
        plan = plan_rescore(Path(output_dir) / run_id, reward=reward, group_reward=group_reward, iterations=iterations,
                            name=name, overrides=overrides)
        check_sources(plan)  # every iteration refused or none: no re-scoring stops half-way on a bad shard
        # a group reward's calls take the Prefect limit every run on the server shares (tasks/judge_limit.py), and the
        # run's own judge (judge.serve) is served for the re-scoring
        with shared_judge_limit() if plan.group_reward else contextlib.nullcontext(), plan.judge_served() as served:
            summaries = [rescore_iteration_task(served, k) for k in plan.iterations]
        record = write_lineage(plan, summaries)
        _tag_and_record(plan, record)
        get_run_logger().info("rescored %d iteration(s) of %s by %s into %s", len(summaries), run_id, plan.scorer,
                              plan.out_dir)
        return {**record, "out_dir": str(plan.out_dir)}


def main(args) -> None:
    """`areal-pipeline rescore`: checks first (a clear error, nothing started), then runs the flow against the
    configured Prefect API or a temporary one, and prints where the new shards are."""
    from areal_pipeline.config import ConfigError
    from flows.api_server import prefect_api

    try:
        plan = plan_rescore(Path(args.output_dir) / args.run_id, reward=args.reward, group_reward=args.group_reward,
                            iterations=args.iterations, name=args.name, overrides=args.overrides)
        check_sources(plan)
    except (RescoreError, ConfigError) as error:
        sys.exit(f"rescore error: {error}")
    with prefect_api():
        try:
            record = rescore(run_id=args.run_id, scorer=plan.scorer, output_dir=args.output_dir, reward=args.reward,
                             group_reward=args.group_reward, iterations=args.iterations, name=plan.name,
                             overrides=args.overrides)
        except RescoreError as error:
            sys.exit(f"rescore error: {error}")
    print(f"\n{args.run_id} rescored by {plan.scorer}: {len(record['iterations'])} iteration(s) in {plan.out_dir}")
    for s in record["iterations"]:
        if s["iteration"] in plan.iterations:
            print(f"  iteration {s['iteration']}: reward {s['reward_mean_before']:.3f} -> {s['reward_mean_after']:.3f}"
                  f", advantage sign flips {s['advantage_sign_flips']:.2f}, r(before, after) {_r(s)}")
    print(f"  lineage: {plan.out_dir / 'rescore.json'}")
    print(f"  train on them: areal-pipeline branch --from {args.run_id} --at K --replay --rescored {plan.name} "
          f"--run-id NEW --output-dir {args.output_dir}")
