"""What a firing takes from recorded traffic (areal_pipeline/online/traffic_batch.py), on records written by hand:
rewards joined by response and conversation, unrewarded samples waiting then expiring, stale and gate samples
taken but never trained, groups of equal prompts and the pooled rest, the share cap, each sample taken once."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from areal_pipeline.data.trajectory import NO_VERSION
from areal_pipeline.online.traffic_batch import POOL, rewards_by_sample, take_traffic

NOW = 1_000_000.0
DAY = 86400.0


def sample(sid: str, prompt: list[int], *, question: str = "1+1", created: float = NOW - 60, version: int = 3,
           conversation: str = "", completion=(7, 8)) -> dict:
    response = sid.split("/")[0]
    return {"sample_id": sid, "response_id": response, "choice": int(sid.split("/")[1]),
            "conversation_id": conversation or response, "created_at": created, "server": "127.0.0.1:1",
            "model": "m", "version": version, "prompt_ids": prompt, "completion_ids": list(completion),
            "logprobs": [-0.5] * len(completion), "versions": [version] * len(completion), "finish_reason": "stop",
            "messages": json.dumps([{"role": "user", "content": question}]),
            "tools": "", "reply": json.dumps({"role": "assistant", "content": "2"}), "temperature": 1.0,
            "top_p": 1.0, "max_tokens": 8,
            "prompt_sha256": hashlib.sha256(np.asarray(prompt, "<i8").tobytes()).hexdigest()}


def feedback(fid: str, reward: float, *, response: str = "", conversation: str = "", at: float = NOW - 30) -> dict:
    return {"feedback_id": fid, "response_id": response, "conversation_id": conversation, "reward": reward,
            "comment": "", "received_at": at, "server": "127.0.0.1:1"}


def take(samples, fb, before=(), **kw):
    settings = dict(now=NOW, champion_version=3, feedback_window=DAY, max_staleness=2, min_group=2,
                    gate_questions={"2+2"}, episodes_per_iteration=4)
    settings.update(kw)
    return take_traffic(samples, fb, set(before), **settings)


def test_the_newest_feedback_of_a_response_wins_and_a_response_s_own_over_its_conversation_s():
    samples = [sample("a/0", [1]), sample("b/0", [1], conversation="c"), sample("d/0", [1], conversation="c")]
    rewards, orphans = rewards_by_sample(samples, [
        feedback("f1", 0.0, response="a", at=NOW - 20), feedback("f2", 1.0, response="a", at=NOW - 10),
        feedback("f3", 0.25, conversation="c"), feedback("f4", 0.5, response="d"),
        feedback("f5", 1.0, response="nobody"), feedback("f6", 1.0, conversation="gone")])
    assert rewards == {"a/0": 1.0, "b/0": 0.25, "d/0": 0.5}
    assert orphans == 2


def test_each_sample_is_judged_once_and_only_rewarded_fresh_ones_train():
    samples = [sample("ok/0", [1, 2]),
               sample("wait/0", [1, 2]),                                  # no reward, young: waits
               sample("old/0", [1, 2], created=NOW - 2 * DAY),            # no reward, past the window: expired
               sample("stale/0", [1, 2], version=0),                      # 3 versions behind > max_staleness 2
               sample("gate/0", [5], question="2+2"),                     # a gate question
               sample("gate/1", [6], question="2+2 Answer with the number."),  # ... as the data set words it
               sample("near/0", [1, 2], question="12+2 Answer with the number."),  # not one
               sample("done/0", [1, 2])]                                  # taken by an earlier firing
    fb = [feedback(f"f-{s}", 1.0, response=s) for s in ("ok", "stale", "gate", "done")]
    window = take(samples, fb, before={"done/0", "near/0"})
    assert window.taken == {"ok/0": "trained", "old/0": "expired", "stale/0": "stale", "gate/0": "gate",
                            "gate/1": "gate"}
    c = window.counts
    assert (c["new"], c["rewarded"], c["waiting"], c["expired"], c["stale"], c["gate_overlap"], c["trained"]) == (
        6, 1, 1, 1, 1, 2, 1)
    [[episode]] = window.iterations
    assert episode.prompt_id == "ok/0" and episode.reward == 1.0
    assert episode.input_ids == [1, 2, 7, 8] and episode.loss_mask == [0, 0, 1, 1]
    assert episode.logprobs == [0.0, 0.0, -0.5, -0.5] and episode.versions == [NO_VERSION, NO_VERSION, 3, 3]
    assert episode.messages[-1] == {"role": "assistant", "content": "2"}
    assert episode.metadata["response_id"] == "ok" and episode.metadata["source"] == "traffic"
    # the waiting one trains once its reward comes, in a later firing
    later = take(samples, [*fb, feedback("f-wait", 0.0, response="wait")],
                 before=set(window.taken) | {"done/0", "near/0"})
    assert later.taken == {"wait/0": "trained"} and later.counts["trained"] == 1


def test_equal_prompts_group_the_rest_pool_and_iterations_are_balanced():
    samples = ([sample(f"g{i}/0", [9, 9], created=NOW - 100 + i) for i in range(3)]      # a group of 3
               + [sample(f"s{i}/0", [i + 20], created=NOW - 50 + i) for i in range(5)])  # 5 singletons
    fb = [feedback(f"f{s['sample_id']}", float(i % 2), response=s["response_id"]) for i, s in enumerate(samples)]
    window = take(samples, fb)
    assert [len(it) for it in window.iterations] == [4, 4]  # 8 episodes, 4 an iteration
    groups = [sorted({e.group_id for e in it}) for it in window.iterations]
    sha = samples[0]["prompt_sha256"][:16]
    assert groups == [sorted([f"traffic:{sha}", f"{POOL}-1"]), [f"{POOL}-2"]]
    # each unit to the emptiest iteration, in order: the group, then s0, s1, s2 to the second, s3 to the first
    assert [e.prompt_id for e in window.iterations[0]] == ["g0/0", "g1/0", "g2/0", "s3/0"]
    assert set(window.taken.values()) == {"trained"} and len(window.taken) == 8


def test_the_share_cap_takes_whole_groups_oldest_first_and_the_rest_waits():
    samples = ([sample(f"g{i}/0", [9, 9], created=NOW - 100 + i) for i in range(3)]
               + [sample(f"s{i}/0", [i + 20], created=NOW - 50 + i) for i in range(3)])
    fb = [feedback(f"f{s['sample_id']}", 1.0, response=s["response_id"]) for s in samples]
    window = take(samples, fb, max_episodes=4)
    assert sorted(window.taken) == ["g0/0", "g1/0", "g2/0", "s0/0"]
    assert window.counts["deferred"] == 2 and window.counts["trained"] == 4
    rest = take(samples, fb, before=set(window.taken))
    assert sorted(rest.taken) == ["s1/0", "s2/0"]


@pytest.mark.parametrize("bad", [{"logprobs": [float("nan"), -0.1]}, {"completion_ids": [], "logprobs": [],
                                                                        "versions": []}])
def test_a_sample_the_trainer_cannot_use_is_taken_as_unusable(bad):
    s = {**sample("x/0", [1]), **bad}
    window = take([s], [feedback("f", 1.0, response="x")])
    assert window.taken == {"x/0": "unusable"} and window.iterations == []


def test_the_line_s_traffic_settings_are_checked_naming_the_key():
    from areal_pipeline.config import ConfigError
    from areal_pipeline.run_spec import load_config

    from test_flows import REPO

    config = REPO / "configs" / "online_cpu.yaml"
    cfg = load_config(config)
    assert cfg.recurring.serve.record and cfg.recurring.traffic_fraction == 1.0
    for override, words in [("recurring.traffic_fraction=1.5", "recurring.traffic_fraction=1.5: must be in [0, 1]"),
                            ("recurring.traffic_min_group=1", "recurring.traffic_min_group=1: must be >= 2"),
                            ("recurring.feedback_window=0", "recurring.feedback_window=0"),
                            ("recurring.serve.retention_days=-1", "recurring.serve.retention_days=-1"),
                            ("recurring.serve.backend=vllm", "only the project's server records")]:
        with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
            load_config(config, [override])


def test_the_line_s_servers_record_into_its_traffic_directory_only_when_asked():
    from areal_pipeline.recurring.line import Line
    from areal_pipeline.run_spec import load_config
    from flows.line_servers import recording_args

    from test_flows import REPO

    line = Line(load_config(REPO / "configs" / "online_cpu.yaml", ["recurring.serve.record_rotate_mb=2"]))
    args = recording_args(line)
    assert args[args.index("--record-dir") + 1] == str((line.dir / "traffic").resolve())
    assert args[args.index("--record-rotate-bytes") + 1] == str(2 << 20)
    assert recording_args(Line(load_config(REPO / "configs" / "recurring_cpu.yaml"))) == []


def test_a_reward_function_scores_samples_without_feedback_and_feedback_wins():
    from areal_pipeline.online.traffic_batch import score_samples
    from areal_pipeline.user_code import load_attr

    from test_flows import REPO

    verifier = load_attr(str(REPO / "examples" / "arithmetic_verifier.py") + ":score", "recurring.traffic_reward")
    right = {**sample("r/0", [1], question="What is 3+4? Answer with the number."),
             "reply": json.dumps({"role": "assistant", "content": "7"})}
    wrong = {**sample("w/0", [1], question="What is 6*7? Answer with the number."),
             "reply": json.dumps({"role": "assistant", "content": "41"})}
    unreadable = sample("u/0", [2], question="Tell me a story")
    scored = score_samples([right, wrong, unreadable], verifier, skip=set())
    assert scored == {"r/0": 1.0, "w/0": 0.0}
    window = take([right, wrong, unreadable], [feedback("f", 0.25, response="w")], scored=scored)
    assert window.taken == {"r/0": "trained", "w/0": "trained"} and window.counts["waiting"] == 1
    assert sorted(e.reward for it in window.iterations for e in it) == [0.25, 1.0]  # w's feedback beats its score
    assert score_samples([right], verifier, skip={"r/0"}) == {}
    with pytest.raises(ValueError, match="traffic_reward returned 'yes' for sample r/0"):
        score_samples([right], lambda messages, completion: "yes", skip=set())


def test_a_gate_question_is_recognised_as_a_data_set_words_it_and_a_longer_number_is_not_one():
    from areal_pipeline.online.traffic_batch import asks_a_gate_question

    gate = {"What is 1+1?"}
    assert asks_a_gate_question("What is 1+1?", gate)
    assert asks_a_gate_question("What is 1+1? Answer with the number.", gate)
    assert asks_a_gate_question("Please: What is 1+1?", gate)
    assert not asks_a_gate_question("What is 11+1? Answer with the number.", gate)
    assert not asks_a_gate_question("What is 1+12?", gate)
    assert not asks_a_gate_question("What is 1+1?", set())
