"""A judge that fails (rollout.group_reward: judge) goes through the rollout's failure policy (rollout.on_failure,
rollout/judging.py) as an episode's error does: it is asked again, then its group is dropped, refilled or fails the
node, and never scored 0. The episode journal keeps such a group played and unjudged, so the next attempt judges it
and plays nothing again. Against a real OpenAI-compatible judge server (tests/_judge_server.py) that fails."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
from _rollouts import journal_records
from test_judge import calls, config, judge_server

from areal_pipeline.data.trajectory import Trajectory
from areal_pipeline.rewards.judge import Judge
from areal_pipeline.rollout.executor import play_batch, resume_batch
from areal_pipeline.rollout.failures import (EpisodesFailed, FailurePolicy, RolloutFailureRate, failure_records,
                                             failure_stats)
from areal_pipeline.rollout.journal import EpisodeJournal, finish_rollout
from areal_pipeline.utils import find_free_port

N_SAMPLES = 3
DOWN = ("--fail-first", "1000", "--status", "503")  # a judge answering 503 to every call


class Answering:
    """A workflow whose episode 0 of a prompt gives the reference answer and the others a wrong one; it records each
    episode it plays."""

    def __init__(self):
        self.played: list[tuple[str, int]] = []

    async def arun_episode(self, engine, data):
        self.played.append((data["prompt_id"], data["sample_idx"]))
        text = f"The answer is {data['answer']}." if data["sample_idx"] == 0 else "No idea."
        return Trajectory(prompt_id=data["prompt_id"], group_id="?", sample_idx=-1, input_ids=[1, 2, 3],
                          loss_mask=[0, 1, 1], logprobs=[0.0, -1.0, -2.0], versions=[-1, 0, 0], reward=0.25,
                          text=text, metadata={"answer": data["answer"]})


def record(prompt_id: str, n: int) -> dict:
    return {"prompt_id": prompt_id, "question": f"What is {n}+1?", "answer": str(n + 1), "sampling_seed": n}


SLOTS = {slot: record(f"p{slot}", slot) for slot in range(2)}


def policy(on_failure: str, **more) -> FailurePolicy:
    return FailurePolicy(on_failure=on_failure, episode_retry_delay=0.01, episode_timeout=0.0,
                         **{"episode_retries": 1, **more})


def journal_at(tmp_path: Path, delay_s: float = 0.0) -> EpisodeJournal:
    return EpisodeJournal(tmp_path / "iter_1" / "rollout.episodes", run_id="r", iteration=1, batch_size=len(SLOTS),
                          digest="d", delay_s=delay_s)


def play(workflow, judge: Judge, on_failure: str, journal: EpisodeJournal, slots=SLOTS):
    """The iteration's groups as the rollout node (or its retry) resumes them from `journal`."""
    return asyncio.run(resume_batch(workflow, None, slots, journal, max_concurrent_rollouts=8, n_samples=N_SAMPLES,
                                    policy=policy(on_failure), group_reward=judge, progress=False))


def judged_rewards(groups) -> list[list[float]]:
    return [[t.reward for t in g.trajectories] for g in groups]


def test_a_judge_error_is_asked_again_as_an_episode_is(tmp_path):
    with judge_server(tmp_path, "--fail-first", "1") as (base_url, log):
        judge = Judge(config(base_url, retries=0), tmp_path / "cache")
        workflow = Answering()
        [group] = asyncio.run(play_batch(workflow, None, {0: SLOTS[0]}, max_concurrent_rollouts=8,
                                         n_samples=N_SAMPLES, policy=policy("fail"), group_reward=judge,
                                         progress=False))
        assert [c["status"] for c in calls(log)] == [503, 200]  # the policy's retry asked the judge again
    assert group.outcome == "ok" and judged_rewards([group]) == [[1.0, 0.0, 0.0]]
    assert [t.metadata["workflow_reward"] for t in group.trajectories] == [0.25] * N_SAMPLES
    assert [(f.cause, f.peer, f.attempt) for f in group.retried] == [("judge", f"{base_url}/chat/completions", 1)]
    assert failure_stats([group])["retries/judge"] == 1
    assert len(workflow.played) == N_SAMPLES  # its episodes were played once


def test_the_group_journaled_unjudged_stays_unjudged_while_the_judge_scores_it(tmp_path):
    """The journal encodes a group when it writes, seconds after it was handed the group (rollout.journal_delay):
    scoring must make a new group, not change the one the journal holds."""
    journal = journal_at(tmp_path, delay_s=600.0)  # nothing written before the flush
    handed = []

    def write(group):
        handed.append(group)
        journal.writer(SLOTS)(group)

    with judge_server(tmp_path) as (base_url, log):
        judge = Judge(config(base_url, retries=0), tmp_path / "cache")
        groups = asyncio.run(play_batch(Answering(), None, SLOTS, max_concurrent_rollouts=8, n_samples=N_SAMPLES,
                                        policy=policy("fail"), group_reward=judge, on_group=write, progress=False))
    assert [g.judged for g in groups] == [True, True] and judged_rewards(groups) == [[1.0, 0.0, 0.0]] * 2
    # each group handed over twice: unjudged before the judge was asked, judged after
    unjudged = sorted((g for g in handed if not g.judged), key=lambda g: g.slot)
    assert [g.slot for g in unjudged] == [0, 1] and len(handed) == 4
    assert judged_rewards(unjudged) == [[0.25] * N_SAMPLES] * 2
    assert not any("workflow_reward" in t.metadata for g in unjudged for t in g.trajectories)
    journal.flush()  # encoded now, after the judge scored the groups
    [segment] = sorted(journal.directory.glob("segment-*.arrows"))
    records = [(meta["slot"], meta["judged"]) for meta, _ in journal_records(segment)]
    journal.close()
    assert sorted(records) == [(0, False), (0, True), (1, False), (1, True)]
    assert all(records.index((slot, False)) < records.index((slot, True)) for slot in (0, 1))


@pytest.mark.parametrize("on_failure", ["drop", "mask"])
def test_a_group_the_judge_cannot_score_is_dropped_and_judged_again_later_not_played(tmp_path, on_failure):
    """drop and mask alike: the judge scores a group whole, so none of its episodes survives it. Past
    rollout.max_failure_rate the node fails; its retry, the judge back, judges the journaled groups."""
    port, journal, workflow = find_free_port(), journal_at(tmp_path), Answering()
    url = f"http://127.0.0.1:{port}/v1"
    judge = Judge(config(url, retries=0), tmp_path / "cache")
    with judge_server(tmp_path, *DOWN, name="down", port=port) as (_, log):
        groups = play(workflow, judge, on_failure, journal)
        assert len(calls(log)) == 2 * len(SLOTS)  # each group's judge asked twice (rollout.episode_retries=1)
    assert [(g.outcome, g.trajectories) for g in groups] == [("dropped", [])] * 2
    assert [(r["slot"], r["sample_idx"], r["cause"], r["peer"], r["attempt"]) for r in failure_records(groups)] == [
        (slot, i, "judge", f"{url}/chat/completions", 2) for slot in SLOTS for i in range(N_SAMPLES)]
    assert re.match(r"JudgeUnavailable: the judge at .* gave no valid answer in 1 attempt",
                    groups[0].failures[0].message)
    stats = failure_stats(groups)
    assert (stats["failure_rate"], stats["groups_dropped"], stats["failures/judge"]) == (1.0, 2, 2 * N_SAMPLES)
    with pytest.raises(RolloutFailureRate, match=r"6/6 episodes failed: judge 6 @http://127.0.0.1"):
        finish_rollout(groups, tmp_path / "rollout", journal, policy=policy(on_failure), seconds=1.0,
                       rows_per_shard=8)

    played = list(workflow.played)
    with judge_server(tmp_path, name="up", port=port) as (_, log):  # the judge is back: the node's retry
        groups = play(workflow, judge, on_failure, journal)
        assert len(calls(log)) == len(SLOTS)
    assert workflow.played == played  # judged, not played again
    assert [g.outcome for g in groups] == ["ok", "ok"] and judged_rewards(groups) == [[1.0, 0.0, 0.0]] * 2
    manifest = finish_rollout(groups, tmp_path / "rollout", journal, policy=policy(on_failure), seconds=1.0,
                              rows_per_shard=8)
    assert manifest["num_rows"] == 2 * N_SAMPLES and manifest["stats"]["failure_rate"] == 0.0


def test_refill_replaces_a_group_the_judge_cannot_score_by_a_judged_reserve(tmp_path):
    journal, workflow = journal_at(tmp_path), Answering()

    def reserve(slot, j):
        return record(f"reserve-{slot}-{j}", 10 + j)

    with judge_server(tmp_path, "--fail-first", "1") as (base_url, log):  # down for the first group's call only
        judge = Judge(config(base_url, retries=0), tmp_path / "cache")
        [group] = asyncio.run(play_batch(workflow, None, {0: SLOTS[0]}, max_concurrent_rollouts=8,
                                         n_samples=N_SAMPLES, policy=policy("refill", episode_retries=0),
                                         refill=reserve, group_reward=judge, on_group=journal.writer(SLOTS),
                                         progress=False))
        assert [c["status"] for c in calls(log)] == [503, 200]
    assert (group.outcome, group.prompt_id, group.replaced_prompt_id) == ("refilled", "reserve-0-0", "p0")
    assert judged_rewards([group]) == [[1.0, 0.0, 0.0]]  # the reserve's answers, scored by the judge
    assert [(f.prompt_id, f.cause, f.sample_idx) for f in group.failures] == [("p0", "judge", i)
                                                                               for i in range(N_SAMPLES)]
    assert workflow.played == [(p, i) for p in ("p0", "reserve-0-0") for i in range(N_SAMPLES)]
    [kept] = journal.load(SLOTS).values()  # the journal holds the refilled group, judged
    assert (kept.outcome, kept.judged, [t.reward for t in kept.trajectories]) == ("refilled", True, [1.0, 0.0, 0.0])


def test_fail_fails_the_node_naming_the_judge_and_its_retry_judges_without_playing(tmp_path):
    port, journal, workflow = find_free_port(), journal_at(tmp_path), Answering()
    url = f"http://127.0.0.1:{port}/v1"
    judge = Judge(config(url, retries=0), tmp_path / "cache")
    slots = {0: SLOTS[0]}
    with judge_server(tmp_path, *DOWN, name="down", port=port):
        with pytest.raises(EpisodesFailed, match=rf"prompt p0 \(slot 0\), sample 0: judge 3 @{url}/chat/completions "
                                                 r".*JudgeUnavailable.*; after 2 attempt\(s\)"):
            play(workflow, judge, "fail", journal, slots)
    assert [(slot, g.judged) for slot, g in journal.load(slots).items()] == [(0, False)]  # played, kept unjudged
    played = list(workflow.played)
    with judge_server(tmp_path, name="up", port=port):
        groups = play(workflow, judge, "fail", journal, slots)
    assert workflow.played == played and judged_rewards(groups) == [[1.0, 0.0, 0.0]]
