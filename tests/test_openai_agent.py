"""The openai_agent workflow: agents written against the `openai` SDK, run with a recording client on real CPU servers;
token-exactness across turns, trajectories and rewards, failures, interruption by a weight update, the example agent
and its curriculum, and a run of the example through the real train flow."""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import random
import time
from pathlib import Path

import openai
import pytest

from _openai_helpers import (
    CALCULATOR,
    QUESTION,
    TAUGHT_ANSWER,
    TOOL_RESULT,
    taught_model,
    taught_conversation_ids,
)
from areal_pipeline.config import ConfigError, GenerationConfig
from areal_pipeline.data.trajectory import NO_VERSION, Trajectory
from areal_pipeline.errors import is_transient
from areal_pipeline.inference.client import InferenceServerError, RemoteSGLangEngine
from areal_pipeline.inference.openai_requests import parse_messages
from areal_pipeline.inference.openai_tools import chat_prompt_ids, parse_tool_calls
from areal_pipeline.model import load_model, load_tokenizer
from areal_pipeline.rollout.group import run_group
from areal_pipeline.run_spec import load_config
from areal_pipeline.workflows.openai_agent import AgentError, OpenAIAgentWorkflow, load_agent
from areal_pipeline.workflows.openai_recording import discounted_rewards
from conftest import start_cpu_server
from test_openai_api import perturbed_copy
from test_workflows_common import RecordingEngine, assert_logprobs_match_model

REPO = Path(__file__).resolve().parents[1]
RECORD = {"prompt_id": "p0", "messages": QUESTION, "answer": "42", "question": "What is 6*7?", "sampling_seed": 7}


def run_episode(workflow: OpenAIAgentWorkflow, address: str, record: dict = RECORD, recording: bool = True):
    """The prompt's group of `gconfig.n_samples` agent runs, as the rollout plays it (rollout/group.py)."""
    async def go():
        async with RemoteSGLangEngine([address]) as real:
            engine = RecordingEngine(real) if recording else real
            return await run_group(workflow, engine, record, workflow.gconfig.n_samples), engine
    return asyncio.run(go())


def assert_made_of_its_completions(t: Trajectory, calls, chained: bool = True) -> list:
    """Each completion the trajectory continues (its request's ids, then what came back, a prefix of the trajectory;
    only the last one unless `chained`) sits in it with loss_mask 1, its logprobs and versions; every other token is
    0, 0.0, NO_VERSION."""
    own = [(req, resp) for req, resp in calls if t.input_ids[: len(req.input_ids) + resp.output_len]
           == req.input_ids + resp.output_tokens]
    if not chained:
        own = [(req, resp) for req, resp in own if len(req.input_ids) + resp.output_len == len(t.input_ids)]
    assert len(own) == t.num_turns
    generated = set()
    for req, resp in own:
        start, end = len(req.input_ids), len(req.input_ids) + resp.output_len
        assert t.loss_mask[start:end] == [1] * resp.output_len
        assert t.logprobs[start:end] == pytest.approx(resp.output_logprobs, abs=1e-6)
        assert t.versions[start:end] == resp.output_versions
        generated.update(range(start, end))
    for i in set(range(len(t.input_ids))) - generated:
        assert (t.loss_mask[i], t.logprobs[i], t.versions[i]) == (0, 0.0, NO_VERSION), i
    return own


# ---------------------------------------------------------------------------------------------- token-exactness


@pytest.fixture(scope="module")
def taught(tmp_path_factory):
    """A model taught one conversation (a compact tool call, then the answer after the result) on its own server."""
    model = taught_model(tmp_path_factory)
    server = start_cpu_server(model, tmp_path_factory.mktemp("taught-logs"))
    yield model, server.address
    server.stop()


def _two_turn_agent(seen: list):
    async def agent(client: openai.AsyncOpenAI, data: dict) -> float:
        messages = list(data["messages"])
        first = await client.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR], max_tokens=100)
        message = first.choices[0].message
        messages.append(message.model_dump())  # the reply as the SDK gives it, null fields and all
        messages += [{"role": "tool", "tool_call_id": c.id, "content": TOOL_RESULT} for c in message.tool_calls or []]
        second = await client.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR], max_tokens=40)
        seen.append((first, second, messages))
        return float(second.choices[0].message.content == TAUGHT_ANSWER)
    return agent


@pytest.mark.parametrize("export_style", ["concat", "individual"])
def test_the_recorded_tokens_are_what_the_model_generated_and_was_conditioned_on(taught, export_style):
    """The model writes its call compactly; sent back, the conversation would render it the template's way. The next
    prompt goes on from the generated tokens instead, so the trajectory is exactly the conversation the model was
    taught (which it then answers right), and a teacher-forced pass over it gives the recorded logprobs."""
    model_dir, address = taught
    tokenizer = load_tokenizer(model_dir)
    seen = []
    workflow = OpenAIAgentWorkflow(_two_turn_agent(seen), GenerationConfig(n_samples=1, greedy=True), tokenizer,
                                   export_style=export_style)
    trajectories, engine = run_episode(workflow, address)
    ((first, second, messages),) = seen
    (call,) = first.choices[0].message.tool_calls
    assert call.function.name == "calculator" and json.loads(call.function.arguments) == {"expression": "6*7"}
    assert second.choices[0].message.content == TAUGHT_ANSWER
    prompt, call_ids, after, answer = taught_conversation_ids(tokenizer)
    (first_request, _), (second_request, _) = engine.calls
    assert second_request.input_ids == prompt + call_ids + after
    rerendered = chat_prompt_ids(tokenizer, parse_messages(messages), [CALCULATOR])
    assert rerendered[: len(prompt) + len(call_ids)] != prompt + call_ids  # what re-tokenising would have sent
    model = load_model(model_dir)
    if export_style == "concat":
        (t,) = trajectories
        assert t.input_ids == prompt + call_ids + after + answer and t.num_turns == 2
        assert t.loss_mask == [0] * len(prompt) + [1] * len(call_ids) + [0] * len(after) + [1] * len(answer)
        assert t.reward == 1.0 and t.versions[-1] == 0
        assert_made_of_its_completions(t, engine.calls)
        assert_logprobs_match_model(model, t, atol=1e-4)
        assert [turn["text"] for turn in t.metadata["turns"]] == [tokenizer.decode(call_ids[:-1]), TAUGHT_ANSWER]
        assert [m["role"] for m in t.messages] == ["user", "assistant", "tool", "assistant"]
    else:
        shorter, longer = trajectories
        assert shorter.input_ids == prompt + call_ids and longer.input_ids == prompt + call_ids + after + answer
        assert shorter.reward == pytest.approx(0.9) and longer.reward == 1.0  # the final reward, discounted back
        for t in trajectories:
            assert t.num_turns == 1 and assert_made_of_its_completions(t, engine.calls, chained=False)
            assert_logprobs_match_model(model, t, atol=1e-4)
    facts = trajectories[-1].metadata
    assert (facts["returned_reward"], facts["completions"], facts["tool_calls"]) == (1.0, 2, 1)
    assert "returned_reward" not in trajectories[0].metadata or len(trajectories) == 1


def test_branches_choices_and_text_completions_on_a_real_server(cpu_server, tiny_model_dir):
    """n=2 choices, a conversation going on from the second one, a rewritten history and a text completion: every
    choice is recorded once, chains are joined only where the ids go on, and each trajectory holds its completions'
    tokens exactly."""
    tokenizer = load_tokenizer(tiny_model_dir)

    async def agent(client, data):
        assert [m.id for m in (await client.models.list()).data] == [str(tiny_model_dir)]
        messages = list(data["messages"])
        first = await client.chat.completions.create(model="m", messages=messages, n=2, max_tokens=5)
        messages += [first.choices[1].message.model_dump(exclude_none=True), {"role": "user", "content": "Go on."}]
        await client.chat.completions.create(model="m", messages=messages, max_tokens=5)
        rewritten = list(data["messages"]) + [{"role": "assistant", "content": "12"}, {"role": "user", "content": "?"}]
        await client.chat.completions.create(model="m", messages=rewritten, max_tokens=5)
        await client.completions.create(model="m", prompt="What is", max_tokens=3)
        return {first.id: 1.0}

    workflow = OpenAIAgentWorkflow(agent, GenerationConfig(n_samples=2, max_new_tokens=8), tokenizer)
    trajectories, engine = run_episode(workflow, cpu_server)
    assert len(engine.calls) == 2 * 5
    for sample in (0, 1):
        own = [t for t in trajectories if t.sample_idx == sample]
        # choice 0 alone; choice 1 then the request going on from it; the rewritten history; the text completion
        assert sorted(t.num_turns for t in own) == [1, 1, 1, 2]
        for t in own:
            assert_made_of_its_completions(t, engine.calls)
            assert t.group_id == t.prompt_id == "p0"
        # the first request's reward goes to its choice 0 only: choice 1 went on into a request that earned 0
        assert sorted(t.reward for t in own) == [0.0, 0.0, 0.0, 1.0]
    first_prompt = chat_prompt_ids(tokenizer, parse_messages(QUESTION))
    assert sum(t.input_ids[: len(first_prompt)] == first_prompt for t in trajectories) == 6
    # seeded from the episode's seed: the same episode again samples the same tokens
    again, _ = run_episode(workflow, cpu_server)
    assert [t.input_ids for t in again] == [t.input_ids for t in trajectories]


def test_rewards_are_discounted_back_over_the_requests():
    ids = ["a", "b", "c"]
    assert discounted_rewards(ids, 1.0, 0.9) == pytest.approx({"a": 0.81, "b": 0.9, "c": 1.0})
    assert discounted_rewards(ids, {"a": 0.5, "c": 1.0}, 0.5) == pytest.approx({"a": 0.75, "b": 0.5, "c": 1.0})
    assert discounted_rewards(ids, True, 1.0) == {"a": 1.0, "b": 1.0, "c": 1.0}
    assert discounted_rewards([], 1.0, 0.9) == {}
    with pytest.raises(ValueError, match=r"never made: \['z'\]"):
        discounted_rewards(ids, {"z": 1.0}, 0.9)
    for bad in ("1", None, math.nan, [1.0]):
        with pytest.raises(TypeError, match="must be a finite number"):
            discounted_rewards(ids, bad, 0.9)


# ---------------------------------------------------------------------------------------------- failures


def test_an_agent_error_fails_the_rollout_naming_it_and_a_refused_request_reaches_the_agent(cpu_server, tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)

    async def broken(client, data):
        await client.chat.completions.create(model="m", messages=data["messages"], max_tokens=2)
        return data["no such key"]

    async def careful(client, data):
        await client.chat.completions.create(model="m", messages=data["messages"], max_tokens=2)
        try:
            await client.chat.completions.create(model="m", messages=data["messages"], max_tokens=5000)
        except openai.BadRequestError as refused:
            assert refused.code == "context_length_exceeded" and refused.status_code == 400
            return 0.5
        return 0.0

    async def strange(client, data):
        return "yes"

    g = GenerationConfig(n_samples=1, max_new_tokens=4)
    with pytest.raises(AgentError, match=r"agent broken failed on prompt p0 \(sample 0\): KeyError") as failed:
        run_episode(OpenAIAgentWorkflow(broken, g, tokenizer, entry="broken"), cpu_server)
    assert isinstance(failed.value.__cause__, KeyError) and not is_transient(failed.value)
    (t,), _ = run_episode(OpenAIAgentWorkflow(careful, g, tokenizer), cpu_server)
    assert t.reward == 0.5 and t.metadata["completions"] == 1
    with pytest.raises(AgentError, match="returned 'yes': the reward must be a finite number"):
        run_episode(OpenAIAgentWorkflow(strange, g, tokenizer, entry="strange"), cpu_server)


def test_a_server_failure_reaches_the_rollout_even_when_the_agent_swallows_it(tiny_model_dir, dead_address):
    tokenizer = load_tokenizer(tiny_model_dir)
    caught = []

    async def forgiving(client, data):
        try:
            await client.chat.completions.create(model="m", messages=data["messages"])
        except openai.APIConnectionError as e:
            caught.append(e)
        return 0.0

    async def go():
        dead = RemoteSGLangEngine([dead_address], request_retries=0)
        async with dead:
            return await OpenAIAgentWorkflow(forgiving, GenerationConfig(n_samples=1), tokenizer).arun_episode(
                dead, RECORD)

    with pytest.raises(InferenceServerError) as failed:
        asyncio.run(go())
    assert caught and is_transient(failed.value)


def test_generation_interrupted_by_a_weight_update_resumes_with_the_new_version(tiny_model_dir, tmp_path):
    """A weight update pauses the server in the middle of the agent's completion; it goes on under the new weights
    and each token keeps the version that produced it."""
    tokenizer = load_tokenizer(tiny_model_dir)
    server = start_cpu_server(tiny_model_dir, tmp_path)
    new_weights = perturbed_copy(tiny_model_dir, tmp_path / "v1")

    async def long_answer(client, data):
        await client.chat.completions.create(model="m", messages=data["messages"], max_tokens=900,
                                             extra_body={"ignore_eos": True})
        return 1.0

    async def go():
        workflow = OpenAIAgentWorkflow(long_answer, GenerationConfig(n_samples=1), tokenizer)
        async with RemoteSGLangEngine([server.address]) as engine, RemoteSGLangEngine([server.address]) as trainer:
            episode = asyncio.create_task(workflow.arun_episode(engine, RECORD))
            deadline = time.monotonic() + 60
            while (await trainer.get_server_info())["internal_states"][0]["generated_tokens"] < 100:
                assert time.monotonic() < deadline, "the generation never started"
                await asyncio.sleep(0.01)
            await trainer.pause()
            await trainer.update_weights_from_disk(str(new_weights), version=1)
            await trainer.resume()
            return await asyncio.wait_for(episode, 120)

    try:
        (t,) = asyncio.run(go())
    finally:
        server.stop()
    generated = [v for v, m in zip(t.versions, t.loss_mask) if m]
    switch = generated.index(1)
    assert len(generated) == 900 and 0 < switch < 900 and generated == [0] * switch + [1] * (900 - switch)


# ---------------------------------------------------------------------------------------------- entry and config


def test_the_agent_is_named_in_the_config_and_loaded_with_clear_errors(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    from examples.calculator_agent import agent

    assert load_agent("examples.calculator_agent:agent") is agent
    assert load_agent("examples/calculator_agent.py:agent").__name__ == "agent"  # a file path works too
    (tmp_path / "plain.py").write_text("def agent(client, data):\n    return 1.0\nvalue = 3\n")
    for entry, error, says in [
        ("examples.calculator_agent", ValueError, "must be 'module:function'"),
        ("no_such_module_x:agent", ModuleNotFoundError, "cannot import 'no_such_module_x'"),
        ("examples.calculator_agent:missing", AttributeError, "has no 'missing'"),
        (f"{tmp_path}/plain.py:agent", TypeError, "must be an async function"),
        (f"{tmp_path}/absent.py:agent", FileNotFoundError, "no such file"),
    ]:
        with pytest.raises(error, match=says):
            load_agent(entry)
    for overrides, says in [
        (["rollout.workflow=openai_agent"], "rollout.agent.entry='': must name the agent as 'module:function'"),
        (["rollout.workflow=openai_agent", "rollout.agent.entry=my module"], "must name the agent"),
        (["rollout.agent.export_style=tree"], "rollout.agent.export_style='tree': must be one of concat, individual"),
    ]:
        with pytest.raises(ConfigError, match=says):
            load_config(None, overrides)
    cfg = load_config(REPO / "configs" / "calculator_agent.yaml")
    assert cfg.rollout.workflow == "openai_agent" and cfg.rollout.agent.entry == "examples.calculator_agent:agent"


def test_the_example_agent_is_plain_openai_and_its_curriculum_writes_the_workflows_tokens(tiny_model_dir):
    """examples/calculator_agent.py imports nothing of the pipeline; the warm start writes its episodes in exactly the
    tokens the workflow records for it: its prompt, a call the parser reads as the agent's tool, the ids the workflow
    splices in after the call for the calculator's result, and an answer."""
    from areal_pipeline.config import TinyModelConfig
    from areal_pipeline.warm_start import IGNORE
    from areal_pipeline.warm_start.calculator import TOOL, WRITTEN_FOR, curriculum
    from areal_pipeline.workflows.openai_recording import ids_after_reply
    from examples import calculator_agent

    source = inspect.getsource(calculator_agent)
    assert "areal_pipeline" not in source and "from openai import AsyncOpenAI" in source
    assert calculator_agent.CALCULATOR == TOOL
    assert WRITTEN_FOR["rollout.agent.entry"] == "examples.calculator_agent:agent"
    assert [calculator_agent.calculate(e) for e in ("7*8", "(3+4)*2", "7/2", "1/0", "__import__('os')")] == [
        "56", "14", "3.5", "error: division by zero", "error: not arithmetic: __import__('os')"]

    tokenizer = load_tokenizer(tiny_model_dir)
    sample = curriculum(tokenizer, TinyModelConfig(pretrain_steps=2), seed=1)
    sample(random.Random(0), 1)  # the first (and only short-phase) step: rows without the tools' system message
    rows = sample(random.Random(0), 64)
    called = [(ids, labels) for ids, labels in rows if labels.count(IGNORE) < len(labels) - 10]
    assert 5 < len(called) < 64  # some answer at once
    for ids, labels in called:
        spans, start = [], None  # the labelled runs: the call, then the answer
        for i, label in enumerate(labels + [IGNORE]):
            if label != IGNORE and start is None:
                start = i
            elif label == IGNORE and start is not None:
                spans.append((start, i))
                start = None
        (call_start, call_end), (answer_start, answer_end) = spans
        question = tokenizer.decode(ids[:call_start]).split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
        messages = [{"role": "user", "content": question}]
        assert ids[:call_start] == chat_prompt_ids(tokenizer, parse_messages(messages), [TOOL])
        content, (call,) = parse_tool_calls(tokenizer.decode(ids[call_start:call_end - 1]), {"calculator"})
        expression = json.loads(call["function"]["arguments"])["expression"]
        assert content is None and f"What is {expression}?" in question
        result = calculator_agent.calculate(expression)
        conversation = parse_messages(messages + [{"role": "assistant", "content": None, "tool_calls": [call]},
                                                  {"role": "tool", "tool_call_id": call["id"], "content": result}])
        assert ids[call_end:answer_start] == ids_after_reply(tokenizer, conversation, 1, [TOOL])
        assert int(tokenizer.decode(ids[answer_start:answer_end - 1])) in (int(result), int(result) + 1)


def test_the_example_agent_trains_through_the_train_flow(prefect_api, tiny_model_dir, tmp_path):
    """configs/calculator_agent.yaml, shrunk, through the same `train` flow as every other agent: the agent runs as
    it is and its recorded episodes are trained on."""
    from flows.train import train

    result = train(config_path=str(REPO / "configs" / "calculator_agent.yaml"), overrides=[
        f"output_dir={tmp_path}", f"model.path={tiny_model_dir}", "total_iterations=2", "eval_freq=2",
        "eval_max_prompts=4", "rollout.batch_size=2", "rollout.gconfig.n_samples=2",
        "rollout.gconfig.max_new_tokens=8"])
    run_dir = Path(result["run_dir"])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2]
    assert all(math.isfinite(r["loss"]) and "agent/returned_reward" in r for r in records)
    assert (run_dir / "checkpoints" / "step_2" / "model" / "config.json").is_file()
    from areal_pipeline.data.shards import read_trajectories

    episodes = read_trajectories(run_dir / "iter_2" / "rollout")
    assert len(episodes) == 4 and all(t.metadata["completion_ids"] and sum(t.loss_mask) for t in episodes)
