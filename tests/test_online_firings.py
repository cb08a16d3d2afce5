"""Firings of a line that learns from its served traffic (docs/online.md), at their edges: a firing killed with
SIGKILL mid-candidate resumes and trains every rewarded sample of its window once; unrewarded samples wait for
their feedback, train once it arrives, and expire past recurring.feedback_window; rows and traffic mixed by
recurring.traffic_fraction, the traffic capped at its share (the rest deferred to a later firing); retention at a
firing; a damaged traffic rollout never played again. A real `prefect server start`, the line's real server
process (recording), real trainers; small traffic (examples/simulated_user.py) and small iterations."""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from _online_helpers import (CONFIG, base, fire, line_of, recorded, server, simulated_user,  # noqa: F401 (fixtures)
                            taken_by)
from _prefect_server import client_env
from test_flows import cli, wait_until
# an iteration of 4 x 4 = 16 episodes (rows or traffic); a quick gate
SMALL = ["rollout.batch_size=4", "rollout.gconfig.n_samples=4", "recurring.gate_resamples=1000"]
PER_ITERATION = 16


@dataclass
class Served:
    out: Path
    overrides: list[str]
    address: str

    @property
    def line(self):
        return line_of(self.overrides)


@pytest.fixture(scope="module")
def online(tmp_path_factory, base):
    """One line for the module, its own server recording what it serves (the firings of the tests follow one
    another on it: each test accounts for the samples it recorded)."""
    from flows.line_servers import LineServers

    out = tmp_path_factory.mktemp("online-line")
    (out / "data").mkdir()
    overrides = [f"output_dir={out}", f"dataset.path={out / 'data'}", f"model.path={base}", *SMALL]
    served = LineServers.start(str(CONFIG), overrides)
    try:
        yield Served(out, overrides, served.servers[0].address)
    finally:
        served.stop()








def small_round(overrides: list[str], round_: int, **options) -> dict:
    """A small round of the simulated user: 24 questions asked 4 times, three quarters rewarded, unless told."""
    return simulated_user(overrides, round_, **{"questions": 24, "asks": 4, "feedback": 0.75, **options})


def of_round(samples: list[dict], round_: int) -> list[dict]:
    return [s for s in samples if s["conversation_id"].startswith(f"round{round_}-")]


def rewarded(samples: list[dict], feedback: list[dict]) -> set[str]:
    responses = {f["response_id"] for f in feedback}
    return {s["sample_id"] for s in samples if s["response_id"] in responses}




def firing_record(line, firing: int) -> dict:
    (record,) = [f for f in line.read_ledger().firings if f["id"] == firing]
    return record


def next_firing(line) -> int:
    ledger = line.read_ledger()
    return 1 + max((f["id"] for f in ledger.firings), default=0) if ledger else 1


def trained_episodes(line, firing: int) -> dict[int, list]:
    """The candidate run's rollouts of the firing's traffic iterations: {k: its trajectories}, each manifest checked
    to say `source: traffic`."""
    from areal_pipeline.data.shards import read_manifest, read_trajectories

    data = json.loads((line.firing_dir(firing) / "data.json").read_text())
    run_dir = line.run_dir(line.candidate_run_id(firing))
    episodes = {}
    for k in data["traffic_iterations"]:
        assert read_manifest(run_dir / f"iter_{k}" / "rollout")["source"] == "traffic"
        episodes[k] = read_trajectories(run_dir / f"iter_{k}" / "rollout")
    return episodes


def metrics_iterations(line, firing: int) -> list[int]:
    path = line.run_dir(line.candidate_run_id(firing)) / "metrics.jsonl"
    return [json.loads(row)["iteration"] for row in path.read_text().splitlines()]


def assert_token_exact(episodes: list, samples: list[dict]) -> None:
    """Each episode is its recorded sample as served: prompt + completion ids, the completion's logprobs and
    versions exactly as the server computed them."""
    by_id = {s["sample_id"]: s for s in samples}
    for episode in episodes:
        sample = by_id[episode.prompt_id]
        prompt, completion = sample["prompt_ids"], sample["completion_ids"]
        assert episode.input_ids == prompt + completion, episode.prompt_id
        assert episode.loss_mask == [0] * len(prompt) + [1] * len(completion)
        assert episode.logprobs[len(prompt):] == sample["logprobs"], episode.prompt_id
        assert episode.versions[len(prompt):] == sample["versions"], episode.prompt_id


def test_a_firing_killed_mid_candidate_resumes_and_trains_each_rewarded_sample_once(server, online, tmp_path):
    """kill -9 of `recurring fire` (its process group) after the candidate finished its first traffic iteration:
    the next firing resumes firing 1 (a second flow run, not a new firing) with the window it collected (not the
    traffic rewarded since the kill); it trains exactly the round's rewarded samples, once each, token for token as
    recorded; the next firing trains what came after the kill, and one after it, with no new traffic, nothing."""
    from areal_pipeline.forkserver import processes_of
    from areal_pipeline.recurring.status import line_status

    line = online.line
    assert next_firing(line) == 1
    user = small_round(online.overrides, 1)
    samples, feedback = recorded(line)
    round_1 = of_round(samples, 1)
    assert len(round_1) == user["requests"] == 96
    wanted = rewarded(round_1, feedback)
    assert len(wanted) == user["feedback"] and 0 < len(wanted) < len(round_1)

    env = client_env(server, tmp_path / "home")
    run = cli("recurring", "fire", "--config", str(CONFIG), *online.overrides, env=env, log=tmp_path / "fire.log",
              start_new_session=True)
    data_json = line.firing_dir(1) / "data.json"
    wait_until(lambda: data_json.is_file() or run.poll() is not None, 300, "the firing's window", interval=0.05)
    iterations = json.loads(data_json.read_text())["traffic_iterations"]
    assert len(iterations) >= 2, iterations  # one to finish before the kill, one at least after it
    run_dir = line.run_dir(line.candidate_run_id(1))
    wait_until(lambda: (run_dir / f"iter_{iterations[0]}" / "metrics.json").is_file() or run.poll() is not None,
               600, "the candidate's first traffic iteration", interval=0.05)
    assert run.poll() is None, (tmp_path / "fire.log").read_text()[-3000:]
    os.killpg(run.pid, signal.SIGKILL)
    run.wait()
    wait_until(lambda: processes_of(run.pid) == [], 60, "the killed firing's services to exit")
    assert not (run_dir / f"iter_{iterations[-1]}" / "metrics.json").is_file()  # killed mid-candidate
    (killed,) = line_status(line.read_ledger())["firings"]
    assert (killed["id"], killed["state"]) == (1, "killed")
    assert 1 not in line.read_ledger().data.get("traffic_taken", [])  # nothing counted as taken yet
    later = small_round(online.overrides, 11, questions=4, feedback=1)  # served and rewarded after the kill
    samples, feedback = recorded(line)
    round_11 = of_round(samples, 11)
    assert len(round_11) == later["feedback"] == 16

    resumed = fire(server, online.overrides)
    assert resumed["firing"] == 1 and resumed["decision"] in ("promoted", "rejected"), resumed
    record = firing_record(line, 1)
    assert len(record["flow_runs"]) == 2 and record["traffic"]["trained"] == len(wanted)
    assert line.read_ledger().data["traffic_taken"] == [1]
    taken = taken_by(line, 1)
    assert {sid for sid, why in taken.items() if why == "trained"} == wanted
    assert set(taken) == wanted  # the unrewarded ones are not taken: they wait
    assert record["traffic"]["waiting"] == len(round_1) - len(wanted)
    episodes = trained_episodes(line, 1)
    assert sorted(episodes) == iterations
    ids = [e.prompt_id for k in iterations for e in episodes[k]]
    assert sorted(ids) == sorted(wanted) and len(ids) == len(set(ids))  # each trained once
    assert metrics_iterations(line, 1) == iterations  # each iteration trained once, across the kill
    metrics = [json.loads(row) for row in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert not [key for row in metrics for key in row if key.startswith("agent/")]  # recorded traffic: no agent facts
    assert_token_exact([e for k in iterations for e in episodes[k]], round_1)

    # the traffic that came after the kill is the next firing's, and then there is none
    after = fire(server, online.overrides)
    assert (after["firing"], after["traffic"]["trained"]) == (2, 16), after
    assert taken_by(line, 2) == {s["sample_id"]: "trained" for s in round_11}
    again = fire(server, online.overrides)
    assert (again["firing"], again["decision"], again["run_id"]) == (3, "no_data", None), again
    assert "no new data" in again["reason"] and again["traffic"]["trained"] == 0
    assert again["traffic"]["new"] == again["traffic"]["waiting"] == len(round_1) - len(wanted)
    assert taken_by(line, 3) == {}
    assert not line.run_dir(line.candidate_run_id(3)).exists()


def post_feedback(online: Served, **body) -> None:
    import httpx

    from areal_pipeline import auth

    token = auth.ensure_run_token(online.out)
    reply = httpx.post(f"http://{online.address}/v1/feedback", json=body, timeout=30,
                       headers={"Authorization": f"Bearer {token}"})
    assert reply.status_code == 200, reply.text


def taken_before(line) -> set[str]:
    """Every sample an ended firing of the line took (trained, expired, stale, gate)."""
    ledger = line.read_ledger()
    return {sid for f in (ledger.data.get("traffic_taken", []) if ledger else []) for sid in taken_by(line, f)}


def test_unrewarded_samples_wait_train_once_their_feedback_arrives_and_expire_past_the_window(server, online):
    """A round nobody rewards: the firing trains nothing and counts its samples as waiting. Feedback posted later
    (by response, and by conversation) for some of them: the next firing trains exactly those, with those rewards;
    the rest wait on. Past recurring.feedback_window they expire: counted once, never trained, even when their
    feedback comes after."""
    line = online.line
    user = small_round(online.overrides, 2, feedback=0)
    assert (user["requests"], user["feedback"]) == (96, 0)
    samples, _ = recorded(line)
    round_2 = of_round(samples, 2)
    known = taken_before(line) | {s["sample_id"] for s in round_2}
    earlier_waiting = [s for s in samples if s["sample_id"] not in known]
    pending = len(round_2) + len(earlier_waiting)  # what an earlier test left waiting (none when run alone)

    waited = fire(server, online.overrides)
    assert waited["decision"] == "no_data" and waited["run_id"] is None, waited
    assert waited["traffic"]["waiting"] == pending and waited["traffic"]["trained"] == 0, waited["traffic"]
    assert f"traffic: {pending} sample(s) await their reward" in waited["reason"]
    assert firing_record(line, waited["firing"])["traffic"]["waiting"] == pending
    assert taken_by(line, waited["firing"]) == {}

    by_conversation = {s["conversation_id"]: s for s in round_2}
    rewards = {}  # sample_id -> the reward posted for it
    for q, reward in zip(range(4), (1.0, 0.0, 1.0, 0.5)):  # every answer of 4 questions, by response id
        for a in range(4):
            sample = by_conversation[f"round2-q{q}-a{a}"]
            post_feedback(online, response_id=sample["response_id"], reward=reward)
            rewards[sample["sample_id"]] = reward
    post_feedback(online, conversation_id="round2-q5-a1", reward=1.0)  # one more, by its conversation
    rewards[by_conversation["round2-q5-a1"]["sample_id"]] = 1.0

    trained = fire(server, online.overrides)
    assert trained["decision"] in ("promoted", "rejected") and trained["run_id"], trained
    assert trained["traffic"]["trained"] == len(rewards) == 17
    assert trained["traffic"]["waiting"] == pending - 17 and trained["traffic"]["expired"] == 0
    assert taken_by(line, trained["firing"]) == {sid: "trained" for sid in rewards}
    episodes = [e for iteration in trained_episodes(line, trained["firing"]).values() for e in iteration]
    assert sorted(e.prompt_id for e in episodes) == sorted(rewards)
    assert {e.prompt_id: e.reward for e in episodes} == rewards
    assert_token_exact(episodes, round_2)

    time.sleep(2)
    expiring = [*online.overrides, "recurring.feedback_window=1"]
    expired = fire(server, expiring)
    left = {s["sample_id"] for s in [*round_2, *earlier_waiting]} - set(rewards)
    assert expired["decision"] == "no_data" and expired["traffic"]["trained"] == 0, expired
    assert expired["traffic"]["expired"] == len(left) == pending - 17 and expired["traffic"]["waiting"] == 0
    assert taken_by(line, expired["firing"]) == {sid: "expired" for sid in left}

    late = by_conversation["round2-q9-a0"]  # an expired sample's feedback, come too late
    assert late["sample_id"] in left
    post_feedback(online, response_id=late["response_id"], reward=1.0)
    after = fire(server, online.overrides)
    assert after["decision"] == "no_data", after
    assert after["traffic"]["new"] == after["traffic"]["expired"] == after["traffic"]["trained"] == 0, after["traffic"]
    assert taken_by(line, after["firing"]) == {}
    assert sum(why == "trained" for f in line.read_ledger().data["traffic_taken"]
               for sid, why in taken_by(line, f).items() if sid in left) == 0


def test_rows_then_traffic_capped_at_its_share_the_rest_deferred_to_the_next_firing(server, online):
    """recurring.traffic_fraction=0.5 with a file of rows and rewarded traffic: the candidate trains the rows'
    iteration (recurring.iterations=1) first, then the traffic's, which are at most as many episodes as the rows'
    (whole groups of one prompt, oldest first: not the oldest answers); the deferred rest is taken by the next
    firing, on the next file."""
    from areal_pipeline.data.shards import read_manifest, read_trajectories
    from areal_pipeline.recurring.demo import write_demo_file

    line = online.line
    mixed = [*online.overrides, "recurring.traffic_fraction=0.5", "recurring.iterations=1"]
    # the same 4 questions asked twice over, 4 times each: 4 groups of 8 answers, each group's served apart
    users = [small_round(online.overrides, 3, questions=4, feedback=1) for _ in range(2)]
    samples, _ = recorded(line)
    round_3 = of_round(samples, 3)
    assert sum(u["feedback"] for u in users) == len(round_3) == 32
    assert {s["sample_id"] for s in samples} - taken_before(line) == {s["sample_id"] for s in round_3}

    write_demo_file(line.cfg, rows=4)
    first = fire(server, mixed)
    assert first["decision"] in ("promoted", "rejected") and first["rows"] == 4, first
    traffic = first["traffic"]
    assert traffic["trained"] == 16 <= 1 * PER_ITERATION and traffic["deferred"] == 16, traffic
    data = json.loads((line.firing_dir(first["firing"]) / "data.json").read_text())
    row_iteration = (firing_record(line, first["firing"])["from"] or {"iteration": 0})["iteration"] + 1
    assert (data["iterations"], data["traffic_iterations"]) == (2, [row_iteration + 1]), data
    run_dir = line.run_dir(first["run_id"])
    rows_rollout = run_dir / f"iter_{row_iteration}" / "rollout"
    assert read_manifest(rows_rollout).get("source") != "traffic"
    assert not {e.prompt_id for e in read_trajectories(rows_rollout)} & {s["sample_id"] for s in round_3}
    assert metrics_iterations(line, first["firing"])[-2:] == [row_iteration, row_iteration + 1]  # rows first
    episodes = [e for iteration in trained_episodes(line, first["firing"]).values() for e in iteration]
    ids = {e.prompt_id for e in episodes}
    assert taken_by(line, first["firing"]) == {sid: "trained" for sid in ids} and len(ids) == 16
    groups: dict[str, list[dict]] = {}
    for s in round_3:
        groups.setdefault(s["prompt_sha256"], []).append(s)
    chosen, deferred = [], []  # whole groups, oldest first, while they fit in the share
    for group in sorted(groups.values(), key=lambda g: min((s["created_at"], s["sample_id"]) for s in g)):
        (chosen if sum(map(len, chosen)) + len(group) <= 16 else deferred).append(group)
    assert ids == {s["sample_id"] for g in chosen for s in g} and len(chosen) == 2
    sha = {s["sample_id"]: s["prompt_sha256"] for s in round_3}
    assert {e.group_id for e in episodes} == {f"traffic:{sha[e.prompt_id][:16]}" for e in episodes}  # GRPO groups

    write_demo_file(line.cfg, rows=4)
    second = fire(server, mixed)
    assert second["decision"] in ("promoted", "rejected") and second["traffic"]["deferred"] == 0, second
    assert taken_by(line, second["firing"]) == {s["sample_id"]: "trained" for g in deferred for s in g}


def test_a_firing_removes_traffic_older_than_the_retention_and_trains_none_of_it(server, online, tmp_path):
    """A sealed shard of requests older than recurring.serve.retention_days, its samples rewarded by recent
    feedback: the next firing's collect deletes it (the feedback's shard, recent, stays), and none of its samples
    is taken; its feedback then names no recorded sample."""
    from areal_pipeline.online.traffic_log import TrafficLog
    from areal_pipeline.online.traffic_records import prompt_sha256

    line = online.line
    samples, _ = recorded(line)
    assert not [s for s in samples if s["sample_id"] not in taken_before(line)]  # nothing else to train
    ledger = line.read_ledger()
    _, version = line.champion_model(ledger) if ledger else (None, 0)
    old_at = time.time() - 40 * 86400  # retention_days: 30
    # samples a firing would train but for their age: rewarded below, of the champion's version, usable
    old = [{"sample_id": f"chatcmpl-old{i}/0", "response_id": f"chatcmpl-old{i}", "choice": 0,
            "conversation_id": f"old-{i}", "created_at": old_at + i, "server": "127.0.0.1:1", "model": "champion",
            "version": version, "prompt_ids": [5, 6, 7, 8 + i], "completion_ids": [9, 10], "logprobs": [-0.5, -1.0],
            "versions": [version, version], "finish_reason": "stop",
            "messages": json.dumps([{"role": "user", "content": f"What is {i}+1?"}]), "tools": "[]",
            "reply": json.dumps({"role": "assistant", "content": str(i + 1)}), "temperature": 1.0, "top_p": 1.0,
            "max_tokens": 8, "prompt_sha256": prompt_sha256([5, 6, 7, 8 + i])} for i in range(6)]
    with TrafficLog(line.dir / "traffic", "requests", writer="an-old-server") as log:
        log.append_many(old)
    (old_shard,) = (line.dir / "traffic" / "requests").glob("an-old-server-*.parquet")
    with TrafficLog(line.dir / "traffic", "feedback", writer="a-late-user") as log:
        log.append_many([{"feedback_id": f"fb-old{i}", "response_id": s["response_id"], "conversation_id": "",
                          "reward": 1.0, "comment": "", "received_at": time.time(), "server": "test"}
                         for i, s in enumerate(old)])
    (feedback_shard,) = (line.dir / "traffic" / "feedback").glob("a-late-user-*.parquet")

    firing = fire(server, online.overrides)
    assert not old_shard.exists() and feedback_shard.is_file()
    assert firing["decision"] == "no_data" and firing["traffic"]["trained"] == 0, firing
    assert firing["traffic"]["orphan_feedback"] == len(old) and firing["traffic"]["new"] == 0
    assert not {s["sample_id"] for s in old} & taken_before(line)


def test_a_damaged_traffic_rollout_is_refused_and_placed_again_from_the_firing_s_copy(tmp_path):
    """Traffic placed as a candidate run's rollout and damaged there (a flipped byte): the rollout step refuses to
    play it again (ShardError naming the recorded traffic), while the same damage to a rollout of rows is left to
    be played again; the firing's own copy is intact, and placing the traffic again repairs the run's."""
    from types import SimpleNamespace

    from areal_pipeline.data.shards import ShardError, shards_intact, verify_shards, write_table, trajectory_table
    from areal_pipeline.online.traffic_batch import sample_trajectory
    from areal_pipeline.recurring.traffic import place_traffic, write_traffic_rollout
    from areal_pipeline.rollout_steps import refuse_to_replay_recorded_traffic

    episodes = [sample_trajectory({"sample_id": f"chatcmpl-{i}/0", "response_id": f"chatcmpl-{i}", "choice": 0,
                                   "conversation_id": f"c{i}", "created_at": 1.0e9, "server": "s",
                                   "prompt_ids": [1, 2, 3], "completion_ids": [4, 5], "logprobs": [-0.5, -0.25],
                                   "versions": [0, 0], "messages": "[]", "reply": "{}", "finish_reason": "stop",
                                   "prompt_sha256": "ab" * 32}, float(i % 2), "traffic:pool-1")
                for i in range(8)]
    firing_dir = tmp_path / "firing"
    write_traffic_rollout(episodes, firing_dir / "traffic" / "iter_3", "line-0001", 3, 4, 2)
    run = SimpleNamespace(run_dir=tmp_path / "line-0001")
    placed = run.run_dir / "iter_3" / "rollout"
    place_traffic(firing_dir, {"traffic_iterations": [3]}, run)
    from areal_pipeline.run_dir import RunPaths

    paths = RunPaths(run.run_dir)
    refuse_to_replay_recorded_traffic(paths, 3)  # intact: nothing to refuse

    def flip_a_byte(folder: Path) -> None:
        shard = sorted(folder.glob("*.parquet"))[0]
        raw = bytearray(shard.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        shard.write_bytes(bytes(raw))

    flip_a_byte(placed)
    with pytest.raises(ShardError, match="recorded traffic placed here by a recurring firing is damaged"):
        refuse_to_replay_recorded_traffic(paths, 3)
    verify_shards(firing_dir / "traffic" / "iter_3")  # the firing's copy is its own
    place_traffic(firing_dir, {"traffic_iterations": [3]}, run)  # the firing run again places it anew
    assert shards_intact(placed)
    refuse_to_replay_recorded_traffic(paths, 3)
    (placed / "manifest.json").write_text("{damaged")  # the manifest itself: the mark beside it still says so
    with pytest.raises(ShardError, match="recorded traffic placed here by a recurring firing is damaged"):
        refuse_to_replay_recorded_traffic(paths, 3)

    rows = tmp_path / "rows" / "iter_3" / "rollout"  # a rollout of rows: damaged, it is played again
    write_table(trajectory_table(episodes, "line-0001", 3), rows, run_id="line-0001", iteration=3, rows_per_shard=4)
    flip_a_byte(rows)
    assert not shards_intact(rows)
    refuse_to_replay_recorded_traffic(RunPaths(tmp_path / "rows"), 3)
