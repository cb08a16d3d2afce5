"""`areal-pipeline rescore` on a real run's shards: new rewards from a reward function or a group reward, written
beside the old shards with their lineage; `branch --replay --rescored` trains on them; the lineage in Prefect."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

from _learning_helpers import base_model
from areal_pipeline.branching import BranchError, plan_branch
from areal_pipeline.data.shards import read_table, read_trajectories, write_shards
from areal_pipeline.rescoring import (RescoreError, check_sources, plan_rescore, rescore, rescore_iteration,
                                      sign_flips)
from test_flows import REPO, cli, fast_overrides

SHORT_REWARD = '''
def short(completion, answer):
    """1 for an answer of one character: a reward design of its own, unlike the run's (the sum's correctness)."""
    return 1.0 if len(completion.strip()) <= 1 else 0.0
'''

MAJORITY_VOTE = '''
class MajorityVote:
    """Scores a group against itself, no reference answer (self-consistency): each answer's share of the group's
    votes."""

    def __init__(self):
        self.calls = 0

    async def score_group(self, candidates):
        self.calls += 1
        answers = [c.completion.strip() for c in candidates]
        return [answers.count(a) / len(answers) for a in answers]

    def take_usage(self):
        calls, self.calls = self.calls, 0
        return {"group/calls": float(calls)}

    async def aclose(self):
        pass


def build(cfg):
    return MajorityVote()
'''


def short(text: str) -> float:
    return 1.0 if len(text.strip()) <= 1 else 0.0


@pytest.fixture(scope="module")
def parent(prefect_api, model_cache, tmp_path_factory) -> Path:
    """Run `p`: 3 iterations of the warm-started default model."""
    from flows.train import train

    out = tmp_path_factory.mktemp("runs")
    model = base_model("tiny_cpu.yaml", model_cache)
    train(config_path=str(REPO / "configs/tiny_cpu.yaml"),
          overrides=fast_overrides(out, Path(model), run_id="p", iterations=3) + ["save_freq=3"])
    return out / "p"


@pytest.fixture(scope="module")
def rewards_dir(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("rewards")
    (where / "short_reward.py").write_text(SHORT_REWARD)
    (where / "majority_vote.py").write_text(MAJORITY_VOTE)
    return where


def _digests(run_dir: Path) -> dict[str, str]:
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.glob("iter_*/rollout/*"))}


def test_a_reward_function_rescores_the_stored_episodes_beside_them(parent, rewards_dir, prefect_api):
    from flows.rescore import rescore as rescore_flow

    before = _digests(parent)
    reward = f"{rewards_dir / 'short_reward.py'}:short"
    record = rescore_flow(run_id="p", scorer=reward, output_dir=str(parent.parent), reward=reward, iterations="2:3")
    assert record["name"] == "short" and record["parent_run_id"] == "p"
    assert [s["iteration"] for s in record["iterations"]] == [2, 3]
    assert not (parent / "rescored/short/iter_1").exists()
    for k in (2, 3):
        old = read_trajectories(parent / f"iter_{k}/rollout")
        new = read_trajectories(parent / f"rescored/short/iter_{k}/rollout")
        assert [t.reward for t in new] == [short(t.text) for t in old]
        assert [t.metadata["reward_before"] for t in new] == pytest.approx([t.reward for t in old])
        old_table = read_table(parent / f"iter_{k}/rollout")
        new_table = read_table(parent / f"rescored/short/iter_{k}/rollout")
        for column in old_table.column_names:  # the same episodes: every column but the reward's
            if column not in ("reward", "metadata", "baseline_reward"):
                assert new_table.column(column).equals(old_table.column(column)), column
        assert [{**t.metadata, "reward_before": None} for t in new] == [{**t.metadata, "reward_before": None}
                                                                       for t in old]
        summary = record["iterations"][k - 2]
        assert summary["reward_mean_after"] == pytest.approx(sum(short(t.text) for t in old) / len(old))
        assert summary["reward_mean_before"] == pytest.approx(sum(t.reward for t in old) / len(old))
        olds, news = [t.reward for t in old], [short(t.text) for t in old]
        if len(set(olds)) > 1 and len(set(news)) > 1:
            assert summary["reward_correlation"] == pytest.approx(float(np.corrcoef(olds, news)[0, 1]))
        else:
            assert summary["reward_correlation"] is None
        # the share of episodes whose group-centred reward changed sign, from these very rewards (sign_flips is
        # checked by hand below): the summary is computed on the stored episodes' groups, old and new rewards
        expected_flips = sign_flips([t.group_id for t in old], olds, news)
        assert summary["advantage_sign_flips"] == pytest.approx(expected_flips)
    assert _digests(parent) == before  # the old shards untouched
    lineage = json.loads((parent / "rescored/short/rescore.json").read_text())
    assert lineage["scorer"] == reward and lineage["parent_run_dir"] == str(parent.resolve())

    # a rerun keeps what is there; a wider one adds iteration 1 to the same lineage
    plan = plan_rescore(parent, reward=reward, iterations="1:3")
    again = rescore(plan)
    assert [s["iteration"] for s in again["iterations"]] == [1, 2, 3]
    assert rescore_iteration(plan, 2)["cached"] is True

    # in Prefect: the flow run's tags and its lineage artifact
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter, FlowRunFilterName

    async def lookup():
        async with get_client() as client:
            runs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(
                name=FlowRunFilterName(like_="p: rescored")))
            artifacts = await client.read_artifacts(artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=["p-rescored-short"])))
            return runs, artifacts

    runs, artifacts = asyncio.run(lookup())
    assert runs and {"rescore", "rescore-of:p", "rescored:short"} <= set(runs[0].tags)
    assert artifacts and "short_reward.py:short" in artifacts[0].data and "reward before" in artifacts[0].data


def test_a_group_reward_from_the_command_line_then_a_replay_trains_on_it(parent, rewards_dir, prefect_api):
    from flows.branch import branch

    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    group = f"{rewards_dir / 'majority_vote.py'}:build"
    run = cli("rescore", "--run-id", "p", "--group-reward", group, "--name", "by-votes", "--output-dir",
              str(parent.parent), env=env)
    out, _ = run.communicate(timeout=300)
    assert run.returncode == 0, out[-3000:]
    assert f"p rescored by group:{group}: 3 iteration(s) in {parent / 'rescored/by-votes'}" in out
    lineage = json.loads((parent / "rescored/by-votes/rescore.json").read_text())
    for k in (1, 2, 3):
        new = read_trajectories(parent / f"rescored/by-votes/iter_{k}/rollout")
        answers = [t.text.strip() for t in new]
        expected = [sum(u.group_id == t.group_id and v == a for u, v in zip(new, answers))
                    / sum(u.group_id == t.group_id for u in new) for t, a in zip(new, answers)]
        assert [t.reward for t in new] == pytest.approx(expected)
        assert lineage["iterations"][k - 1]["usage"] == {"group/calls": float(len({t.group_id for t in new}))}
        summary = lineage["iterations"][k - 1]
        assert (f"iteration {k}: reward {summary['reward_mean_before']:.3f} -> {summary['reward_mean_after']:.3f}"
                in out)

    result = branch(parent_run_id="p", at=1, run_id="on-votes", output_dir=str(parent.parent), mode="replay",
                    rescored="by-votes")
    assert result["rescored"] == "by-votes" and result["regenerated"] == []
    run_dir = parent.parent / "on-votes"
    record = json.loads((run_dir / "branch.json").read_text())
    assert record["rescored_from"]["name"] == "by-votes" and record["rescored_from"]["scorer"] == f"group:{group}"
    assert record["rescored_from"]["lineage"]["parent_run_id"] == "p"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for k in (2, 3):
        rescored = parent / f"rescored/by-votes/iter_{k}/rollout"
        assert os.path.samefile(run_dir / f"iter_{k}/rollout/manifest.json", rescored / "manifest.json")
        # the advantages step read the new rewards: its batch carries them, and its figures are theirs
        new_rewards = read_table(rescored).column("reward").to_pylist()
        batch = read_table(run_dir / f"iter_{k}/batch", schema=None)
        assert batch.column("reward").to_pylist() == new_rewards
        stats = json.loads((run_dir / f"iter_{k}/batch/manifest.json").read_text())["stats"]
        assert stats["reward_mean"] == pytest.approx(lineage["iterations"][k - 1]["reward_mean_after"])
        assert metrics[k - 1]["reward_mean"] == pytest.approx(lineage["iterations"][k - 1]["reward_mean_after"])
        parent_batch = read_table(parent / f"iter_{k}/batch", schema=None)
        old_rewards = parent_batch.column("reward").to_pylist()
        assert old_rewards == read_table(parent / f"iter_{k}/rollout").column("reward").to_pylist()
        assert new_rewards != old_rewards  # so the advantages below come from the new rewards, not the old
        assert batch.column("advantages").to_pylist() != parent_batch.column("advantages").to_pylist()

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterKey, FlowRunFilter,
                                                FlowRunFilterName)

    async def tags(name: str):
        async with get_client() as client:
            runs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_=name)))
            return {run.name: set(run.tags) for run in runs}

    (branch_tags,) = asyncio.run(tags("on-votes: replay of p")).values()
    assert {"replay", "branch-of:p", "rescored:by-votes"} <= branch_tags
    # the new run's train run and its iteration runs carry the lineage too
    train_tags = asyncio.run(tags("on-votes"))
    assert {"on-votes", "on-votes/iter-2", "on-votes/iter-3"} <= set(train_tags)
    for name in ("on-votes", "on-votes/iter-3"):
        assert {"branch-of:p", "branch-at:1", "rescored:by-votes"} <= train_tags[name], name

    async def lineage_artifact():
        async with get_client() as client:
            return await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(
                any_=["on-votes-lineage"])))

    (artifact, *_) = asyncio.run(lineage_artifact())
    assert "replay of `p` at iteration 1" in artifact.data
    assert f"Rescored from: the parent's rollouts scored again by `group:{group}`" in artifact.data
    assert "--name by-votes" in artifact.data


def test_bad_rescorings_are_refused_with_the_reason(parent, rewards_dir, tmp_path):
    reward = f"{rewards_dir / 'short_reward.py'}:short"
    cases = [
        (dict(run_dir=parent.parent / "nope", reward=reward), "no run directory"),
        (dict(run_dir=parent), "give one of --reward"),
        (dict(run_dir=parent, reward=reward, group_reward="judge"), "give one of --reward"),
        (dict(run_dir=parent, reward=reward, iterations="3:2"), "must be 1 <= A <= B"),
        (dict(run_dir=parent, reward=reward, iterations="2:9"), r"no rollout of iteration\(s\) 4\.\.9"),
        (dict(run_dir=parent, reward=reward, iterations="x"), "must be A:B"),
        (dict(run_dir=parent, reward="no_such_module_here:score"), "no_such_module_here"),
        (dict(run_dir=parent, reward=reward, name="../up"), "letters, digits"),
        (dict(run_dir=parent, group_reward="nothing-registered"), "unknown group reward 'nothing-registered'"),
    ]
    for kwargs, message in cases:
        run_dir = kwargs.pop("run_dir")
        with pytest.raises(RescoreError, match=message):
            plan_rescore(run_dir, **kwargs)

    with pytest.raises(BranchError, match="goes with --replay"):
        plan_branch(parent, 1, "x", rescored="short")
    with pytest.raises(BranchError, match="no re-scoring named 'absent'"):
        plan_branch(parent, 1, "x", replay=True, rescored="absent")
    rescore(plan_rescore(parent, reward=reward, iterations="2", name="short-2"))
    with pytest.raises(BranchError, match=r"'short-2' of run p has no iteration\(s\) \[3\]"):
        plan_branch(parent, 1, "x", replay=True, rescored="short-2", iterations=2)
    with pytest.raises(BranchError, match="ppo.advantage='remax' compares each reward with the prompt's greedy"):
        plan_branch(parent, 1, "x", ["ppo.advantage=remax", "ppo.loss=reinforce"], replay=True, rescored="short-2",
                    iterations=1)
    with pytest.raises(RescoreError, match="holds a re-scoring by"):
        plan_rescore(parent, reward=f"{rewards_dir / 'majority_vote.py'}:build", name="short")


def _copy_run(parent: Path, run_dir: Path, k: int = 1) -> None:
    import shutil

    (run_dir / f"iter_{k}").mkdir(parents=True)
    shutil.copy(parent / "config.yaml", run_dir / "config.yaml")
    shutil.copytree(parent / f"iter_{k}/rollout", run_dir / f"iter_{k}/rollout")


def test_shards_that_fail_their_checksums_are_refused_before_any_scoring(parent, rewards_dir, tmp_path):
    run_dir = tmp_path / "bad"
    _copy_run(parent, run_dir)
    shard = next((run_dir / "iter_1/rollout").glob("part-*.parquet"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    plan = plan_rescore(run_dir, reward=f"{rewards_dir / 'short_reward.py'}:short")
    with pytest.raises(RescoreError, match=rf"iteration 1 cannot be re-scored: .*{shard.name}"):
        check_sources(plan)
    assert not (run_dir / "rescored").exists()


def test_per_turn_returns_cannot_be_rescored_by_one_reward(parent, rewards_dir, tmp_path):
    """A multi_turn run's trajectories carry per-turn returns: one reward per trajectory cannot replace them."""
    import shutil

    for field, message in (("token_returns", "per-turn returns"), ("step_rewards", "per-step rewards")):
        run_dir = tmp_path / field
        (run_dir / "iter_1").mkdir(parents=True)
        shutil.copy(parent / "config.yaml", run_dir / "config.yaml")
        (t, *_) = read_trajectories(parent / "iter_1/rollout")
        setattr(t, field, [0.0] * len(t.input_ids))
        write_shards([t], run_dir / "iter_1/rollout", run_id=field, iteration=1)
        plan = plan_rescore(run_dir, reward=f"{rewards_dir / 'short_reward.py'}:short")
        with pytest.raises(RescoreError, match=rf"{message} \({field}, workflow 'rlvr'\)"):
            check_sources(plan)
        with pytest.raises(RescoreError, match=message):
            rescore_iteration(plan, 1)
        assert not (run_dir / "rescored/short/iter_1/rollout/manifest.json").exists()

    run_dir = tmp_path / "no-answer"  # a workflow that keeps no answer: nothing for reward(completion, answer)
    _copy_run(parent, run_dir)
    trajectories = read_trajectories(run_dir / "iter_1/rollout")
    del trajectories[0].metadata["answer"]
    write_shards(trajectories, run_dir / "iter_1/rollout", run_id="no-answer", iteration=1, overwrite=True)
    with pytest.raises(RescoreError,
                       match=r"1 trajectory\(ies\) kept no answer \(metadata\['answer'\], workflow 'rlvr'\)"):
        check_sources(plan_rescore(run_dir, reward=f"{rewards_dir / 'short_reward.py'}:short"))
    check_sources(plan_rescore(run_dir, group_reward=f"{rewards_dir / 'majority_vote.py'}:build"))


def test_a_remax_baseline_moves_into_the_metadata(parent, rewards_dir, tmp_path):
    """ReMax's baseline is the reward of an episode that is not kept: it cannot be re-scored, so it is not kept
    as a baseline of the new rewards."""
    run_dir = tmp_path / "remax"
    (run_dir / "iter_1").mkdir(parents=True)
    (run_dir / "config.yaml").write_text((parent / "config.yaml").read_text())
    trajectories = read_trajectories(parent / "iter_1/rollout")
    for i, t in enumerate(trajectories):
        t.baseline_reward = 0.25 * (i % 3)
    write_shards(trajectories, run_dir / "iter_1/rollout", run_id="remax", iteration=1)
    summary = rescore_iteration(plan_rescore(run_dir, reward=f"{rewards_dir / 'short_reward.py'}:short"), 1)
    assert summary["baseline_rewards_dropped"] is True
    new = read_trajectories(run_dir / "rescored/short/iter_1/rollout")
    assert [t.baseline_reward for t in new] == [None] * len(new)
    assert [t.metadata["baseline_reward_before"] for t in new] == [0.25 * (i % 3) for i in range(len(new))]


def test_sign_flips_by_hand():
    groups = ["a", "a", "b", "b", "c", "c"]
    before = [1.0, 0.0, 1.0, 0.0, 1.0, 1.0]  # centred: +.5 -.5 | +.5 -.5 | 0 0
    after = [0.0, 1.0, 1.0, 0.5, 0.0, 1.0]   # centred: -.5 +.5 | +.25 -.25 | -.5 +.5
    assert sign_flips(groups, before, after) == pytest.approx(4 / 6)


def test_the_judge_rescores_a_run_through_its_endpoint_and_asks_once(parent, tmp_path):
    """`--group-reward judge` with the judge's settings as overrides: one call per group at a real OpenAI-compatible
    endpoint (tests/_judge_server.py grades 1 where a candidate holds the reference answer), none on a rerun under
    another name (the judge's cache)."""
    from test_judge import calls, judge_server

    with judge_server(tmp_path) as (base_url, log):
        overrides = [f"judge.base_url={base_url}", "judge.model=grader", f"judge.cache_dir={tmp_path / 'cache'}"]
        record = rescore(plan_rescore(parent, group_reward="judge", iterations="1", overrides=overrides))
        old = read_trajectories(parent / "iter_1/rollout")
        new = read_trajectories(parent / "rescored/judge/iter_1/rollout")
        assert [t.reward for t in new] == [1.0 if t.metadata["answer"] in t.text else 0.0 for t in old]
        groups = len({t.group_id for t in old})
        assert len(calls(log)) == groups
        usage = record["iterations"][0]["usage"]
        assert usage["judge/calls"] == groups and usage["judge/prompt_tokens"] > 0
        rescore(plan_rescore(parent, group_reward="judge", iterations="1", name="judge-again", overrides=overrides))
        assert len(calls(log)) == groups  # served from the cache
        again = read_trajectories(parent / "rescored/judge-again/iter_1/rollout")
        assert [t.reward for t in again] == [t.reward for t in new]
