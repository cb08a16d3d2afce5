"""Reflection, multi-turn with feedback, and ReMax: scripted turns for the exact behaviour, a real CPU server for the
token-level invariants (the tiny model writes random bytes, so checks go by structure)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from areal_pipeline.config import GenerationConfig

from areal_pipeline.data.shards import read_table, write_shards
from areal_pipeline.inference.client import RemoteSGLangEngine
from areal_pipeline.model import load_model, load_tokenizer
from areal_pipeline.rewards import math_reward
from areal_pipeline.rewards.pool import RewardPool
from areal_pipeline.rollout.executor import run_episodes
from areal_pipeline.rollout.group import run_group
from areal_pipeline.run_spec import assemble, build_workflow, load_config
from areal_pipeline.training.batches import compute_batch, read_batch, write_batch
from areal_pipeline.workflows.multi_turn import CORRECT_MESSAGE, WRONG_MESSAGE, MultiTurnWorkflow, per_version_log
from areal_pipeline.workflows.reflection import REFLECTION_MESSAGE, ReflectionWorkflow
from areal_pipeline.workflows.turns import user_turn_ids
from areal_pipeline.workflows.rlvr import RLVRWorkflow, chat_prompt_ids
from test_workflows_common import (
    InlinePool,
    RecordingEngine,
    ScriptedEngine,
    assert_logprobs_match_model,
    assert_token_invariants,
    play,
)

DATA = {"prompt_id": "p0", "answer": "7",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3+4?"}]}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def _enc(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _digits(completion: str, answer: str) -> float:
    """A reward the random tiny model earns now and then (module level: the reward pool's workers import it)."""
    return sum(c.isdigit() for c in completion) / 4


# ---------------------------------------------------------------------------------------------- reflection


def test_reflection_ids_are_the_templated_prefix_difference(tokenizer):
    eos = tokenizer.eos_token_id
    closing, message = user_turn_ids(tokenizer, REFLECTION_MESSAGE)
    # on the very conversation of an episode, not only the placeholder the ids were computed on
    conversation = DATA["messages"] + [{"role": "assistant", "content": "5"}]
    closed = tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False)
    full = tokenizer.apply_chat_template(conversation + [{"role": "user", "content": REFLECTION_MESSAGE}],
                                         tokenize=True, add_generation_prompt=True, return_dict=False)
    assert message == full[len(closed):]
    assert closed[-len(closing) - 1:] == [eos] + closing and closing == _enc(tokenizer, "\n")
    assert tokenizer.decode(message) == f"<|im_start|>user\n{REFLECTION_MESSAGE}<|im_end|>\n<|im_start|>assistant\n"


def test_templates_that_cannot_append_turns_are_refused(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    tokenizer.eos_token = "<|endoftext|>"  # a base model's EOS: the chat template never writes it
    with pytest.raises(ValueError, match="does not end an assistant turn with the EOS token '<|endoftext|>'"):
        user_turn_ids(tokenizer, "again")


def test_reflection_retries_until_right_and_discounts(tokenizer):
    eos = tokenizer.eos_token_id
    outputs = {0: _enc(tokenizer, "5"), 1: _enc(tokenizer, "6") + [eos], 2: _enc(tokenizer, "7"), 3: [55]}
    engine = ScriptedEngine(lambda req, turn: outputs[turn])
    workflow = ReflectionWorkflow(math_reward, GenerationConfig(n_samples=1, max_new_tokens=16), tokenizer,
                                  InlinePool(), max_turns=4, turn_discount=0.5)
    t = asyncio.run(workflow.arun_episode(engine, DATA))
    prompt = chat_prompt_ids(tokenizer, DATA["messages"])
    env = workflow.closing_ids + workflow.message_ids
    # an EOS is inserted after "5" (the turn did not end with one), not after "6<eos>"
    assert t.input_ids == prompt + _enc(tokenizer, "5") + [eos] + env + _enc(tokenizer, "6") + [eos] + env + \
        _enc(tokenizer, "7")
    assert t.loss_mask == [0] * len(prompt) + [1] + [0] * (1 + len(env)) + [1, 1] + [0] * len(env) + [1]
    assert t.num_turns == 3 and t.reward == 0.25  # right at the third turn: 1 x 0.5^2
    assert [turn["reward"] for turn in t.metadata["turns"]] == [0.0, 0.0, 1.0]
    assert [turn["version_start"] for turn in t.metadata["turns"]] == [3, 3, 3]
    assert [m["content"] for m in t.messages[2:]] == ["5", REFLECTION_MESSAGE, "6", REFLECTION_MESSAGE, "7"]
    assert t.token_returns is None
    # the episode's facts that the rollout stats average as agent/<key>
    assert (t.metadata["first_turn_correct"], t.metadata["success"], t.metadata["num_turns"]) == (False, True, 3)
    assert_token_invariants(t, engine.calls, prompt)


def test_reflection_group_ends_after_max_turns(tokenizer):
    engine = ScriptedEngine(lambda req, turn: _enc(tokenizer, "no idea"), stop_reason="length")
    workflow = ReflectionWorkflow(math_reward, GenerationConfig(n_samples=3, max_new_tokens=16), tokenizer,
                                  InlinePool(), max_turns=2)
    trajectories = play(workflow, engine, DATA, 3)
    assert [t.sample_idx for t in trajectories] == [0, 1, 2] and len(engine.calls) == 6
    assert len({req.rid for req, _ in engine.calls}) == 3  # one rid per episode, shared by its turns
    for t in trajectories:
        assert (t.reward, t.num_turns, t.stop_reason) == (0.0, 2, "length")
        assert t.input_ids[-len("no idea"):] == _enc(tokenizer, "no idea")  # nothing appended after the last turn
        assert_token_invariants(t, engine.calls, chat_prompt_ids(tokenizer, DATA["messages"]))


# ---------------------------------------------------------------------------------------------- multi-turn


def test_multi_turn_per_turn_rewards_and_discounted_returns(tokenizer):
    outputs = {0: _enc(tokenizer, "5"), 1: _enc(tokenizer, "it is 6"), 2: _enc(tokenizer, "7")}
    engine = ScriptedEngine(lambda req, turn: outputs[turn])
    workflow = MultiTurnWorkflow(math_reward, GenerationConfig(n_samples=1, max_new_tokens=16), tokenizer,
                                 InlinePool(), max_turns=3, turn_level_discount=0.9)
    t = asyncio.run(workflow.arun_episode(engine, DATA))
    turns = t.metadata["turns"]
    assert [x["success"] for x in turns] == [False, False, True]
    assert [x["reward"] for x in turns] == [-1.0, -1.0, 1.0]
    # G2 = 1, G1 = -1 + 0.9 * 1 = -0.1, G0 = -1 + 0.9 * -0.1 = -1.09
    assert [x["return"] for x in turns] == pytest.approx([-1.09, -0.1, 1.0])
    assert t.reward == pytest.approx(0.81) and t.num_turns == 3
    prompt = chat_prompt_ids(tokenizer, DATA["messages"])
    calls = assert_token_invariants(t, engine.calls, prompt)
    for (req, resp), value in zip(calls, [-1.09, -0.1, 1.0]):
        start = len(req.input_ids)
        assert t.token_returns[start:start + resp.output_len] == pytest.approx([value] * resp.output_len)
    assert all(r == 0.0 for r, m in zip(t.token_returns, t.loss_mask) if not m)
    closing, wrong = user_turn_ids(tokenizer, WRONG_MESSAGE)
    second = calls[1][0].input_ids
    assert second == prompt + _enc(tokenizer, "5") + [tokenizer.eos_token_id] + closing + wrong
    assert [m["content"] for m in t.messages[2:]] == ["5", WRONG_MESSAGE, "it is 6", WRONG_MESSAGE, "7"]
    assert WRONG_MESSAGE == "Unfortunately your answer is wrong. Let's try again."  # MathMultiTurnAgent's
    assert (t.metadata["first_turn_correct"], t.metadata["success"], t.metadata["num_turns"]) == (False, True, 3)
    assert t.metadata["return"] == pytest.approx(-1.09)


def test_multi_turn_can_keep_going_after_a_right_answer_as_math_multi_turn_agent_does(tokenizer):
    """stop_on_success=false: every episode plays max_turns turns; a right answer gets the correct message."""
    outputs = {0: _enc(tokenizer, "7"), 1: _enc(tokenizer, "8"), 2: _enc(tokenizer, "7")}
    engine = ScriptedEngine(lambda req, turn: outputs[turn])
    workflow = MultiTurnWorkflow(math_reward, GenerationConfig(n_samples=1, max_new_tokens=16), tokenizer,
                                 InlinePool(), max_turns=3, turn_level_discount=0.5, stop_on_success=False)
    t = asyncio.run(workflow.arun_episode(engine, DATA))
    turns = t.metadata["turns"]
    assert [x["success"] for x in turns] == [True, False, True] and t.num_turns == 3
    # G2 = 1, G1 = -1 + 0.5 * 1 = -0.5, G0 = 1 + 0.5 * -0.5 = 0.75
    assert [x["return"] for x in turns] == pytest.approx([0.75, -0.5, 1.0])
    assert t.reward == 1.0  # right at the first turn
    assert (t.metadata["first_turn_correct"], t.metadata["success"], t.metadata["return"]) == (True, True, 0.75)
    assert [m["content"] for m in t.messages[2:]] == ["7", CORRECT_MESSAGE, "8", WRONG_MESSAGE, "7"]
    prompt = chat_prompt_ids(tokenizer, DATA["messages"])
    calls = assert_token_invariants(t, engine.calls, prompt)
    eos = tokenizer.eos_token_id
    closing, correct = user_turn_ids(tokenizer, CORRECT_MESSAGE)
    wrong = user_turn_ids(tokenizer, WRONG_MESSAGE)[1]
    assert calls[1][0].input_ids == prompt + _enc(tokenizer, "7") + [eos] + closing + correct
    assert calls[2][0].input_ids == calls[1][0].input_ids + _enc(tokenizer, "8") + [eos] + closing + wrong
    # first wrong, then right: the reward is discounted to the first right turn; own messages are used
    outputs = {0: _enc(tokenizer, "5"), 1: _enc(tokenizer, "7"), 2: _enc(tokenizer, "7")}
    workflow = MultiTurnWorkflow(math_reward, GenerationConfig(n_samples=1, max_new_tokens=16), tokenizer,
                                 InlinePool(), max_turns=3, turn_level_discount=0.5, stop_on_success=False,
                                 correct_message="Yes.", wrong_message="No.")
    t = asyncio.run(workflow.arun_episode(ScriptedEngine(lambda req, turn: outputs[turn]), DATA))
    assert t.reward == 0.5 and t.num_turns == 3
    assert [m["content"] for m in t.messages[2:]] == ["5", "No.", "7", "Yes.", "7"]


def test_multi_turn_reward_bias_and_scaling(tokenizer):
    engine = ScriptedEngine(lambda req, turn: _enc(tokenizer, "5"))
    workflow = MultiTurnWorkflow(math_reward, GenerationConfig(n_samples=2, max_new_tokens=16), tokenizer,
                                 InlinePool(), max_turns=2, turn_level_discount=0.9, reward_bias=0.5,
                                 reward_scaling=2.0)
    for t in play(workflow, engine, DATA, 2):
        # wrong: ((0 - 0.5) * 2 - 0.5) * 2 = -3; G1 = -3, G0 = -3 + 0.9 * -3 = -5.7
        assert [x["return"] for x in t.metadata["turns"]] == pytest.approx([-5.7, -3.0])
        assert t.reward == 0.0
    assert workflow.turn_reward(True) == 1.0  # ((1 - 0.5) * 2 - 0.5) * 2


def test_per_version_log_reads_every_finished_rollout(tokenizer, tmp_path):
    workflow = MultiTurnWorkflow(math_reward, GenerationConfig(n_samples=2, max_new_tokens=16), tokenizer,
                                 InlinePool(), max_turns=2)
    for iteration, version in ((1, 0), (2, 1)):
        engine = ScriptedEngine(lambda req, turn: _enc(tokenizer, "7" if turn else "5"))
        engine.VERSION = version
        write_shards(play(workflow, engine, DATA, 2), tmp_path / f"iter_{iteration}" / "rollout",
                     run_id="r", iteration=iteration)
    (tmp_path / "iter_3" / "rollout").mkdir(parents=True)  # unfinished: no manifest
    log = per_version_log(tmp_path)
    assert len(log) == 8
    assert [(r["iteration"], r["version"]) for r in log] == [(1, 0)] * 4 + [(2, 1)] * 4
    first = log[0]
    assert (first["prompt_id"], first["sample_idx"], first["turn"], first["answer"]) == ("p0", 0, 0, "5")
    assert (first["success"], first["reward"], first["return"]) == (False, -1.0, pytest.approx(-0.1))
    assert {r["answer"] for r in log if r["turn"] == 1} == {"7"}


# ---------------------------------------------------------------------------------------------- real server


@pytest.mark.parametrize("name, all_turns", [("reflection", False), ("multi_turn", False), ("multi_turn", True)])
def test_multi_turn_workflows_against_a_real_server(name, all_turns, cpu_server, tiny_model_dir, tmp_path):
    """all_turns: multi_turn with stop_on_success=false (MathMultiTurnAgent's episodes: always max_turns turns)."""
    tokenizer = load_tokenizer(tiny_model_dir)
    cfg = load_config(None, [f"rollout.workflow={name}", "rollout.gconfig.n_samples=3",
                             "rollout.gconfig.max_new_tokens=6", "rollout.agent.max_turns=3",
                             f"rollout.agent.stop_on_success={str(not all_turns).lower()}"])
    run = assemble(cfg)
    if all_turns:  # a reward the random model earns on some turns, so that turns after a right one occur
        run = dataclasses.replace(run, reward=_digits)
    records = [{"prompt_id": f"p{i}", "messages": [{"role": "user", "content": f"What is {i}+1?"}],
                "answer": str(i + 1), "sampling_seed": 100 + i} for i in range(3)]

    async def go():
        with RewardPool(timeout=30) as pool:
            workflow = build_workflow(run, tokenizer, pool)
            async with RemoteSGLangEngine([cpu_server]) as real:
                engine = RecordingEngine(real)
                groups = await asyncio.gather(*(run_group(workflow, engine, r, 3) for r in records))
        return workflow, engine, groups

    workflow, engine, groups = asyncio.run(go())
    model = load_model(tiny_model_dir)
    eos = tokenizer.eos_token_id
    message = workflow.message_ids
    for record, group in zip(records, groups):
        assert [t.sample_idx for t in group] == [0, 1, 2]
        prompt = chat_prompt_ids(tokenizer, record["messages"])
        for t in group:
            calls = assert_token_invariants(t, engine.calls, prompt)
            assert_logprobs_match_model(model, t)
            right = [turn["reward"] > 0 for turn in t.metadata["turns"]]
            # between turns: exactly an EOS where the model gave none, the template's closing, the message
            for (req, resp), (next_req, _), was_right in zip(calls, calls[1:], right):
                end = len(req.input_ids) + resp.output_len
                inserted = [] if resp.output_tokens[-1:] == [eos] else [eos]
                said = workflow.correct_ids if was_right else message
                assert next_req.input_ids[end:] == inserted + workflow.closing_ids + said
            solved = right[-1]
            assert t.num_turns == 3 or (solved and not all_turns)
            assert t.metadata["first_turn_correct"] == right[0] and t.metadata["num_turns"] == t.num_turns
            if name == "multi_turn":
                returns = [x["return"] for x in t.metadata["turns"]]
                for (req, resp), value in zip(calls, returns):
                    start = len(req.input_ids)
                    assert t.token_returns[start:start + resp.output_len] == pytest.approx([value] * resp.output_len)
                assert t.reward == (0.9 ** right.index(True) if any(right) else 0.0)
                assert t.metadata["return"] == returns[0]
            else:
                assert t.reward == t.metadata["turns"][-1]["reward"] * 0.9 ** (t.num_turns - 1)
    trajectories = [t for g in groups for t in g]
    write_shards(trajectories, tmp_path / "iter_1" / "rollout", run_id="r", iteration=1)
    table, _ = compute_batch(read_table(tmp_path / "iter_1" / "rollout"), cfg.ppo)
    for adv, mask in zip(table.column("advantages").to_pylist(), table.column("loss_mask").to_pylist()):
        assert all(a == 0 for a, m in zip(adv, mask) if not m)
    assert len(per_version_log(tmp_path)) == sum(t.num_turns for t in trajectories)
    if all_turns:
        assert any(r and i < 2 for t in trajectories for i, r in enumerate(
            turn["success"] for turn in t.metadata["turns"])), "no turn followed a right answer"


# ---------------------------------------------------------------------------------------------- ReMax


def _greedy(workflow_cfg: GenerationConfig) -> GenerationConfig:
    return dataclasses.replace(workflow_cfg, n_samples=1, greedy=True)


def test_remax_advantage_is_sampled_minus_greedy_reward(tokenizer, tmp_path):
    """ReMax is the ordinary single-turn workflow plus an advantage that asks the rollout for a greedy baseline
    episode: its reward reaches each sampled trajectory, and the advantage is the difference."""
    by_seed = {0: "7", 1009: "3"}  # group.episode_data: episode i of a prompt seeded 0 gets seed 1009 * i

    def respond(req, turn):
        return _enc(tokenizer, "7" if req.sampling.greedy else by_seed[req.sampling.sampling_seed])

    engine = ScriptedEngine(respond)
    gconfig = GenerationConfig(n_samples=2, max_new_tokens=8)
    workflow = RLVRWorkflow(math_reward, gconfig, tokenizer, InlinePool())
    baseline = RLVRWorkflow(math_reward, _greedy(gconfig), tokenizer, InlinePool())
    t0, t1 = play(workflow, engine, {**DATA, "sampling_seed": 0}, 2, baseline)
    greedy = [req for req, _ in engine.calls if req.sampling.greedy]
    assert len(engine.calls) == 3 and len(greedy) == 1 and greedy[0].sampling.sampling_seed is None
    assert all(req.input_ids == chat_prompt_ids(tokenizer, DATA["messages"]) for req, _ in engine.calls)
    assert (t0.reward, t1.reward) == (1.0, 0.0)  # each sample keeps its own reward; the baseline is not kept
    assert (t0.sample_idx, t1.sample_idx) == (0, 1) and t0.baseline_reward == t1.baseline_reward == 1.0
    write_shards([t0, t1], tmp_path / "rollout", run_id="r", iteration=1)
    ppo = load_config("configs/remax.yaml").ppo
    table, stats = compute_batch(read_table(tmp_path / "rollout"), ppo)
    for t, row, advantage in zip((t0, t1), table.column("advantages").to_pylist(), (0.0, -1.0)):
        assert row == [advantage if m else 0.0 for m in t.loss_mask]
    assert table.column("task_reward").to_pylist() == [1.0, 0.0] and stats["advantage_min"] == -1.0

    # without the advantage asking for one (evaluation, GRPO) no baseline episode runs
    engine.calls.clear()
    (t,) = play(baseline, engine, DATA)
    assert len(engine.calls) == 1 and t.reward == 1.0 and t.baseline_reward is None
    write_shards([t], tmp_path / "plain", run_id="r", iteration=1)
    with pytest.raises(ValueError, match="ppo.advantage=remax needs each trajectory's baseline_reward"):
        compute_batch(read_table(tmp_path / "plain"), ppo)


def test_remax_trains_with_reinforce_on_its_advantages(cpu_server, tiny_model_dir, tmp_path):
    from areal_pipeline.training.client import launch_trainer

    tokenizer = load_tokenizer(tiny_model_dir)
    cfg = load_config("configs/remax.yaml", [f"output_dir={tmp_path}", "rollout.gconfig.max_new_tokens=16",
                                             "trainer.optimizer.lr=1e-3"])
    records = [{"prompt_id": f"p{i}", "messages": [{"role": "user", "content": f"What is {i}+2?"}],
                "answer": str(i + 2), "sampling_seed": 7 * i} for i in range(8)]

    async def go():
        with RewardPool(timeout=30) as pool:
            workflow = RLVRWorkflow(_digits, cfg.rollout.gconfig, tokenizer, pool)
            baseline = RLVRWorkflow(_digits, _greedy(cfg.rollout.gconfig), tokenizer, pool)
            async with RemoteSGLangEngine([cpu_server]) as engine:
                return await run_episodes(workflow, engine, records, max_concurrent_rollouts=8,
                                          n_samples=cfg.rollout.gconfig.n_samples, baseline=baseline, progress=False)

    trajectories = asyncio.run(go())
    # n_samples sampled completions a prompt; the greedy baselines are not trained
    assert len(trajectories) == len(records) * cfg.rollout.gconfig.n_samples
    advantages = [t.reward - t.baseline_reward for t in trajectories]
    assert any(advantages), "the stub reward should separate some samples from their baseline"
    rollout, batch_dir = tmp_path / "rollout", tmp_path / "batch"
    write_shards(trajectories, rollout, run_id="r", iteration=1)
    write_batch(rollout, batch_dir, cfg.ppo, run_id="r", iteration=1)
    batch = read_batch(batch_dir, ("input_ids", "loss_mask", "logprobs", "advantages"))
    for row, mask, advantage in zip(batch["advantages"], batch["loss_mask"], advantages):
        assert row == pytest.approx([advantage if m else 0.0 for m in mask], abs=1e-6)  # reaches the trainer as is
    mask = torch.tensor([m for row in batch["loss_mask"] for m in row], dtype=torch.float32)
    adv = torch.tensor([a for row in batch["advantages"] for a in row])
    logp = torch.tensor([lp for row in batch["logprobs"] for lp in row])  # the server's = the policy's, before the step
    expected = -(adv * logp * mask).sum() / mask.sum()
    process, client = launch_trainer(cfg, str(tiny_model_dir), tmp_path / "logs")
    try:
        stats = client.call("train", batch_dir=str(batch_dir), iteration=1)["stats"]
    finally:
        process.stop()
    assert stats["loss"] == pytest.approx(float(expected), abs=1e-4)


def test_chat_prompt_ids_are_remembered_within_a_bounded_cache(tokenizer):
    import areal_pipeline.workflows.rlvr as rlvr

    def render(messages):
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))

    rlvr._templated_ids.cache_clear()
    workflow = rlvr.RLVRWorkflow(math_reward, GenerationConfig(n_samples=2), tokenizer, reward_pool=None)
    prompts = [[{"role": "user", "content": f"What is {i}+1?"}] for i in range(3)]
    first = chat_prompt_ids(tokenizer, prompts[0])
    assert first == render(prompts[0])
    first.append(-1)  # a caller's copy: the remembered ids stay as they were
    assert chat_prompt_ids(tokenizer, prompts[0]) == render(prompts[0])
    for messages in prompts[1:]:
        assert chat_prompt_ids(tokenizer, messages) == render(messages)
    info = rlvr._templated_ids.cache_info()
    assert (info.hits, info.currsize, info.maxsize) == (1, 3, rlvr.PROMPT_CACHE_SIZE)  # rendered once each, bounded
    requests = [workflow.request({"messages": prompts[2], "sampling_seed": 5}) for _ in range(2)]
    assert [r.input_ids for r in requests] == [render(prompts[2])] * 2
    assert rlvr._templated_ids.cache_info().hits == 3  # each episode's prompt came from the cache
