"""The Prefect flows on Prefect's real engine with a temporary SQLite database, real servers and trainer."""

from __future__ import annotations

import asyncio
import datetime
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import psutil
import pytest
import torch
from safetensors.torch import load_file

from areal_pipeline.forkserver import processes_of
from test_evaluation import greedy_completions

REPO = Path(__file__).resolve().parents[1]


def fast_overrides(tmp_path: Path, model_dir: Path, run_id: str = "t", iterations: int = 3,
                   per_flow_run: int = 1) -> list[str]:
    return [f"output_dir={tmp_path}", f"run_id={run_id}", f"model.path={model_dir}", f"total_iterations={iterations}",
            "rollout.batch_size=4", "rollout.gconfig.n_samples=4", "rollout.gconfig.max_new_tokens=8",
            "eval_freq=3", "eval_max_prompts=8", "trainer.optimizer.lr=1e-3", "dataset.arithmetic_train_size=64",
            f"iterations_per_flow_run={per_flow_run}"]


def wait_until(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def final_weights(run_dir: Path, k: int) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"step_{k}" / "model" / "model.safetensors"))


async def _flow_runs(name_prefix: str):
    """The flow runs whose name starts with `name_prefix` (Prefect's `like_` matches anywhere in the name: "g/iter-"
    would also find "long/iter-1", a run of another test in the worker's API)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    async with get_client() as client:
        runs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_=name_prefix)))
    return [r for r in runs if r.name.startswith(name_prefix)]


async def _artifacts(key: str):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    async with get_client() as client:
        return await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))


def assert_run_artifacts(run_dir: Path, run_id: str, iterations: list[int]) -> list[dict]:
    """The run's table artifact has a row per iteration (`iterations`, 0 for the initial evaluation), figure for
    figure its metrics.jsonl (significant digits), without columns no iteration fills; its curves artifact shows
    the PNG. Returns the rows."""
    from flows.artifacts import artifact_key

    (table,) = asyncio.run(_artifacts(artifact_key(run_id, "metrics")))  # updated in place: one version a run
    rows = json.loads(table.data)
    assert [row["iteration"] for row in rows] == iterations
    records = {r["iteration"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    for row in rows:
        for name, value in row.items():
            expected = records[row["iteration"]].get(name) if row["iteration"] else (
                json.loads((run_dir / "iter_0" / "eval.json").read_text())["pass_at_1"]
                if name == "eval_pass_at_1" else value)
            assert value == (expected if not isinstance(expected, float) else float(f"{expected:.4g}")), name
    assert all(any(row[name] is not None for row in rows) for name in rows[0])
    # no reference model, no dual clip: no column of theirs
    assert {"kl", "dual_clip_fraction"}.isdisjoint(rows[0]) and {"clip_fraction", "loss"} <= set(rows[0])
    (curves,) = asyncio.run(_artifacts(artifact_key(run_id, "reward-curve")))
    assert "data:image/png;base64," in curves.data
    return rows


def assert_samples(markdown: str, run_dir: Path, k: int) -> None:
    """An iteration card's samples: the best and the worst episodes of iteration k, from different prompts, each
    with its prompt, the data set's reference answer, its completion and reward, as the rollout shards hold them."""
    from areal_pipeline.data.shards import read_table

    rows = {(r["prompt_id"], r["sample_idx"]): r for r in read_table(run_dir / f"iter_{k}" / "rollout").to_pylist()}
    (records_path,) = run_dir.parent.glob("_datasets/*/train.jsonl")
    dataset = {r["prompt_id"]: r for r in map(json.loads, records_path.read_text().splitlines())}
    shown = []
    for section in markdown.split("### ")[1:]:
        label, rest = section.split(": ", 1)
        prompt_id, sample = rest.split(" (sample ", 1)
        row = rows[(prompt_id, int(sample.split(")")[0]))]
        assert label in ("best", "worst") and f"reward {row['reward']:.3g}" in section
        assert f"**Prompt**\n\n```\n{dataset[prompt_id]['messages'][0]['content']}\n```" in section
        assert f"**Reference answer**: `{dataset[prompt_id]['answer']}`" in section
        assert f"**Completion**\n\n```\n{row['text']}\n```" in section or "`" in row["text"]
        shown.append((label, prompt_id, row["reward"]))
    assert len({prompt_id for _, prompt_id, _ in shown}) == len(shown) >= 2
    assert shown[0][0] == "best" and shown[0][2] == max(r["reward"] for r in rows.values())
    assert shown[-1][0] == "worst" and shown[-1][2] == min(r["reward"] for r in rows.values())


async def _initial_evaluations(run_id: str):
    """The evaluate-0 task runs of the train flow runs of `run_id` (given as an override)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterId,
                                                TaskRunFilter, TaskRunFilterName)

    async with get_client() as client:
        trains = await client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["train"])))
        ids = [r.id for r in trains if f"run_id={run_id}" in (r.parameters.get("overrides") or [])
               or r.parameters.get("run_id") == run_id]
        return await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids)),
                                           task_run_filter=TaskRunFilter(name=TaskRunFilterName(any_=["evaluate-0"])))


async def _library_logs(since):
    """Records of the project's own loggers (not Prefect's) that reached the Prefect API at or after `since` (a
    datetime: the worker's API holds the logs of earlier tests too)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterTimestamp

    async with get_client() as client:
        logs = await client.read_logs(log_filter=LogFilter(timestamp=LogFilterTimestamp(after_=since)), limit=200)
    return [log for log in logs if log.name.startswith("areal_pipeline")]


async def _flow_runs_tagged(tag: str):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    async with get_client() as client:
        return await client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[tag])))


async def _parent_flow_run_id(flow_run):
    from prefect.client.orchestration import get_client

    async with get_client() as client:
        return (await client.read_task_run(flow_run.parent_task_run_id)).flow_run_id


async def _run_logs(flow_run_ids) -> list:
    """Every log record the API holds for these flow runs (and their task runs), oldest first."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    logs = []
    async with get_client() as client:
        while True:
            page = await client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=list(flow_run_ids))),
                                          limit=200, offset=len(logs), sort=LogSort.TIMESTAMP_ASC)
            logs += page
            if len(page) < 200:
                return logs


def assert_found_by_run_id(run_id: str, iterations: list[str], *more_tags: str, config: str = "tiny_cpu") -> None:
    """The run's `train` flow run is named after the run id (also where it came as an override, not as the run_id
    parameter, which then shows the resolved id), and the search by tag `run:<id>` finds it and its iteration
    runs, all tagged with the config and workflow."""
    tagged = asyncio.run(_flow_runs_tagged(f"run:{run_id}"))
    assert sorted(r.name for r in tagged) == sorted([run_id, *iterations]), [r.name for r in tagged]
    (parent,) = [r for r in tagged if r.name == run_id]
    assert parent.parameters["run_id"] == run_id
    for r in tagged:
        assert {f"run:{run_id}", f"config:{config}", "workflow:rlvr", *more_tags} <= set(r.tags), (r.name, r.tags)
        if r is not parent:
            assert asyncio.run(_parent_flow_run_id(r)) == parent.id, r.name


async def _artifacts_of(flow_run_ids) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    async with get_client() as client:
        return await client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=list(flow_run_ids))))


def assert_the_token_is_nowhere(run_dir: Path, run_id: str) -> None:
    """The run's credential (the session's, which its services demanded) is in no file of the run's directory
    (its config copies, logs, shards, checkpoints, the trainer's config), no parameter, artifact or log record of
    its flow runs, and no command line of its services (their log's first line quotes it)."""
    token = os.environ["AREAL_PIPELINE_TOKEN"]
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert len(files) > 20 and any(p.name == "config.yaml" for p in files), files
    assert not [p for p in files if token.encode() in p.read_bytes()]
    runs = asyncio.run(_flow_runs_tagged(f"run:{run_id}"))
    assert runs and not [r.name for r in runs if token in json.dumps(r.parameters, default=str)]
    artifacts = asyncio.run(_artifacts_of([r.id for r in runs]))
    assert artifacts and not [a.key for a in artifacts if token in json.dumps(a.data, default=str)
                              + str(a.description)]
    logs = asyncio.run(_run_logs([r.id for r in runs]))
    assert logs and not [log.message for log in logs if token in log.message]


async def _task_runs(flow_run_id):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async with get_client() as client:
        return await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))


def recorded_final(run) -> bool:
    """A task run read from the API has ended: one read before its first state is written has no state yet (task-run
    states reach the database in batches, see flows/__init__.py)."""
    return run.state is not None and run.state.is_final()


def recorded_nodes(child_runs) -> list[dict]:
    """Each iteration run's task runs by node name, once the API has them all finished (task-run states reach
    the database in batches, up to 5 s late: see flows/__init__.py). With `fast_overrides` every iteration runs
    rollout, advantages, ppo_update and broadcast_weights; the last one also checkpoint and evaluate."""
    def finished_nodes(run, last: bool):
        runs = {r.name.rsplit("-", 1)[0]: r for r in asyncio.run(_task_runs(run.id))}
        return runs if len(runs) == 4 + 2 * last and all(map(recorded_final, runs.values())) else None

    return [wait_until(lambda: finished_nodes(run, run is child_runs[-1]), 60, f"the task runs of {run.name}",
                       interval=1) for run in child_runs]


def assert_nodes_do_not_overlap(child_runs) -> None:
    """Iteration k+1's run may start while iteration k's run is still going (their bookkeeping overlaps), but
    its first node starts only after iteration k's last node ended."""
    nodes = recorded_nodes(child_runs)
    for following, run_nodes, following_nodes in zip(child_runs[1:], nodes, nodes[1:]):
        assert (min(n.start_time for n in following_nodes.values())
                >= max(n.end_time for n in run_nodes.values())), following.name


def test_async_iterations_roll_out_during_the_previous_update(prefect_api, tiny_model_dir, tmp_path,
                                                              monkeypatch):
    """eta = 1: iteration k+1's rollout and advantages run while iteration k's ppo_update runs, and its own
    update waits until iteration k's last node is done."""
    from areal_pipeline.pipeline import Pipeline
    from flows.train import train

    from areal_pipeline.data.shards import has_manifest

    real_update = Pipeline.ppo_update

    def update_after_the_next_batch(self, k, *inputs):
        # iteration k's update ends only once iteration k+1's rollout and advantages are done: they cannot wait for
        # it (a run that did would time out here), whatever the machine's load makes of the timing
        if k < 3:
            wait_until(lambda: has_manifest(self.paths.batch(k + 1)), 300, f"iteration {k + 1}'s batch")
        return real_update(self, k, *inputs)

    monkeypatch.setattr(Pipeline, "ppo_update", update_after_the_next_batch)
    train(config_path=str(REPO / "configs/tiny_cpu.yaml"),
          overrides=fast_overrides(tmp_path, tiny_model_dir, run_id="asy", iterations=3)
          + ["rollout.max_head_offpolicyness=1"])
    child_runs = sorted(asyncio.run(_flow_runs("asy/iter-")), key=lambda r: r.name)
    assert [r.name for r in child_runs] == ["asy/iter-1", "asy/iter-2", "asy/iter-3"]
    assert all(r.state.is_completed() for r in child_runs)

    nodes = recorded_nodes(child_runs)
    for run, following in zip(child_runs, child_runs[1:]):
        assert following.created < run.end_time, (run.name, following.name)  # started during run's update
    for before, after in zip(nodes, nodes[1:]):
        assert after["rollout"].start_time >= before["advantages"].end_time
        assert after["advantages"].end_time <= before["ppo_update"].end_time  # ran during the update
        assert after["ppo_update"].start_time >= max(n.end_time for n in before.values())
    records = [json.loads(line) for line in (tmp_path / "asy" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2, 3] and max(r["staleness"] for r in records) <= 1


def test_three_iterations_end_to_end_with_artifacts(prefect_api, tiny_model_dir, tmp_path):
    from flows.train import train

    before = {p.pid for p in processes_of(os.getpid(), forkserver=False)}  # e.g. session fixtures' servers
    logs_since = datetime.datetime.now(datetime.timezone.utc)
    result = train(config_path=str(REPO / "configs/tiny_cpu.yaml"),
                   overrides=fast_overrides(tmp_path, tiny_model_dir, run_id="e2e"))
    run_dir = tmp_path / "e2e"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2, 3]
    assert records[-1]["eval_pass_at_1"] is not None and records[0]["eval_pass_at_1"] is None
    for r in records:
        assert r["staleness"] == 0 and r["time_rollout"] > 0 and math.isfinite(r["grad_norm"]) and r["lr"] > 0
    assert (run_dir / "reward_curve.png").stat().st_size > 1000 and result["curve"].endswith("reward_curve.png")
    assert (run_dir / "checkpoints" / "step_3" / "trainer_state.json").is_file()
    # the config checkpoints every 10 iterations and after the last
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_3"]
    child_runs = asyncio.run(_flow_runs("e2e/iter-"))
    assert sorted(r.name for r in child_runs) == ["e2e/iter-1", "e2e/iter-2", "e2e/iter-3"]
    assert all(r.state.is_completed() for r in child_runs)
    assert_found_by_run_id("e2e", ["e2e/iter-1", "e2e/iter-2", "e2e/iter-3"])
    assert_nodes_do_not_overlap(sorted(child_runs, key=lambda r: r.name))
    assert_run_artifacts(run_dir, "e2e", [0, 1, 2, 3])
    # the initial policy's evaluation, before iteration 1 (evaluate-0 in the flow's set-up)
    initial = json.loads((run_dir / "iter_0" / "eval.json").read_text())
    assert initial["version"] == 0 and initial["num_prompts"] == 8
    evaluated_at = (run_dir / "iter_0" / "eval.json").stat().st_mtime_ns
    # the last iteration's card: its metrics, and samples of the best and worst episodes, each with its prompt
    (card,) = asyncio.run(_artifacts("e2e-iter-0003"))
    assert "| reward_mean |" in card.data and card.description.startswith("e2e iteration 3")
    assert_samples(card.data, run_dir, 3)
    # iterations without a card of their own (cards at most every 2 s) are named on the next card
    carded = [k for k in (1, 2, 3) if asyncio.run(_artifacts(f"e2e-iter-{k:04d}"))]
    for previous, k in zip(carded, carded[1:]):
        (shown,) = asyncio.run(_artifacts(f"e2e-iter-{k:04d}"))
        note = f"Iterations {previous + 1}..{k - 1} have no card of their own"
        assert (note in shown.data) == (k - previous > 1), (k, shown.data[:300])
    library_logs = wait_until(lambda: asyncio.run(_library_logs(logs_since)), 30, "library logs in the Prefect API")
    assert any("inference servers ready" in log.message for log in library_logs)
    left = [p for p in processes_of(os.getpid(), forkserver=False) if p.pid not in before]
    assert not left, [(p.pid, p.cmdline(), p.status()) for p in left]  # teardown left nothing behind
    assert_the_token_is_nowhere(run_dir, "e2e")

    # a second call with the same run id finds every iteration finished: nothing is redone
    again = train(config_path=str(REPO / "configs/tiny_cpu.yaml"),
                  overrides=fast_overrides(tmp_path, tiny_model_dir, run_id="e2e"))
    assert again["iterations"] == 3 and len(asyncio.run(_flow_runs("e2e/iter-"))) == 3
    # ... nor the initial evaluation: its node (in each run's set-up) finds its output made
    assert (run_dir / "iter_0" / "eval.json").stat().st_mtime_ns == evaluated_at
    evaluations = wait_until(lambda: (lambda found: found if len(found) == 2 and all(map(recorded_final, found))
                                      else None)(asyncio.run(_initial_evaluations("e2e"))),
                             60, "the two runs' evaluate-0 task runs", interval=1)
    assert all(r.state.is_completed() for r in evaluations)


def test_a_failed_run_shows_its_table_and_curves_while_it_runs_and_after(prefect_api, tiny_model_dir, tmp_path,
                                                                        monkeypatch):
    """With the live artifacts updated after every iteration: read while iteration 3 updates, the run's table
    holds iterations 0..2 and its curves are there; iteration 3 then fails, and after the failed run both hold
    the iterations that finished."""
    from areal_pipeline.pipeline import Pipeline
    from flows import artifacts
    from flows.train import train

    monkeypatch.setattr(artifacts, "LIVE_INTERVAL_S", 0.0)
    real_update = Pipeline.ppo_update
    seen = {}

    def failing_update(self, k, *inputs):
        if k == 3:
            def table():
                found = asyncio.run(_artifacts("fails-metrics"))
                return found if found and len(json.loads(found[0].data)) == 3 else None
            seen["rows"] = [r["iteration"] for r in json.loads(wait_until(table, 60, "the live table")[0].data)]
            seen["curves"] = asyncio.run(_artifacts("fails-reward-curve"))[0].data
            raise ValueError("iteration 3 fails here")
        return real_update(self, k, *inputs)

    monkeypatch.setattr(Pipeline, "ppo_update", failing_update)
    with pytest.raises(ValueError, match="iteration 3 fails here"):
        train(config_path=str(REPO / "configs/tiny_cpu.yaml"),
              overrides=fast_overrides(tmp_path, tiny_model_dir, run_id="fails", iterations=4))
    assert seen["rows"] == [0, 1, 2] and "data:image/png;base64," in seen["curves"]
    assert_run_artifacts(tmp_path / "fails", "fails", [0, 1, 2])


def test_a_train_run_with_a_missing_config_fails_with_the_reason(prefect_api, tmp_path):
    """The run's name cannot come from a config that is not there: the flow run is named after the file, and
    ends Failed with the config error."""
    from areal_pipeline.config import ConfigError
    from flows.train import train

    missing = tmp_path / "no-such-config.yaml"
    with pytest.raises(ConfigError, match="config file not found"):
        train(config_path=str(missing))
    (run,) = asyncio.run(_flow_runs("train no-such-config"))
    assert run.state.is_failed(), run.state


def test_iterations_share_flow_runs_and_keep_a_task_run_per_node(prefect_api, tiny_model_dir, tmp_path):
    """iterations_per_flow_run=3 over 4 iterations: flow runs g/iter-1..3 and g/iter-4, each iteration's nodes
    their own task runs (`<node>-<k>`), in order and never overlapping; the run's records as with a flow run each."""
    from flows.train import train

    train(config_path=str(REPO / "configs/tiny_cpu.yaml"),
          overrides=fast_overrides(tmp_path, tiny_model_dir, run_id="g", iterations=4, per_flow_run=3))
    runs = sorted(asyncio.run(_flow_runs("g/iter-")), key=lambda r: r.name)
    assert [(r.name, r.state.type.value) for r in runs] == [("g/iter-1..3", "COMPLETED"), ("g/iter-4", "COMPLETED")]

    def finished(run, expected: int):
        found = [r for r in asyncio.run(_task_runs(run.id)) if recorded_final(r)]
        return found if len(found) == expected else None

    # every iteration: rollout, advantages, ppo_update, broadcast_weights; iteration 3 also evaluate (eval_freq=3),
    # iteration 4 (the last) checkpoint and evaluate
    task_runs = [task_run for run, expected in zip(runs, (3 * 4 + 1, 4 + 2))
                 for task_run in wait_until(lambda: finished(run, expected), 60, f"the task runs of {run.name}", 1)]
    by_iteration: dict[int, dict[str, object]] = {}
    for task_run in task_runs:
        node, k = task_run.name.rsplit("-", 1)
        by_iteration.setdefault(int(k), {})[node] = task_run
    assert sorted(by_iteration) == [1, 2, 3, 4] and all(r.state.is_completed() for r in task_runs)
    assert set(by_iteration[4]) == {"rollout", "advantages", "ppo_update", "broadcast_weights", "checkpoint",
                                    "evaluate"}
    for k in (1, 2, 3):
        before, after = by_iteration[k].values(), by_iteration[k + 1].values()
        assert min(n.start_time for n in after) >= max(n.end_time for n in before), k
    records = [json.loads(line) for line in (tmp_path / "g" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2, 3, 4]
    assert all((tmp_path / "g" / f"iter_{k}" / "orchestration.json").is_file() for k in range(1, 5))
    assert {r.name for r in asyncio.run(_flow_runs("g/iter-"))} == {"g/iter-1..3", "g/iter-4"}


def test_evaluate_flow_scores_the_newest_checkpoint(prefect_api, tiny_model_dir, tmp_path):
    from areal_pipeline.data.datasets import load_records
    from areal_pipeline.rewards.math import math_reward
    from areal_pipeline.run_spec import load_config
    from flows.evaluate import evaluate
    from flows.train import train

    overrides = fast_overrides(tmp_path, tiny_model_dir, run_id="ev", iterations=1)
    train(config_path=str(REPO / "configs/tiny_cpu.yaml"), overrides=overrides)
    result = evaluate(config_path=str(REPO / "configs/tiny_cpu.yaml"), overrides=overrides)
    model_dir = tmp_path / "ev" / "checkpoints" / "step_1" / "model"
    assert result["model"] == str(model_dir)
    # what the checkpoint answers the first 8 test questions greedily, decoded here by transformers, and scored
    records = load_records(load_config(REPO / "configs/tiny_cpu.yaml", overrides).dataset, "test", seed=1)[:8]
    completions = greedy_completions(model_dir, records, max_new_tokens=8)
    expected = sum(math_reward(c, r["answer"]) for c, r in zip(completions, records)) / 8
    assert (result["num_prompts"], result["pass_at_1"], result["reward_mean"]) == (8, expected, expected)
    assert asyncio.run(_artifacts("ev-evaluation"))
    # found in the UI as the run's: named after it and tagged with it, like its train and iteration runs
    (run,) = [r for r in asyncio.run(_tagged("run:ev")) if "evaluate" in r.tags]
    assert run.name == "ev/evaluate" and {"run:ev", "config:tiny_cpu"} <= set(run.tags), run


def test_ppo_update_failing_on_first_attempt_succeeds_on_retry(prefect_api, tiny_model_dir, tmp_path, monkeypatch):
    """The trainer dies during an update node: the task fails, and its retry restarts the trainer, restores
    version k - 1 (here by replaying update 1 from its batch shards: the config checkpoints every 10
    iterations) and trains again."""
    from areal_pipeline.training.client import TrainerClient
    from flows.train import train
    from tasks import runs

    killed = {}
    real_call = TrainerClient.call

    def call(self, cmd, *args, **kwargs):
        # An update takes ~0.1 s: killing the rank when the trainer reports itself busy races with its end.
        # So the rank dies as iteration 2's train command is sent, which then finds no trainer.
        if cmd == "train" and kwargs.get("iteration") == 2 and not killed:
            trainer = runs.get("retry").pipeline.services.trainer
            # the rank: the trainer process itself where it was forked (one rank), torchrun's child otherwise
            launched = psutil.Process(trainer.popen.pid)
            (rank,) = [p for p in [launched, *launched.children()] if "trainer_server" in " ".join(p.cmdline())]
            killed["pid"] = rank.pid
            rank.kill()
            rank.wait(10)
        return real_call(self, cmd, *args, **kwargs)

    monkeypatch.setattr(TrainerClient, "call", call)
    train(config_path=str(REPO / "configs/tiny_cpu.yaml"),
          overrides=fast_overrides(tmp_path, tiny_model_dir, run_id="retry", iterations=2))
    assert "pid" in killed
    update = json.loads((tmp_path / "retry" / "iter_2" / "update.json").read_text())
    assert update["version"] == 2

    async def update_attempts():
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName

        async with get_client() as client:
            runs = await client.read_task_runs(task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_="ppo_update")))
            child = [r.id for r in await _flow_runs("retry/iter-2")]
            return [r for r in runs if r.flow_run_id in child]
    # Task-run states reach the database in batches (up to 5 s late, see flows/__init__.py): a task run can be
    # read before its first state has been written, with no state at all.
    (task_run,) = wait_until(lambda: [r for r in asyncio.run(update_attempts())
                                      if r.state is not None and r.state.is_completed()] or None,
                             60, "the recorded ppo_update task run to complete", interval=1)
    assert task_run.run_count == 2

    # The run's logs: the failed attempt and its retry are there, the "Finished in state Completed()" of every
    # node is not (flows/run_logs.py). The train run's own last record arrives once every earlier one has.
    flow_runs = asyncio.run(_flow_runs_tagged("run:retry"))
    (train_run,) = [r for r in flow_runs if r.name == "retry"]

    def sent_until_the_end():
        logs = asyncio.run(_run_logs([r.id for r in flow_runs]))
        return logs if any(log.flow_run_id == train_run.id and log.task_run_id is None
                           and log.message.startswith("Finished in state Completed") for log in logs) else None

    logs = wait_until(sent_until_the_end, 30, "the run's logs in the API", interval=1)
    retried = [log for log in logs if log.task_run_id == task_run.id]
    assert any("Task run failed with exception" in log.message and "Retry 1/" in log.message for log in retried), (
        [log.message for log in retried])
    assert not [log.message for log in logs if log.task_run_id is not None
                and log.message.startswith("Finished in state")]
    assert {log.name for log in logs} >= {"prefect.task_runs", "prefect.flow_runs"}


def cli(*args: str, env: dict, log: Optional[Path] = None, **kwargs) -> subprocess.Popen:
    """`areal-pipeline ARGS`, its output on a pipe (read it: `communicate`), or into the file `log`."""
    if log is None:
        return subprocess.Popen([sys.executable, "-m", "cli", *args], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "cli", *args], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, **kwargs)


def serve_cli(log: Path, *args: str, env: dict) -> subprocess.Popen:
    """`areal-pipeline serve ARGS`, its output (its runner relays every deployment run's) into the file `log`: a
    pipe no one reads until the end fills, and then serve, and the run whose output it relays, block on a write."""
    return cli("serve", *args, env=env, log=log, start_new_session=True)


def test_killed_run_reruns_to_bitwise_equal_weights(prefect_api, tiny_model_dir, tmp_path):
    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    config = ["--config", "configs/tiny_cpu.yaml"]
    # a checkpoint every iteration: the rerun starts from iteration 1's (the retry test covers replaying)
    every = ["save_freq=1"]
    reference = cli("train", *config, *fast_overrides(tmp_path, tiny_model_dir, run_id="ref"), *every, env=env)

    victim = cli("train", *config, *fast_overrides(tmp_path, tiny_model_dir, run_id="victim"), *every, env=env)
    marker = tmp_path / "victim" / "iter_2" / "rollout" / "manifest.json"
    wait_until(lambda: marker.exists() or victim.poll() is not None, 600, "iteration 2's rollout", interval=0.05)
    assert victim.poll() is None, victim.stdout.read()
    victim.kill()  # SIGKILL: no clean-up code runs
    victim.wait()
    # the services notice their launcher is gone and exit by themselves
    wait_until(lambda: processes_of(victim.pid) == [], 30, "the killed run's services to exit")

    out, _ = reference.communicate(timeout=600)
    assert reference.returncode == 0, out
    rerun = cli("train", *config, *fast_overrides(tmp_path, tiny_model_dir, run_id="victim"), *every, env=env)
    out, _ = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, out
    assert "iterations 1..1 are finished; continuing at 2" in out
    assert sorted(p.name for p in (tmp_path / "victim" / "checkpoints").iterdir()) == ["step_2", "step_3"]
    a, b = final_weights(tmp_path / "ref", 3), final_weights(tmp_path / "victim", 3)
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
    assert "mean reward" in out and "reward curve:" in out
    # the killed command's train run and its iteration-2 run stayed Running in the API; the rerun marked them
    # Crashed (their process is gone), so that no run of `victim` still looks alive
    runs = asyncio.run(_tagged("run:victim"))
    assert not [r.name for r in runs if r.state.type.value in ("RUNNING", "PENDING")], runs
    crashed = {r.name for r in runs if r.state.type.value == "CRASHED"}  # iteration 1's too, were it still reporting
    assert {"victim", "victim/iter-2"} <= crashed, [(r.name, r.state.type.value) for r in runs]
    assert "were left running by a process that is gone: marked Crashed" in out, out


async def _tagged(tag: str):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    async with get_client() as client:
        return await client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[tag])))


def test_sigterm_mid_update_stops_the_run_and_its_services_promptly(prefect_api, tiny_model_dir, tmp_path):
    """SIGTERM (a cancelled deployment run, `kill`) while an iteration's update runs in its worker thread:
    the services are stopped at once, nothing is retried, and the process exits non-zero."""
    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    overrides = fast_overrides(tmp_path, tiny_model_dir, run_id="term", iterations=50)
    # Updates long enough (~1 s: 256 unshared sequences in micro-batches of ~2) that the signal, sent when this
    # test sees iteration 2's batch, lands during iteration 2's update even when the busy machine delays the test
    # by a few tenths of a second: iteration 3's rollout must not have started by then.
    slow_update = ["rollout.batch_size=64", "trainer.share_prefix=false", "trainer.mb_max_tokens=128"]
    run = cli("train", "--config", "configs/tiny_cpu.yaml", *overrides, *slow_update, env=env,
              start_new_session=True)
    marker = tmp_path / "term" / "iter_2" / "batch" / "manifest.json"
    wait_until(lambda: marker.exists() or run.poll() is not None, 600, "iteration 2's update", interval=0.02)
    assert run.poll() is None, run.stdout.read()
    # the server and the trainer are forks of the command's forkserver (their imports done once, there)
    forked = [p for p in processes_of(run.pid, forkserver=False) if p.parent().ppid() == run.pid]
    assert all("multiprocessing.forkserver" in " ".join(p.parent().cmdline()) for p in forked), forked
    assert sorted(" ".join(p.cmdline()).split()[2] for p in forked) == ["areal_pipeline.inference.server",
                                                      "areal_pipeline.training.trainer_server"]
    run.send_signal(signal.SIGTERM)
    out, _ = run.communicate(timeout=60)
    assert run.returncode != 0, out
    wait_until(lambda: processes_of(run.pid) == [], 60, "the run's processes to exit")
    assert "Retrying" not in out, out
    assert not (tmp_path / "term" / "iter_3" / "rollout" / "manifest.json").exists()


def test_same_run_id_twice_is_refused(prefect_api, tiny_model_dir, tmp_path):
    from areal_pipeline.run_dir import RunLockedError, run_lock
    from flows.train import train

    with run_lock(tmp_path / "busy"):
        with pytest.raises(RunLockedError, match="already running"):
            train(config_path=str(REPO / "configs/tiny_cpu.yaml"),
                  overrides=fast_overrides(tmp_path, tiny_model_dir, run_id="busy"))


async def wait_for_deployment(client, name: str, run_id: Optional[str] = None):
    """The deployment `name` once registered (with `run_id`: once served for that run id, as `run_id` or an override,
    since an earlier test's `serve` in the worker's Prefect API may have registered it for another)."""
    from prefect.exceptions import ObjectNotFound

    for _ in range(600):
        try:
            deployment = await client.read_deployment_by_name(name)
        except ObjectNotFound:
            deployment = None
        if deployment is not None and (run_id is None or deployment.parameters.get("run_id") == run_id
                                       or f"run_id={run_id}" in (deployment.parameters.get("overrides") or [])):
            return deployment
        await asyncio.sleep(0.2)
    raise AssertionError(f"deployment {name} never registered" + (f" for run {run_id}" if run_id else ""))


def stop_serve(serve: subprocess.Popen) -> None:
    """Stop `areal-pipeline serve` (and the deployment runs it started) as Ctrl-C does."""
    os.killpg(serve.pid, signal.SIGINT)
    try:
        serve.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(serve.pid, signal.SIGKILL)


def test_scheduled_deployment_registers_and_a_triggered_run_completes(prefect_api, tiny_model_dir, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType

    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    serve = serve_cli(tmp_path / "serve.log", "--config", "configs/tiny_cpu.yaml", "--iterations", "1",
                      "--interval", "86400", *fast_overrides(tmp_path, tiny_model_dir, run_id="served"), env=env)

    async def scenario():
        async with get_client() as client:
            train_dep = await wait_for_deployment(client, "train/train", run_id="served")
            await wait_for_deployment(client, "evaluate/evaluate", run_id="served")
            assert train_dep.schedules and train_dep.parameters["iterations"] == 1
            assert train_dep.global_concurrency_limit.limit == 1  # one at a time: the next waits its turn
            # two at once (a person's Run beside a scheduled one): the second waits for the first, then continues
            # the same run id for one more iteration, rather than fail on the run's lock
            runs = [await client.create_flow_run_from_deployment(train_dep.id) for _ in range(2)]
            for _ in range(3000):
                runs = [await client.read_flow_run(run.id) for run in runs]
                if all(run.state.is_final() for run in runs):
                    break
                await asyncio.sleep(0.2)
            histories = [[s.name for s in await client.read_flow_run_states(run.id)] for run in runs]
            return train_dep, [run.state.type for run in runs], histories

    try:
        deployment, finished, histories = asyncio.run(scenario())
        assert finished == [StateType.COMPLETED, StateType.COMPLETED]
        assert any("AwaitingConcurrencySlot" in history for history in histories), histories
    finally:
        stop_serve(serve)
    lines = (tmp_path / "served" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["iteration"] for line in lines] == [1, 2]
    # a deployment run (no command line of the project's around it) keeps the run's log file too
    log = (tmp_path / "served" / "logs" / "train.log").read_text()
    assert log.count("==== ") == 2 and "flow run served" in log and "inference servers ready" in log, log[-2000:]
    # stopping serve deleted its schedules (not only paused them): a later `prefect deploy` of the same deployment
    # cannot bring them back, and no scheduled run of it is left for a worker to pick up

    async def afterwards():
        from prefect.client.schemas.filters import (DeploymentFilter, DeploymentFilterId, FlowRunFilter,
                                                    FlowRunFilterState, FlowRunFilterStateType)

        async with get_client() as client:
            scheduled = await client.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id])),
                flow_run_filter=FlowRunFilter(state=FlowRunFilterState(
                    type=FlowRunFilterStateType(any_=[StateType.SCHEDULED]))))
            return (await client.read_deployment(deployment.id)).schedules, scheduled
    assert asyncio.run(afterwards()) == ([], [])


def test_stopping_serve_stops_its_deployment_run_and_what_the_run_started(prefect_api, tiny_model_dir, tmp_path):
    """Ctrl-C to `areal-pipeline serve` while one of its deployment runs (`python -m prefect.engine`, which imports
    the flow by its module path) is mid-way: serve ends by the signal, and the run, its inference server and
    trainer end with it; the run ends in the API (not Running, which would hold the deployment's one-at-a-time
    slot from every later run until Prefect's lease on it expired, minutes later)."""
    from prefect.client.orchestration import get_client

    serve, log = start_serving_a_long_run(tmp_path, tiny_model_dir, prefect_api, "served-stop")

    async def start_a_long_run():
        async with get_client() as client:
            deployment = await wait_for_deployment(client, "train/train", run_id="served-stop")
            return (await client.create_flow_run_from_deployment(deployment.id)).id

    started: list[psutil.Process] = []
    try:
        flow_run_id = asyncio.run(start_a_long_run())
        marker = tmp_path / "served-stop" / "iter_2" / "rollout" / "manifest.json"
        wait_for_served_run(lambda: marker.exists() or serve.poll() is not None, flow_run_id,
                            "the run's second iteration")
        assert serve.poll() is None, log.read_text()[-3000:]
        started = psutil.Process(serve.pid).children(recursive=True)
        commands = [_command_line(p) for p in started]
        assert any("-m prefect.engine" in c for c in commands), commands  # the deployment run, as a worker's
        assert any("inference.server" in c for c in commands) and any("trainer_server" in c for c in commands), (
            commands)
    finally:
        stop_serve(serve)
    # it ended by Ctrl-C, not by stop_serve's SIGKILL
    assert serve.returncode not in (None, -signal.SIGKILL) and "no longer serving" in log.read_text(), (
        log.read_text()[-3000:])

    def gone(process: psutil.Process) -> bool:
        try:
            return process.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    wait_until(lambda: all(gone(p) for p in started), 30, "the run and its services to exit")
    state = asyncio.run(flow_run_state(flow_run_id))
    assert state.is_final(), (state, log.read_text()[-3000:])


async def flow_run_state(flow_run_id):
    from prefect.client.orchestration import get_client

    async with get_client() as client:
        return (await client.read_flow_run(flow_run_id)).state


def wait_for_served_run(predicate, flow_run_id, what: str, timeout: float = 480) -> None:
    """`wait_until` for a deployment run of `serve`; on a time-out, the run's states say where it stood (waiting
    for the deployment's slot, or running slowly)."""
    try:
        wait_until(predicate, timeout, what, interval=0.05)
    except AssertionError as timed_out:
        async def history():
            from prefect.client.orchestration import get_client

            async with get_client() as client:
                return [(s.name, s.timestamp.isoformat()) for s in await client.read_flow_run_states(flow_run_id)]
        raise AssertionError(f"{timed_out}; the flow run's states: {asyncio.run(history())}") from None


def _prefect_before_3_9() -> bool:
    """From the installed distribution's metadata: importing Prefect while the tests are collected would configure
    it before `flows` sets the project's defaults (the library loggers sent to the API among them)."""
    from importlib.metadata import version

    from packaging.version import Version

    return Version(version("prefect")) < Version("3.9")


@pytest.mark.xfail(_prefect_before_3_9(), reason="Prefect 3.8's runner exits on SIGTERM before its cancel of the "
                                                 "run reaches the API: the run stays Running")
def test_sigterm_to_serve_cancels_its_deployment_run(prefect_api, tiny_model_dir, tmp_path):
    """SIGTERM to the `serve` process alone (`kill`, a supervisor) while one of its deployment runs is mid-way:
    Prefect's runner cancels the runs it started, so the run ends Cancelled in the API (not Running, which would
    hold the train deployment's one-at-a-time slot from every later run), and serve, the run and its services
    exit, well within the forced exit's deadline."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType

    from areal_pipeline.shutdown import FORCED_EXIT_AFTER_S

    serve, log = start_serving_a_long_run(tmp_path, tiny_model_dir, prefect_api, "served-term")

    async def start_a_long_run():
        async with get_client() as client:
            deployment = await wait_for_deployment(client, "train/train", run_id="served-term")
            return (await client.create_flow_run_from_deployment(deployment.id)).id

    started: list[psutil.Process] = []
    try:
        flow_run_id = asyncio.run(start_a_long_run())
        marker = tmp_path / "served-term" / "iter_1" / "rollout" / "manifest.json"
        wait_for_served_run(lambda: marker.exists() or serve.poll() is not None, flow_run_id,
                            "the run's first rollout")
        assert serve.poll() is None, log.read_text()[-3000:]
        started = psutil.Process(serve.pid).children(recursive=True)
        serve.send_signal(signal.SIGTERM)
        serve.wait(5 * FORCED_EXIT_AFTER_S)
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
    assert serve.returncode != -signal.SIGKILL, log.read_text()[-3000:]
    state = asyncio.run(flow_run_state(flow_run_id))
    assert state.type == StateType.CANCELLED, (state, log.read_text()[-3000:])

    def gone(process: psutil.Process) -> bool:
        try:
            return process.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    wait_until(lambda: all(gone(p) for p in started), 30, "the run and its services to exit")


def _command_line(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return ""  # ended meanwhile


def test_a_sweep_started_from_its_served_deployment_runs_every_combination(prefect_api, tiny_model_dir, tmp_path):
    """The UI's Run on the `sweep` deployment of `areal-pipeline serve`, with an axis added to the served overrides:
    a train run per value, each a child of the sweep's flow run, and the sweep's table artifact."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    from flows.artifacts import artifact_key

    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    serve = serve_cli(tmp_path / "serve.log", "--config", "configs/tiny_cpu.yaml", "--iterations", "1",
                      *fast_overrides(tmp_path, tiny_model_dir, run_id="uisweep"), env=env)

    async def scenario():
        async with get_client() as client:
            deployment = await wait_for_deployment(client, "sweep/sweep", run_id="uisweep")
            assert deployment.parameters["max_parallel"] == 1
            axes = [a for a in deployment.parameters["axes"] if not a.startswith("trainer.optimizer.lr=")]
            run = await client.create_flow_run_from_deployment(deployment.id, parameters={
                "axes": [*axes, "trainer.optimizer.lr=1e-3,2e-3"], "max_parallel": 2})
            for _ in range(3000):
                run = await client.read_flow_run(run.id)
                if run.state.is_final():
                    break
                await asyncio.sleep(0.2)
            children = await client.read_flow_runs(flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run.id])))
            artifacts = await client.read_artifacts()
            return run, sorted(c.name for c in children if c.state.is_completed()), artifacts

    try:
        run, children, artifacts = asyncio.run(scenario())
    finally:
        stop_serve(serve)
    assert run.state.is_completed(), run.state
    assert children == ["uisweep-lr=1e-3", "uisweep-lr=2e-3"]
    for run_id in ("uisweep-lr=1e-3", "uisweep-lr=2e-3"):
        lines = (tmp_path / run_id / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["iteration"] for line in lines] == [1]
    table = next(a for a in artifacts if a.key == artifact_key("uisweep", "sweep"))
    assert sorted(row["run_id"] for row in json.loads(table.data)) == children


# The agent facts (agent/<key>) each workflow records, and nothing else records: with the random tiny model every
# answer is wrong (it writes blank lines greedily and random bytes when sampling), so the episodes' facts are
# known. Reflection retries once (max_turns 2); multi_turn asks again until its 3 turns are spent, each turn's reward
# -1 ((0 - 0.5) x 2), so the first turn's return is -1 - 0.9 - 0.81; ReMax's workflow is rlvr, which records none (its
# greedy baseline's reward is the rollout's, `baseline_reward`); the search agent counts its searches.
AGENT_FACTS = {
    "gsm8k_reflection": {"agent/first_turn_correct": 0.0, "agent/success": 0.0, "agent/num_turns": 2.0},
    "gsm8k_multi_turn": {"agent/first_turn_correct": 0.0, "agent/success": 0.0, "agent/num_turns": 3.0,
                         "agent/return": -1 - 0.9 - 0.81},
    "remax": {},
    "search_agent": {"agent/searched": 0.0, "agent/num_searches": 0.0},  # 8 random tokens never make a search tag
}


def without_timings(record: dict) -> dict:
    """An iteration's metrics less how long things took: what two runs of the same iterations share."""
    return {k: v for k, v in record.items()
            if not k.startswith("time_") and k not in ("rollout_tokens_per_s", "train_tokens_per_s")}


@pytest.mark.parametrize("config", list(AGENT_FACTS))
def test_every_agent_config_trains_through_the_train_flow(prefect_api, tiny_model_dir, tmp_path, config):
    """Each tutorial agent trains with its own config through the same `train` flow (shrunk to stay fast): its
    workflow's own facts in the metrics, and the final weights bit for bit those of the plain loop's run."""
    from areal_pipeline.pipeline import run_plain
    from areal_pipeline.run_spec import load_config
    from flows.train import train

    # Every answer is wrong, so normalised rewards and advantages would all be 0 and no update would change a
    # weight: with raw rewards shifted by +0.5 the sampled tokens are reinforced (multi_turn's turn returns are -1).
    raw = [f"ppo.{norm}.{level}=none" for norm in ("reward_norm", "adv_norm") for level in ("mean_level", "std_level")]
    overrides = [f"model.path={tiny_model_dir}", "total_iterations=2", "eval_freq=0", "rollout.batch_size=2",
                 "rollout.gconfig.n_samples=2", "rollout.gconfig.max_new_tokens=8", "ppo.reward_bias=0.5", *raw]
    result = train(config_path=str(REPO / "configs" / f"{config}.yaml"),
                   overrides=[f"output_dir={tmp_path / 'flow'}", *overrides])
    run_dir = Path(result["run_dir"])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in records)
    assert (run_dir / "checkpoints" / "step_2" / "model" / "config.json").is_file()

    expected = AGENT_FACTS[config]
    for r in records:
        assert {key for key in r if key.startswith("agent/")} == set(expected), r
        assert {key: r[key] for key in expected} == pytest.approx(expected), r
        # the greedy baseline episodes run only for the advantage that asks for them, and are all wrong here
        assert r.get("baseline_reward") == (0.0 if config == "remax" else None), r

    flow_weights = load_file(str(run_dir / "checkpoints" / "step_2" / "model" / "model.safetensors"))
    base_weights = load_file(str(tiny_model_dir / "model.safetensors"))
    moved = [name for name in flow_weights if not torch.equal(flow_weights[name], base_weights[name])]
    if config == "remax":
        # ReMax's advantage is the sampled reward minus the greedy one's, both 0 here: its updates change nothing
        assert moved == [] and [r["grad_norm"] for r in records] == [0.0, 0.0]
        return
    assert moved and all(r["grad_norm"] > 0 for r in records)
    plain_cfg = load_config(REPO / "configs" / f"{config}.yaml", [f"output_dir={tmp_path / 'plain'}", *overrides])
    plain = run_plain(plain_cfg)
    assert [without_timings(r) for r in plain] == [without_timings(r) for r in records]
    plain_weights = load_file(str(plain_cfg.run_dir / "checkpoints" / "step_2" / "model" / "model.safetensors"))
    assert flow_weights.keys() == plain_weights.keys()
    assert [name for name in flow_weights if not torch.equal(flow_weights[name], plain_weights[name])] == []


def start_serving_a_long_run(tmp_path: Path, model_dir: Path, prefect_api: str, run_id: str):
    """`areal-pipeline serve` of a 50-iteration train deployment named `run_id`, in a session of its own: (the
    process, its log)."""
    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    log = tmp_path / "serve.log"
    overrides = fast_overrides(tmp_path, model_dir, run_id=run_id, iterations=50)
    serve = subprocess.Popen([sys.executable, "-m", "cli", "serve", "--config", "configs/tiny_cpu.yaml",
                              "--run-id", run_id, "--iterations", "50", *overrides],
                             cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                             start_new_session=True)
    return serve, log
