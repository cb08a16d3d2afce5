"""The CPU server's OpenAI API (/v1/chat/completions, /v1/completions, /v1/models) through the real `openai` SDK,
against real server subprocesses on loopback; the chat template's tool rendering and the tool-call parser."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
import urllib.error

import openai
import pytest
import torch
from safetensors.torch import load_file, save_file

from _openai_helpers import CALCULATOR, QUESTION, QWEN25_CHAT_TEMPLATE, taught_model
from areal_pipeline import auth
from areal_pipeline.inference.openai_requests import parse_messages
from areal_pipeline.inference.openai_tools import chat_prompt_ids, parse_tool_calls, qwen_tool_messages, renders_tools
from areal_pipeline.model import load_tokenizer
from conftest import http, start_cpu_server

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]


def client(address: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://{address}/v1", api_key=auth.run_token(), max_retries=0)


def run(coroutine):
    return asyncio.run(coroutine)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def test_models_and_a_chat_completion(cpu_server, tiny_model_dir, tokenizer):
    async def go():
        async with client(cpu_server) as c:
            return (await c.models.list()).data, await c.chat.completions.create(
                model="anything", messages=MESSAGES, max_tokens=5, seed=1)

    models, reply = run(go())
    assert [m.id for m in models] == [str(tiny_model_dir)] and models[0].max_model_len == 1024
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-") and reply.model == "anything"
    (choice,) = reply.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.logprobs is None
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.message.tool_calls is None
    prompt = chat_prompt_ids(tokenizer, parse_messages(MESSAGES))
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt), 5)
    assert reply.usage.total_tokens == len(prompt) + 5


def test_n_samples_are_seeded_and_their_logprobs_are_the_native_generates(cpu_server, tokenizer):
    """n=3 samples with seed s are the native /generate's samples with sampling_seed s, s+1, s+2 of the templated
    prompt: the same text and the same logprobs."""
    async def go():
        async with client(cpu_server) as c:
            return [await c.chat.completions.create(model="m", messages=MESSAGES, n=3, seed=11, max_tokens=6,
                                                    logprobs=True) for _ in range(2)]

    first, again = run(go())
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    assert len({c.message.content for c in first.choices}) == 3
    assert first.usage.completion_tokens == 18
    prompt = chat_prompt_ids(tokenizer, parse_messages(MESSAGES))
    for i, choice in enumerate(first.choices):
        status, native = http(cpu_server, "/generate", {
            "input_ids": prompt, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 6, "sampling_seed": 11 + i}})
        assert status == 200
        assert choice.message.content == tokenizer.decode(native["output_ids"], skip_special_tokens=True)
        tokens = choice.logprobs.content
        assert [t.token for t in tokens] == [tokenizer.decode([i]) for i in native["output_ids"]]
        native_logprobs = [entry[0] for entry in native["meta_info"]["output_token_logprobs"]]
        assert [t.logprob for t in tokens] == pytest.approx(native_logprobs, abs=1e-6)
        assert all(t.bytes == list(t.token.encode()) and t.top_logprobs == [] for t in tokens)


def _first_new_printable(text: str) -> int:
    """Where a printable ASCII character first shows in `text` (past its start): a stop string for the test."""
    return next(k for k in range(1, len(text))
                if text[k].isascii() and text[k].isprintable() and text[k] not in text[:k])


def test_a_stop_string_cuts_the_reply(cpu_server):
    """A seeded sample again with one of its characters as a stop string: the reply ends just before it."""
    async def go():
        async with client(cpu_server) as c:
            whole = await c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=16, seed=5)
            text = whole.choices[0].message.content
            at = _first_new_printable(text)
            cut = await c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=16, seed=5,
                                                  stop=[text[at], "never-generated"])
            completion = await c.completions.create(model="m", prompt="What is 2+3?", max_tokens=16, seed=5)
            plain = completion.choices[0].text
            at_text = _first_new_printable(plain)
            cut_completion = await c.completions.create(model="m", prompt="What is 2+3?", max_tokens=16, seed=5,
                                                        stop=plain[at_text])
            return text, at, cut, plain, at_text, cut_completion

    text, at, cut, plain, at_text, cut_completion = run(go())
    assert cut.choices[0].message.content == text[:at] and cut.choices[0].finish_reason == "stop"
    assert cut_completion.choices[0].text == plain[:at_text] and cut_completion.choices[0].finish_reason == "stop"


def test_completions_take_texts_and_token_ids_in_a_batch(cpu_server, tokenizer):
    ids = [258, 117, 115, 101, 114, 10, 51]

    async def go():
        async with client(cpu_server) as c:
            # seeded: unseeded, the random tiny model may draw its end-of-text token before the 16th token
            default = await c.completions.create(model="m", prompt="hello", seed=0)
            batch = await c.completions.create(model="m", prompt=[ids, "What is"], n=2, max_tokens=3, logprobs=0,
                                               seed=4)
            return default, batch

    default, batch = run(go())
    assert default.object == "text_completion" and default.usage.completion_tokens == 16  # OpenAI's default
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.usage.prompt_tokens == len(ids) + len(tokenizer.encode("What is"))
    assert batch.usage.completion_tokens == 12
    for choice in batch.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == 3 and all(x <= 0 for x in lp.token_logprobs)
        assert lp.text_offset == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]


@pytest.mark.parametrize("request_fields, param, says", [
    ({"temperature": 5}, "temperature", "must be in [0, 2]"),
    ({"stream": True}, "stream", "stream=true is not supported"),
    ({"logprobs": True, "top_logprobs": 3}, "top_logprobs", "top_logprobs > 0 is not supported"),
    ({"tools": [CALCULATOR], "tool_choice": "required"}, "tool_choice", "use 'auto' or 'none'"),
    ({"n": 0}, "n", "'n' must be an integer in [1, 128]"),
    ({"frequency_penalty": 0.5}, "frequency_penalty", "is not supported"),
    ({"response_format": {"type": "json_object"}}, "response_format", "is not supported"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "must be one of"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content", "the model reads text only"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "is not valid JSON"),
    ({"extra_body": {"bogus": 1}}, "bogus", "unknown field(s) ['bogus']"),
    ({"max_tokens": 5000}, None, "maximum context length of 1024 tokens"),
])
def test_bad_requests_are_400_in_openai_error_shape(cpu_server, request_fields, param, says):
    fields = {"model": "m", "messages": MESSAGES, "max_tokens": 4, **request_fields}

    async def go():
        async with client(cpu_server) as c:
            return await c.chat.completions.create(**fields)

    with pytest.raises(openai.BadRequestError) as refused:
        run(go())
    error = refused.value
    assert error.status_code == 400 and says in error.message
    assert error.body["type"] == "invalid_request_error" and error.body["param"] == param
    if "context length" in says:
        assert error.code == "context_length_exceeded"


def test_malformed_bodies_and_completions_fields_are_400_too(cpu_server):
    request = auth.request(cpu_server, "/v1/chat/completions", data=b"{not json",
                           headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        auth.opener().open(request, timeout=60)
    body = json.loads(refused.value.read())
    assert refused.value.code == 400 and body["error"]["type"] == "invalid_request_error"
    assert "not valid JSON" in body["error"]["message"]
    status, body = http(cpu_server, "/v1/chat/completions", [1, 2])
    assert status == 400 and "must be a JSON object" in body["error"]["message"]
    for fields, says in [({"logprobs": 2}, "logprobs > 0"), ({"echo": True}, "echo=true"),
                         ({"prompt": []}, "'prompt' must be"), ({"model": ""}, "'model' must be a non-empty string")]:
        status, body = http(cpu_server, "/v1/completions", {"model": "m", "prompt": "hi", **fields})
        assert status == 400 and says in body["error"]["message"], body


def test_tools_are_written_as_qwen25_writes_them(tiny_model_dir, tokenizer):
    """The embedded model's template renders no tools: the tool list, the calls and the results are written in
    Qwen2.5's tool format, exactly as Qwen2.5's own template renders the same conversation (given a system message:
    Qwen2.5's default one is not added); a template that renders tools gets them as they are."""
    qwen = load_tokenizer(tiny_model_dir)
    qwen.chat_template = QWEN25_CHAT_TEMPLATE
    assert not renders_tools(tokenizer) and renders_tools(qwen)
    conversation = parse_messages(MESSAGES + [
        {"role": "assistant", "content": "Let me compute.", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'}},
            {"id": "b", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "3+2"}'}}]},
        {"role": "tool", "tool_call_id": "a", "content": "5"},
        {"role": "tool", "tool_call_id": "b", "content": "5"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "5"}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "5"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "And 2+4?"}])
    for tools in ([CALCULATOR], None):
        ours = tokenizer.decode(chat_prompt_ids(tokenizer, conversation, tools))
        assert ours == qwen.decode(chat_prompt_ids(qwen, conversation, tools))
    rendered = tokenizer.decode(chat_prompt_ids(tokenizer, conversation, [CALCULATOR]))
    assert rendered.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions")
    assert json.dumps(CALCULATOR) in rendered
    assert ('<|im_start|>assistant\nLet me compute.\n<tool_call>\n{"name": "calculator", "arguments": '
            '{"expression": "2+3"}}\n</tool_call>\n<tool_call>') in rendered
    assert "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n5\n</tool_response><|im_end|>" \
        in rendered
    # without a system message no default one is invented (Qwen3's way); without tools nothing changes
    assert qwen_tool_messages(parse_messages(QUESTION), [CALCULATOR])[0]["content"].startswith("# Tools\n")
    assert qwen_tool_messages(parse_messages(MESSAGES), None) == MESSAGES


def test_tool_calls_are_parsed_from_qwen_blocks():
    names = {"calculator", "search"}
    content, calls = parse_tool_calls(
        'Sure.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>\n'
        '<tool_call>{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}</tool_call>', names)
    assert content == "Sure."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("calculator", {"expression": "6*7"}), ("search", {"q": "x"})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    # only the first with parallel_tool_calls=false; "parameters" as some models write it
    content, calls = parse_tool_calls('<tool_call>{"name": "search", "parameters": {"q": 1}}</tool_call>'
                                      '<tool_call>{"name": "search", "arguments": {}}</tool_call>', names, True)
    assert len(calls) == 1 and json.loads(calls[0]["function"]["arguments"]) == {"q": 1}
    assert content == '<tool_call>{"name": "search", "arguments": {}}</tool_call>'
    # not calls: broken JSON, an undeclared tool, arguments that are no object, a block cut off: text as it was
    for text in ['<tool_call>{"name": "calculator", "arguments": {</tool_call>',
                 '<tool_call>{"name": "rm", "arguments": {}}</tool_call>',
                 '<tool_call>{"name": "search", "arguments": [1]}</tool_call>',
                 'Hmm <tool_call>\n{"name": "calculator", "argu']:
        assert parse_tool_calls(text, names) == (text, [])
    assert parse_tool_calls('<tool_call>{"name": "search", "arguments": {}}</tool_call>', names)[0] is None


@pytest.fixture(scope="module")
def taught_server(tmp_path_factory):
    model = taught_model(tmp_path_factory)
    server = start_cpu_server(model, tmp_path_factory.mktemp("taught-logs"))
    yield server.address
    server.stop()


def test_a_model_that_calls_a_tool_gets_tool_calls_back(taught_server):
    async def go():
        async with client(taught_server) as c:
            called = await c.chat.completions.create(model="m", messages=QUESTION, tools=[CALCULATOR],
                                                     temperature=0, max_tokens=100)
            unparsed = await c.chat.completions.create(model="m", messages=QUESTION, tools=[CALCULATOR],
                                                       tool_choice="none", temperature=0, max_tokens=8)
            return called, unparsed

    called, unparsed = run(go())
    (choice,) = called.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": "6*7"}
    assert unparsed.choices[0].message.tool_calls is None  # tool_choice none: no tools rendered, none parsed


@pytest.fixture
def own_server(tiny_model_dir, tmp_path):
    server = start_cpu_server(tiny_model_dir, tmp_path)
    yield server.address
    server.stop()


def perturbed_copy(model_dir, out):
    shutil.copytree(model_dir, out)
    weights = out / "model.safetensors"
    state = load_file(weights)
    save_file({k: v + 0.05 * torch.randn_like(v) for k, v in state.items()}, weights)
    return out


def test_a_reply_interrupted_by_a_weight_update_is_whole(own_server, tiny_model_dir, tmp_path):
    """A pause for a weight update aborts the running generation; the route sends it again with its tokens so far
    once generation continues, so the client gets the whole reply (generated partly by the new weights)."""
    from areal_pipeline.inference.client import RemoteSGLangEngine

    new_weights = perturbed_copy(tiny_model_dir, tmp_path / "v1")

    async def go():
        async with client(own_server) as c, RemoteSGLangEngine([own_server]) as trainer:
            reply = asyncio.create_task(c.chat.completions.create(
                model="m", messages=MESSAGES, extra_body={"ignore_eos": True}, seed=3))
            deadline = time.monotonic() + 60
            while (await trainer.get_server_info())["internal_states"][0]["generated_tokens"] < 100:
                assert time.monotonic() < deadline, "the generation never started"
                await asyncio.sleep(0.01)
            await trainer.pause()
            await asyncio.sleep(0.3)
            assert not reply.done()
            await trainer.update_weights_from_disk(str(new_weights), version=1)
            await trainer.resume()
            return await asyncio.wait_for(reply, 120), (await trainer.get_model_info())["weight_version"]

    reply, version = run(go())
    prompt_tokens = reply.usage.prompt_tokens
    assert version == "1"
    # up to the context's end, as SGLang takes it: prompt + completion below the context length
    assert reply.usage.completion_tokens == 1024 - 1 - prompt_tokens and reply.choices[0].finish_reason == "length"
