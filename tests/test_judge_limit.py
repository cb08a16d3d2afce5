"""The judge's shared Prefect limit (tasks/judge_limit.py) is scoped: a live run holds it and so does a re-scoring,
each for its own duration only, and a re-scoring's judge calls share the limit with a run's (docs/judge.md: every run
on one Prefect server keeps to `judge.max_concurrency` calls between them). Measured on a real judge server's side."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

from test_judge import assert_no_overlap, calls, judge_server, run_overrides, train

from areal_pipeline.rewards.judge import Judge, installed_limiter
from areal_pipeline.run_spec import load_config

REPO = Path(__file__).resolve().parents[1]


def judge_cfg(tmp_path: Path, model_dir: Path, run_id: str, *more: str):
    return load_config(str(REPO / "configs/tiny_cpu.yaml"), [
        f"output_dir={tmp_path}", f"run_id={run_id}", f"model.path={model_dir}", "rollout.group_reward=judge",
        "judge.base_url=http://127.0.0.1:1/v1", "judge.model=grader", *more])


def test_a_live_run_holds_the_judge_limit_and_releases_it_when_it_ends(tmp_path, tiny_model_dir):
    from areal_pipeline.pipeline import Pipeline
    from tasks import runs
    from tasks.judge_limit import prefect_judge_slot

    pipelines = [Pipeline(judge_cfg(tmp_path, tiny_model_dir, run_id)) for run_id in ("a", "b")]
    plain = Pipeline(judge_cfg(tmp_path, tiny_model_dir, "plain", 'rollout.group_reward=""'))
    try:
        assert installed_limiter() is None
        runs.register(plain)  # no group reward: nothing to limit
        assert installed_limiter() is None
        runs.register(pipelines[0])
        assert installed_limiter() is prefect_judge_slot
        runs.register(pipelines[1])
        runs.unregister("a")
        assert installed_limiter() is prefect_judge_slot  # run b is live still
        assert Judge(pipelines[1].cfg.judge, tmp_path / "cache")._limiter is prefect_judge_slot
        runs.unregister("b")
        assert installed_limiter() is None  # no run is live: a judge built now keeps its own semaphore
        judge = Judge(pipelines[1].cfg.judge, tmp_path / "cache")
        assert judge._limiter == judge._local_limiter
    finally:
        for run_id in ("a", "b", "plain"):
            runs.unregister(run_id)
        for pipeline in (*pipelines, plain):
            pipeline.services.stop()


def test_a_pipeline_attached_to_a_run_holds_the_judge_limit_until_it_is_closed(tmp_path, tiny_model_dir,
                                                                                dead_address):
    """A node a Prefect worker runs where the run is not live (tasks/runs.pipeline_for) keeps to the limit every run
    on the server shares, as the run's own nodes do."""
    from areal_pipeline.config import save_config
    from areal_pipeline.run_context import RunContext
    from tasks import runs
    from tasks.judge_limit import prefect_judge_slot

    cfg = judge_cfg(tmp_path, tiny_model_dir, "attached")
    save_config(cfg, cfg.run_dir / "config.yaml")
    context = RunContext(run_dir=str(cfg.run_dir.resolve()), run_id="attached", inference=(dead_address,),
                         trainer=dead_address)
    assert installed_limiter() is None
    try:
        runs.pipeline_for(context)
        assert installed_limiter() is prefect_judge_slot
        # another context of the run: the first pipeline is closed, the limit held by the new one
        runs.pipeline_for(RunContext(context.run_dir, "attached", inference=(dead_address,), trainer="127.0.0.1:1"))
        assert installed_limiter() is prefect_judge_slot
    finally:
        runs.close_attached()
    assert installed_limiter() is None


def stored_run(output_dir: Path, model_dir: Path, run_id: str, prompts: int) -> Path:
    """A run directory as a finished run leaves it for `rescore`: its config and iteration 1's rollout shards, two
    answers for each of `prompts` prompts of its data set."""
    from areal_pipeline.config import save_config
    from areal_pipeline.data.datasets import load_records
    from areal_pipeline.data.shards import write_shards
    from areal_pipeline.data.trajectory import Trajectory

    cfg = judge_cfg(output_dir, model_dir, run_id)
    save_config(cfg, cfg.run_dir / "config.yaml")
    records = load_records(cfg.dataset, cfg.dataset.train_split, cfg.seed)[:prompts]
    write_shards([Trajectory(prompt_id=r["prompt_id"], group_id=r["prompt_id"], sample_idx=i, input_ids=[1, 2, 3],
                             loss_mask=[0, 1, 1], logprobs=[0.0, -1.0, -1.0], versions=[-1, 0, 0], reward=0.0,
                             text=str(r["answer"]) if i == 0 else "no idea", metadata={"answer": r["answer"]})
                  for r in records for i in range(2)], cfg.run_dir / "iter_1" / "rollout", run_id=run_id, iteration=1)
    return cfg.run_dir


def test_rescoring_takes_the_prefect_limit_a_concurrent_run_holds(prefect_api, tiny_model_dir, tmp_path):
    """A limit of one slot, a run (its own process) and a re-scoring (this one) judging at the same time: never two
    judge calls in flight at once; and once the re-scoring ends, no limiter is left installed in its process."""
    from flows.rescore import rescore

    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    limit = f"judge-test-{uuid.uuid4().hex[:8]}"
    parent = stored_run(tmp_path / "stored", tiny_model_dir, "parent", prompts=6)
    # a slow judge: the run's eight calls last long enough for the re-scoring's to fall between them
    with judge_server(tmp_path, "--delay", "1.5") as (base_url, log):
        run = train([*run_overrides(tmp_path, tiny_model_dir, "live", base_url, limit), "rollout.batch_size=8",
                     "judge.slot_timeout=600"], env, tmp_path / "live.log")
        try:
            deadline = time.monotonic() + 300
            while not [c for c in calls(log) if c["model"] == "grader"]:  # the run's judging has begun
                assert run.poll() is None and time.monotonic() < deadline, (tmp_path / "live.log").read_text()[-3000:]
                time.sleep(0.1)
            record = rescore(run_id="parent", scorer="group:judge", output_dir=str(parent.parent),
                             group_reward="judge", overrides=[
                                 f"judge.base_url={base_url}", "judge.model=rescorer", f"judge.limit_name={limit}",
                                 "judge.max_concurrency=1", "judge.slot_timeout=600", "judge.retries=0",
                                 f"judge.cache_dir={tmp_path / 'rescore-cache'}"])
            assert installed_limiter() is None  # the re-scoring's hold ended with it
            assert run.wait(timeout=600) == 0, (tmp_path / "live.log").read_text()[-3000:]
        finally:
            if run.poll() is None:
                run.kill()
                run.wait()
    made = calls(log)
    assert {c["status"] for c in made} == {200}
    runs_calls = [c for c in made if c["model"] == "grader"]
    rescore_calls = [c for c in made if c["model"] == "rescorer"]
    assert len(runs_calls) == 8 and len(rescore_calls) == 6
    assert record["iterations"][0]["usage"]["judge/calls"] == 6
    # the two judged at the same time: the re-scoring's calls fell between the run's
    assert min(c["start"] for c in rescore_calls) < max(c["end"] for c in runs_calls)
    assert_no_overlap(made)  # one slot between the run and the re-scoring: never two calls at once
