"""The search agent against the retrieval server: scripted turns for the protocol (search -> information ->
answer, limits, retrieval failures), the real CPU server for the token-level invariants."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
import torch

from areal_pipeline.config import GenerationConfig

from areal_pipeline.data.knowledge_base import knowledge_base
from areal_pipeline.data.shards import read_trajectories, verify_shards
from areal_pipeline.inference.client import RemoteSGLangEngine
from areal_pipeline.inference.types import ModelRequest, ModelResponse
from areal_pipeline.model import load_model, load_tokenizer
from areal_pipeline.rollout.failures import FailurePolicy
from areal_pipeline.rollout.group import play_group, run_group
from areal_pipeline.rewards import exact_match_reward, f1_reward
from areal_pipeline.run_spec import build_workflow, load_config
from areal_pipeline.tools.retrieval_client import RetrievalClient
from areal_pipeline.tools.retrieval_server import launch_retrieval_server
from areal_pipeline.workflows.rlvr import chat_prompt_ids
from areal_pipeline.services import Services
from areal_pipeline.tools.retrieval_client import RetrievalError, check_retrieval_server
from areal_pipeline.workflows.search_agent import (
    STOP_STRINGS,
    TUTORIAL_PROMPT,
    SearchAgentWorkflow,
    format_information,
    parse_action,
    search_prompt,
    search_prompt_ids,
)
from test_workflows_common import (
    InlinePool,
    RecordingEngine,
    ScriptedEngine,
    assert_logprobs_match_model,
    assert_token_invariants,
    play,
)

# A two-hop question over the generated knowledge base, and the pages that answer it.
QUESTION = next(q for q in knowledge_base().questions["train"] if q["question"].startswith("What is the capital"))
PERSON = max((r["title"] for r in knowledge_base().corpus if r["title"] in QUESTION["question"]), key=len)
CITY = next(r for r in knowledge_base().corpus if r["title"] == PERSON)["contents"].split(" born in ")[1].split(" in ")[0]
DATA = {"prompt_id": "q0", "question": QUESTION["question"], "answer": QUESTION["answer"],
        "messages": [{"role": "user", "content": QUESTION["question"]}]}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def retrieval(tmp_path_factory):
    root = tmp_path_factory.mktemp("retrieval")
    server = launch_retrieval_server(load_config("configs/search_agent.yaml", [f"output_dir={root}"]), root / "logs")
    yield server.address
    server.stop()


def _enc(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _workflow(tokenizer, address: str, *, reward=f1_reward, max_turns: int = 4, max_tokens: int = 1024,
              n_samples: int = 1, retries: int = 0, max_new_tokens: int = 96) -> SearchAgentWorkflow:
    return SearchAgentWorkflow(reward, GenerationConfig(n_samples=n_samples, max_new_tokens=max_new_tokens), tokenizer,
                               RetrievalClient(address, retries=retries, retry_delay=0.01), max_turns=max_turns,
                               max_tokens=max_tokens, topk=2)


def test_parse_action_takes_the_first_closed_tag():
    assert parse_action("<think>hm</think> <search> who is X </search>") == ("search", "who is X")
    assert parse_action("<answer> Paris </answer><search>y</search>") == ("answer", "Paris")
    assert parse_action("<search>a</search> then <answer>b</answer>") == ("search", "a")
    assert parse_action("no tags </search>") == (None, "")
    assert parse_action("<search>unfinished") == (None, "")
    assert parse_action("") == (None, "")


def test_information_block():
    docs = [{"id": "1", "title": "Rilis", "contents": '"Rilis"\nRilis is a city.'},
            {"id": "2", "title": "Other", "contents": "No title line here."}]
    assert format_information(docs) == ("\n\n<information>Doc 1 (Title: Rilis) Rilis is a city.\n"
                                        "Doc 2 (Title: Other) No title line here.</information>\n\n")
    assert format_information([]) == "\n\n<information>No results.</information>\n\n"
    # the tutorial's blocks: the contents as the server returns them
    assert format_information(docs, "tutorial") == (
        '\n\n<information>\n<p title="Rilis">\n"Rilis"\nRilis is a city.\n</p>\n\n'
        '<p title="Other">\nNo title line here.\n</p>\n</information>')


def test_prompt_asks_in_the_agent_format():
    messages = search_prompt({**DATA, "messages": [{"role": "system", "content": "S"}, *DATA["messages"]]})
    assert messages[0] == {"role": "system", "content": "S"}
    assert messages[1]["role"] == "user" and messages[1]["content"].endswith(f"Question: {DATA['question']}")
    assert all(tag in messages[1]["content"] for tag in ("<think>", "<search>", "<information>", "<answer>"))
    assert search_prompt(DATA, "question") == [{"role": "user", "content": DATA["question"]}]
    (raw,) = search_prompt(DATA, "tutorial")
    assert raw["content"].startswith("A conversation between User and Assistant.")
    assert raw["content"].endswith(f"User:\n{DATA['question']}\n\nAssistant:\n<think>")


def test_two_searches_then_the_answer(tokenizer, retrieval):
    script = {0: f"<think>who is it</think><search>{PERSON}</search>", 1: f"<search>{CITY}</search>",
              2: f"<think>found it</think><answer>{QUESTION['answer'][0]}</answer>"}
    engine = ScriptedEngine(lambda req, turn: _enc(tokenizer, script[turn]))
    t = asyncio.run(_workflow(tokenizer, retrieval).arun_episode(engine, {**DATA, "sampling_seed": 5}))
    assert (t.reward, t.stop_reason, t.num_turns) == (1.0, "stop", 3)
    assert t.metadata["queries"] == [PERSON, CITY] and t.metadata["prediction"] == QUESTION["answer"][0]
    prompt = chat_prompt_ids(tokenizer, search_prompt(DATA))
    calls = assert_token_invariants(t, engine.calls, prompt)
    client = RetrievalClient(retrieval)
    for (req, resp), (next_req, _), query in zip(calls, calls[1:], [PERSON, CITY]):
        docs = asyncio.run(client.retrieve([query], 2))[0]
        assert docs[0]["title"] == query
        end = len(req.input_ids) + resp.output_len
        assert next_req.input_ids[end:] == _enc(tokenizer, format_information(docs))  # masked: checked above
    for req, _ in calls:
        assert set(STOP_STRINGS) <= set(req.sampling.stop)
    assert len({req.sampling.sampling_seed for req, _ in calls}) == 3
    assert t.messages[-1]["role"] == "assistant" and "<information>Doc 1 (Title: " + PERSON in t.messages[-1]["content"]


def test_partial_answers_and_exact_match(tokenizer, retrieval):
    engine = ScriptedEngine(lambda req, turn: _enc(tokenizer, f"<answer>capital {QUESTION['answer'][0]}</answer>"))
    f1 = asyncio.run(_workflow(tokenizer, retrieval).arun_episode(engine, DATA))
    em = asyncio.run(_workflow(tokenizer, retrieval, reward=exact_match_reward).arun_episode(engine, DATA))
    assert f1.reward == pytest.approx(2 / 3) and em.reward == 0.0
    silent = ScriptedEngine(lambda req, turn: _enc(tokenizer, "I do not know") + [tokenizer.eos_token_id])
    t = asyncio.run(_workflow(tokenizer, retrieval).arun_episode(silent, DATA))
    assert (t.reward, t.stop_reason, t.num_turns, t.metadata["prediction"]) == (0.0, "stop", 1, None)


def test_max_turns_ends_the_episode_without_a_last_retrieval(tokenizer, retrieval):
    engine = ScriptedEngine(lambda req, turn: _enc(tokenizer, f"<search>{PERSON} {turn}</search>"))
    t = asyncio.run(_workflow(tokenizer, retrieval, max_turns=3).arun_episode(engine, DATA))
    assert (t.reward, t.stop_reason, t.num_turns) == (0.0, "max_turns", 3)
    assert t.metadata["queries"] == [f"{PERSON} 0", f"{PERSON} 1", f"{PERSON} 2"]
    assert t.input_ids[-len(_enc(tokenizer, "</search>")):] == _enc(tokenizer, "</search>")  # no results appended
    assert_token_invariants(t, engine.calls, chat_prompt_ids(tokenizer, search_prompt(DATA)))


def test_max_tokens_bounds_the_whole_episode(tokenizer, retrieval):
    prompt = chat_prompt_ids(tokenizer, search_prompt(DATA))
    budget = len(prompt) + 400
    engine = ScriptedEngine(lambda req, turn: _enc(tokenizer, f"<search>{PERSON}</search>"))
    t = asyncio.run(_workflow(tokenizer, retrieval, max_turns=10, max_tokens=budget).arun_episode(engine, DATA))
    assert t.stop_reason == "length" and len(t.input_ids) <= budget and t.num_turns >= 2
    for req, _ in engine.calls:
        assert len(req.input_ids) + req.sampling.max_new_tokens <= budget


def test_a_failing_retrieval_fails_the_episode_and_never_scores_zero(tokenizer, tmp_path, dead_address):
    """A retrieval that fails after its retries is the episode's failure, named (server and cause): the failure
    policy drops the group (or retries it); no row with reward 0 stands in for it."""
    dead = dead_address
    cfg = load_config("configs/search_agent.yaml", [f"output_dir={tmp_path}", "rollout.gconfig.n_samples=2",
                                                    "rollout.agent.retrieval.request_retries=1"])
    workflow = build_workflow(cfg, tokenizer, InlinePool(), tool_addresses={"retrieval": dead})
    engine = ScriptedEngine(lambda req, turn: _enc(tokenizer, f"<search>{PERSON}</search>"))
    with pytest.raises(RetrievalError, match=rf"^retrieval server {dead}: ClientConnectorError") as raised:
        play(workflow, engine, DATA, cfg.rollout.gconfig.n_samples)
    assert (raised.value.address, raised.value.status) == (dead, None)
    assert len(engine.calls) == 2
    policy = FailurePolicy(episode_retries=1, episode_retry_delay=0.01)
    result = asyncio.run(play_group(workflow, engine, DATA, 2, slot=0, policy=policy))
    assert (result.outcome, result.trajectories) == ("dropped", [])
    assert [(f.cause, f.peer, f.retryable, f.sample_idx, f.attempt) for f in result.failures] == [
        ("retrieval", dead, True, 0, 2), ("retrieval", dead, True, 1, 2)]
    assert [(f.cause, f.attempt) for f in result.retried] == [("retrieval", 1), ("retrieval", 1)]
    # two attempts of two episodes, each a first turn (its search) that the dead server failed
    assert len(engine.calls) == 2 + 4


class _ScriptedFirstTurn:
    """The first turn of each episode is a scripted search, with the tiny model's own logprobs for it (so the
    whole trajectory is what the model would score); later turns are generated by the real server."""

    def __init__(self, engine, model, tokens: list[int]):
        self.engine, self.model, self.tokens = engine, model, tokens
        self.seen: set[str] = set()

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        if req.rid in self.seen:
            return await self.engine.agenerate(req)
        self.seen.add(req.rid)
        ids = torch.tensor([req.input_ids + self.tokens])
        with torch.no_grad():
            logp = torch.log_softmax(self.model(ids).logits[0, :-1].float(), -1)
        logp = logp.gather(-1, ids[0, 1:, None])[len(req.input_ids) - 1:, 0].tolist()
        return ModelResponse(input_tokens=list(req.input_ids), output_tokens=list(self.tokens), output_logprobs=logp,
                             output_versions=[0] * len(self.tokens), stop_reason="stop", latency=0.0)

    async def agenerate_group(self, reqs: list[ModelRequest]) -> list[ModelResponse]:
        return [await self.agenerate(req) for req in reqs]


def test_search_episodes_against_a_real_server(cpu_server, tiny_model_dir, tokenizer, retrieval, tmp_path):
    model = load_model(tiny_model_dir)
    cfg = load_config("configs/search_agent.yaml", [f"output_dir={tmp_path}", "rollout.gconfig.n_samples=2",
                                                    "rollout.gconfig.max_new_tokens=16", "rollout.agent.max_turns=3"])
    workflow = build_workflow(cfg, tokenizer, InlinePool(), tool_addresses={"retrieval": retrieval})
    records = [{**DATA, "prompt_id": f"q{i}", "sampling_seed": 11 * i} for i in range(2)]

    async def go(first_turn):
        async with RemoteSGLangEngine([cpu_server]) as real:
            engine = RecordingEngine(_ScriptedFirstTurn(real, model, first_turn) if first_turn else real)
            groups = await asyncio.gather(*(run_group(workflow, engine, r, cfg.rollout.gconfig.n_samples)
                                            for r in records))
        return engine, [t for g in groups for t in g]

    prompt = search_prompt_ids(tokenizer, search_prompt(DATA, cfg.rollout.agent.prompt), cfg.rollout.agent.prompt)
    for first_turn in (None, _enc(tokenizer, f"<search>{PERSON}</search>")):
        engine, trajectories = asyncio.run(go(first_turn))
        assert len(trajectories) == 4
        for t in trajectories:
            calls = assert_token_invariants(t, engine.calls, prompt)
            assert_logprobs_match_model(model, t)
            assert len(t.input_ids) <= cfg.rollout.agent.max_tokens
            assert all(set(STOP_STRINGS) <= set(req.sampling.stop) for req, _ in calls)
            if first_turn:  # the results went in after the scripted search, and the real server went on from there
                assert t.num_turns >= 2 and "<information>Doc 1 (Title: " + PERSON in t.text


def test_rollout_command_with_the_search_agent_config(tiny_model_dir, tmp_path):
    args = [sys.executable, "-m", "cli", "rollout", "--config", "configs/search_agent.yaml",
            f"output_dir={tmp_path}", "run_id=s", "rollout.batch_size=2", "rollout.gconfig.n_samples=2",
            f"model.path={tiny_model_dir}"]  # not the warm start: the protocol is what this checks
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (out,) = list(tmp_path.glob("s/iter_*/rollout"))
    verify_shards(out)
    trajectories = read_trajectories(out)
    assert len(trajectories) == 4 and all(isinstance(t.metadata["answer"], list) for t in trajectories)
    assert json.loads((out / "manifest.json").read_text())["num_rows"] == 4


# ---------------------------------------------------------------------------------------------- tutorial options


class _CutEngine(ScriptedEngine):
    """Generations of at most max_new_tokens of one scripted text: each one cut short is stopped by "length"."""

    def __init__(self, tokenizer, text: str):
        self.ids, self.given = _enc(tokenizer, text), {}
        super().__init__(self._next)

    def _next(self, req, turn):
        start = self.given.get(req.rid, 0)
        out = self.ids[start: start + req.sampling.max_new_tokens]
        self.given[req.rid] = start + len(out)
        self.stop_reason = "length" if start + len(out) < len(self.ids) else "stop"
        return out


def test_a_turn_cut_off_by_length_goes_on_while_the_budget_lasts(tokenizer, retrieval):
    text = f"<think>a long thought</think><search> {PERSON} </search>"
    engine = _CutEngine(tokenizer, text)
    t = asyncio.run(_workflow(tokenizer, retrieval, max_turns=8, max_new_tokens=16).arun_episode(engine, DATA))
    cuts = -(-len(_enc(tokenizer, text)) // 16)
    assert [r["action"] for r in t.metadata["turns"][:cuts]] == [None] * (cuts - 1) + ["search"]
    assert t.metadata["queries"] == [PERSON] and t.metadata["searched"] == 1.0 and t.metadata["num_searches"] == 1
    assert f"{text}\n\n<information>Doc 1 (Title: {PERSON})" in t.text  # the tag spanned the cut generations
    assert_token_invariants(t, engine.calls, chat_prompt_ids(tokenizer, search_prompt(DATA)))
    # no tag ever: the episode ends at max_turns, not at the first cut
    silent = _CutEngine(tokenizer, "no tags at all, and on and on and on")
    t = asyncio.run(_workflow(tokenizer, retrieval, max_turns=3, max_new_tokens=4).arun_episode(silent, DATA))
    assert (t.num_turns, t.stop_reason, t.metadata["searched"]) == (3, "max_turns", 0.0)


def test_cut_off_turns_go_on_against_a_real_server(cpu_server, tiny_model_dir, tokenizer, retrieval, tmp_path):
    cfg = load_config("configs/search_agent.yaml", [
        f"output_dir={tmp_path}", "rollout.gconfig.n_samples=2", "rollout.gconfig.max_new_tokens=4",
        "rollout.agent.max_turns=4"])
    workflow = build_workflow(cfg, tokenizer, InlinePool(), tool_addresses={"retrieval": retrieval})

    async def go():
        async with RemoteSGLangEngine([cpu_server]) as real:
            engine = RecordingEngine(real)
            return engine, await run_group(workflow, engine, {**DATA, "sampling_seed": 3}, cfg.rollout.gconfig.n_samples)

    engine, trajectories = asyncio.run(go())
    prompt = search_prompt_ids(tokenizer, search_prompt(DATA, "question"), "question")
    for t in trajectories:
        assert_token_invariants(t, engine.calls, prompt)
        reasons = [r["stop_reason"] for r in t.metadata["turns"]]
        actions = [r["action"] for r in t.metadata["turns"]]
        # every generation but the last was cut off by length without a tag, and the episode went on after it
        assert all(reason == "length" for reason in reasons[:-1]) and not any(actions[:-1]), t.metadata["turns"]
        assert t.num_turns == 4 or reasons[-1] == "stop" or actions[-1], t.metadata["turns"]


def test_tutorial_prompt_and_information_against_a_real_server(cpu_server, tiny_model_dir, tokenizer, retrieval,
                                                                tmp_path):
    model = load_model(tiny_model_dir)
    cfg = load_config("configs/search_agent.yaml", [  # the model: the suite's tiny one, not the search warm start
        f"output_dir={tmp_path}", f"model.path={tiny_model_dir}", "rollout.gconfig.n_samples=2",
        "rollout.gconfig.max_new_tokens=16", "rollout.agent.prompt=tutorial", "rollout.agent.information=tutorial",
        "rollout.agent.retrieval.topk=1"])  # the tutorial's prompt is ~850 bytes: one result fits the tiny model
    workflow = build_workflow(cfg, tokenizer, InlinePool(), tool_addresses={"retrieval": retrieval})

    async def go():
        # as the pipeline builds it (from_config): the episode's budget reaches the context length, and SGLang (and
        # the project's server) refuse a prompt plus budget that does, so the client cuts the last turn's budget
        async with RemoteSGLangEngine([cpu_server], context_length=cfg.inference.context_length) as real:
            engine = RecordingEngine(_ScriptedFirstTurn(real, model, _enc(tokenizer, f" <search> {CITY} </search>")))
            return engine, await run_group(workflow, engine, DATA, cfg.rollout.gconfig.n_samples)

    engine, trajectories = asyncio.run(go())
    assert len(trajectories) == 2
    prompt = _enc(tokenizer, TUTORIAL_PROMPT.format(question=DATA["question"]))  # raw text: no chat template
    assert tokenizer.decode(prompt).endswith("Assistant:\n<think>") and "<|im_start|>" not in tokenizer.decode(prompt)
    docs = asyncio.run(RetrievalClient(retrieval).retrieve([CITY], 1))[0]
    for t in trajectories:
        calls = assert_token_invariants(t, engine.calls, prompt)
        assert_logprobs_match_model(model, t)
        (req, resp), (next_req, _) = calls[:2]
        end = len(req.input_ids) + resp.output_len
        block = _enc(tokenizer, format_information(docs, "tutorial"))
        assert next_req.input_ids[end: end + len(block)] == block
        assert f'<information>\n<p title="{CITY}">\n"{CITY}"\n{CITY} is' in t.text
        assert t.messages[0]["content"] == TUTORIAL_PROMPT.format(question=DATA["question"])


def test_a_running_retrieval_server_is_used_not_started(tokenizer, retrieval, tmp_path, dead_address):
    """rollout.agent.retrieval.address: start_tools starts nothing, checks the server answers, and the workflow
    retrieves there; an address where nothing answers fails at start with the key and the address."""
    cfg = load_config("configs/search_agent.yaml", [f"output_dir={tmp_path}",
                                                    f"rollout.agent.retrieval.address={retrieval}"])
    services = Services(cfg, "unused", tmp_path / "logs")
    try:
        assert services.start_tools() == {} and services.tools == {}
    finally:
        services.stop()
    assert not (tmp_path / "logs" / "retrieval-server.log").exists()
    workflow = build_workflow(cfg, tokenizer, InlinePool())
    assert workflow.retrieval.address == retrieval
    engine = ScriptedEngine(lambda req, turn: _enc(tokenizer, [f"<search>{PERSON}</search>",
                                                               f"<answer>{CITY}</answer>"][turn]))
    trajectories = play(workflow, engine, DATA, cfg.rollout.gconfig.n_samples)
    assert len(trajectories) == cfg.rollout.gconfig.n_samples
    assert all(f"Doc 1 (Title: {PERSON})" in t.text for t in trajectories)

    dead = dead_address
    services = Services(load_config("configs/search_agent.yaml", [
        f"output_dir={tmp_path}", f"rollout.agent.retrieval.address={dead}"]), "unused", tmp_path / "logs")
    with pytest.raises(RetrievalError, match=f"rollout.agent.retrieval.address={dead}: no retrieval server answers"):
        services.start_tools()
    services.stop()
    check_retrieval_server(retrieval)
