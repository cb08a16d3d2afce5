"""A line that learns from its own traffic (configs/online_cpu.yaml, docs/online.md): the line's server records what
it serves, a simulated user (examples/simulated_user.py, through the OpenAI SDK) asks questions and rewards a share
of the answers, and each firing trains its candidate on the newly rewarded samples alone, off-policy (the decoupled
loss over the recorded behaviour logprobs), gated and promoted as any firing. A real `prefect server start`, the
line's real server process, real trainers."""

from __future__ import annotations

import json
from pathlib import Path


from _online_helpers import (CONFIG, base, fire, line_of, recorded, server, simulated_user,  # noqa: F401 (fixtures)
                            taken_by)
from test_flows import REPO


def overrides_for(tmp_path: Path, base: str, *extra: str) -> list[str]:
    (tmp_path / "data").mkdir(parents=True, exist_ok=True)
    return [f"output_dir={tmp_path}", f"dataset.path={tmp_path / 'data'}", f"model.path={base}", *extra]












VERIFIER = f"recurring.traffic_reward={REPO / 'examples' / 'arithmetic_verifier.py'}:score"


def trained_episodes(line, firing: int, run_dir: Path) -> dict[str, object]:
    """The episodes firing `firing`'s candidate trained on from traffic, by sample id (its rollout shards)."""
    from areal_pipeline.data.shards import read_trajectories

    data = json.loads((line.firing_dir(firing) / "data.json").read_text())
    return {t.prompt_id: t for k in data["traffic_iterations"]
            for t in read_trajectories(run_dir / f"iter_{k}" / "rollout")}


def test_firings_on_rewarded_traffic_promote_a_better_champion_each_sample_trained_once(server, base, tmp_path):
    """Rounds 1 and 2: the user rewards three quarters of the questions, and each firing trains on exactly those.
    Round 3: no feedback at all, and the firing scores what was never rewarded with a function that checks the
    answer (recurring.traffic_reward): round 3's samples and those rounds 1 and 2 left waiting, each once."""
    from flows.line_servers import LineServers

    overrides = overrides_for(tmp_path, base)
    line = line_of(overrides)
    served = LineServers.start(str(CONFIG), overrides)
    try:
        rounds, decisions = [], []
        for round_, feedback_share, extra in ((1, 0.75, []), (2, 0.75, []), (3, 0.0, [VERIFIER])):
            rounds.append(simulated_user(overrides, round_, questions=96, asks=8, feedback=feedback_share))
            decisions.append(fire(server, [*overrides, *extra]))
        samples, feedback = recorded(line)
    finally:
        served.stop()

    from areal_pipeline.recurring.status import line_status

    status = line_status(line.read_ledger())
    assert [r["requests"] for r in rounds] == [768] * 3 and rounds[2]["feedback"] == 0
    assert len(samples) == 3 * 768 and len({s["sample_id"] for s in samples}) == len(samples)
    rated = {f["response_id"] for f in feedback}
    by_round = {r: {s["sample_id"] for s in samples if s["conversation_id"].startswith(f"round{r}-")} for r in (1, 2, 3)}
    trained = {f: {sid for sid, why in taken_by(line, f).items() if why == "trained"} for f in (1, 2, 3)}
    # firings 1 and 2: exactly their round's rewarded samples; firing 3: everything else; each sample once
    for f in (1, 2):
        assert trained[f] == {s["sample_id"] for s in samples if s["response_id"] in rated and s["sample_id"] in
                              by_round[f]}, f
    assert trained[3] == {s["sample_id"] for s in samples} - trained[1] - trained[2]
    assert trained[3] >= by_round[3] and trained[3] & by_round[1] and trained[3] & by_round[2]
    assert sum(len(t) for t in trained.values()) == len(samples)
    # firing 3's rewards are the verifier's: as many right answers in round 3 as the simulated user counted
    episodes = trained_episodes(line, 3, tmp_path / status["firings"][2]["run_id"])
    assert set(episodes) == trained[3]
    assert sum(episodes[sid].reward for sid in by_round[3]) == rounds[2]["right"]
    # the episodes are the recorded samples, token for token
    for s in samples:
        if s["sample_id"] in episodes:
            e = episodes[s["sample_id"]]
            n = len(s["prompt_ids"])
            assert e.input_ids == [*s["prompt_ids"], *s["completion_ids"]] and e.logprobs[n:] == s["logprobs"]
            assert e.versions[n:] == s["versions"] and e.loss_mask == [0] * n + [1] * len(s["completion_ids"])
    # the samples are recorded under the version that served them: the base (0), then each champion in turn
    versions_by_round: dict[str, set] = {}
    for s in samples:
        versions_by_round.setdefault(s["conversation_id"].split("-")[0], set()).update(s["versions"])
    served_version = [(f["from"] or {"iteration": 0})["iteration"] for f in status["firings"]]
    assert [versions_by_round[f"round{r}"] for r in (1, 2, 3)] == [{v} for v in served_version], (
        versions_by_round, served_version)
    # the first firing's candidate, trained on round 1's rewarded answers, is much better than the base model
    assert decisions[0]["decision"] == "promoted", decisions
    base_pass = status["firings"][0]["gate"]["champion"]["pass_at_1"]
    assert status["champion"]["gate"]["candidate"]["pass_at_1"] >= base_pass + 0.3, status
    for firing in status["firings"]:
        assert firing["traffic"]["expired"] == firing["traffic"]["stale"] == 0, firing
