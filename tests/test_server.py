"""The CPU inference server against SGLang's protocol, as a real subprocess on loopback."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import save_file

from conftest import http, start_cpu_server

PROMPT = [258, 117, 115, 101, 114, 10, 51, 43, 52, 61]


def generate(address, **body):
    body.setdefault("input_ids", PROMPT)
    return http(address, "/generate", body)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from areal_pipeline.model import load_model

    return load_model(tiny_model_dir)


def teacher_forced_logprobs(model, prompt, output, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    t = 1.0 if temperature < 1e-6 else temperature
    lp = torch.log_softmax(logits[len(prompt) - 1:-1] / t, dim=-1)
    return lp.gather(-1, torch.tensor(output)[:, None]).squeeze(-1)


def test_generate_reply_shape(cpu_server):
    status, reply = generate(cpu_server, sampling_params={"max_new_tokens": 7, "temperature": 1.0},
                             return_logprob=True, rid="shape-1")
    assert status == 200
    meta = reply["meta_info"]
    assert len(reply["output_ids"]) == meta["completion_tokens"] == 7
    assert meta["prompt_tokens"] == len(PROMPT) and meta["cached_tokens"] == 0
    assert meta["id"] == "shape-1"
    assert meta["finish_reason"] == {"type": "length", "length": 7}
    assert meta["weight_version"] == "0"
    assert meta["input_token_logprobs"] == []
    assert [e[1] for e in meta["output_token_logprobs"]] == reply["output_ids"]
    assert all(e[0] <= 0 and e[2] is None for e in meta["output_token_logprobs"])
    assert isinstance(reply["text"], str) and meta["e2e_latency"] > 0
    # without return_logprob, no logprob lists
    status, reply = generate(cpu_server, sampling_params={"max_new_tokens": 2})
    assert status == 200 and "output_token_logprobs" not in reply["meta_info"]


def test_batch_and_text_inputs(cpu_server):
    prompts = [[1, 2, 3], [70, 71], list(range(30, 60))]
    status, replies = generate(cpu_server, input_ids=prompts, return_logprob=True,
                               sampling_params={"max_new_tokens": 3, "temperature": 0})
    assert status == 200 and isinstance(replies, list) and len(replies) == 3
    assert [r["meta_info"]["prompt_tokens"] for r in replies] == [3, 2, 30]
    status, reply = generate(cpu_server, input_ids=None, text="hello", sampling_params={"max_new_tokens": 2})
    assert status == 200 and reply["meta_info"]["prompt_tokens"] == 5
    status, replies = generate(cpu_server, input_ids=None, text=["a", "bc"], sampling_params={"max_new_tokens": 2})
    assert [r["meta_info"]["prompt_tokens"] for r in replies] == [1, 2]


def test_batch_with_sampling_params_per_prompt(cpu_server):
    """SGLang's batch form with one sampling_params dict per prompt: each prompt samples as it would alone."""
    prompt = [5, 6, 7, 8]
    per_prompt = [{"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 1234, "ignore_eos": True},
                  {"max_new_tokens": 3, "temperature": 1.0, "sampling_seed": 99, "ignore_eos": True}]
    status, replies = generate(cpu_server, input_ids=[prompt, prompt], sampling_params=per_prompt, rid=["a", "b"])
    assert status == 200
    alone = [generate(cpu_server, input_ids=prompt, sampling_params=p)[1]["output_ids"] for p in per_prompt]
    assert [r["output_ids"] for r in replies] == alone
    assert [len(r["output_ids"]) for r in replies] == [6, 3] and alone[0][:3] != alone[1]


def test_a_prompt_shared_by_a_batch_is_prefilled_once(cpu_server, model):
    """A GRPO group in SGLang's batch form: the prompt's KV cache is computed once and reused by every copy
    (reported as cached tokens, as SGLang's radix cache does), and each copy samples, and scores its tokens,
    exactly as it would alone."""
    prompt = list(range(60, 90))
    params = [{"max_new_tokens": 5, "temperature": 1.0, "sampling_seed": seed, "ignore_eos": True}
              for seed in (1, 2, 3, 1)]
    before = http(cpu_server, "/get_server_info")[1]["internal_states"][0]["prefill_tokens"]
    status, replies = generate(cpu_server, input_ids=[prompt] * 4, sampling_params=params, return_logprob=True,
                               logprob_start_len=0)
    assert status == 200
    after = http(cpu_server, "/get_server_info")[1]["internal_states"][0]["prefill_tokens"]
    assert after - before == len(prompt)
    assert [r["meta_info"]["cached_tokens"] for r in replies] == [0, len(prompt), len(prompt), len(prompt)]
    alone = [generate(cpu_server, input_ids=prompt, sampling_params=p)[1]["output_ids"] for p in params]
    assert [r["output_ids"] for r in replies] == alone
    assert replies[0]["output_ids"] == replies[3]["output_ids"] != replies[1]["output_ids"]
    for reply in replies:
        served = torch.tensor([e[0] for e in reply["meta_info"]["output_token_logprobs"]])
        assert torch.allclose(served, teacher_forced_logprobs(model, prompt, reply["output_ids"], 1.0), atol=1e-4)
        assert [e[1] for e in reply["meta_info"]["input_token_logprobs"]] == prompt
    assert all(r["meta_info"]["input_token_logprobs"] == replies[0]["meta_info"]["input_token_logprobs"]
               for r in replies)


def test_greedy_is_deterministic_and_top_k_1_is_greedy(cpu_server):
    params = {"max_new_tokens": 12, "temperature": 0.0}
    a = generate(cpu_server, sampling_params=params)[1]["output_ids"]
    b = generate(cpu_server, sampling_params=params)[1]["output_ids"]
    c = generate(cpu_server, sampling_params={"max_new_tokens": 12, "temperature": 1.0, "top_k": 1})[1]["output_ids"]
    assert a == b == c


def test_sampling_seed_reproduces(cpu_server):
    params = {"max_new_tokens": 16, "temperature": 1.0, "sampling_seed": 1234}
    a = generate(cpu_server, sampling_params=params)[1]["output_ids"]
    b = generate(cpu_server, sampling_params=params)[1]["output_ids"]
    c = generate(cpu_server, sampling_params={**params, "sampling_seed": 99})[1]["output_ids"]
    assert a == b and a != c


def test_stop_token_ids_and_stop_strings(cpu_server):
    greedy = {"max_new_tokens": 20, "temperature": 0.0, "skip_special_tokens": False}
    status, full = generate(cpu_server, sampling_params=greedy)
    ids = full["output_ids"]
    stop_id = ids[5]
    first = ids.index(stop_id)
    status, reply = generate(cpu_server, sampling_params={**greedy, "stop_token_ids": [stop_id]})
    assert reply["output_ids"] == ids[: first + 1]
    assert reply["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}

    text = full["text"]
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2) if text[i:i + 2].isprintable()
                and "\ufffd" not in text[i:i + 2])
    status, reply = generate(cpu_server, sampling_params={**greedy, "stop": stop})
    assert reply["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert reply["text"] == text[: text.index(stop)]  # the matched stop string is trimmed from text
    assert len(reply["output_ids"]) < len(ids)


def test_logprobs_match_teacher_forced_forward(cpu_server, model):
    """Concurrent requests of different lengths, temperatures and top-p join the batch at different steps."""
    rng = random.Random(0)

    def one(i):
        time.sleep(rng.random() * 0.2)
        prompt = [rng.randrange(0, 256) for _ in range(rng.randrange(1, 50))]
        temperature = [1.0, 0.7, 1.3, 0.0][i % 4]
        status, reply = generate(cpu_server, input_ids=prompt, return_logprob=True,
                                 sampling_params={"max_new_tokens": rng.randrange(1, 40), "temperature": temperature,
                                                  "top_p": [1.0, 0.8][i % 2]})
        assert status == 200
        return prompt, temperature, reply

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(32)))
    for prompt, temperature, reply in results:
        served = torch.tensor([e[0] for e in reply["meta_info"]["output_token_logprobs"]])
        expected = teacher_forced_logprobs(model, prompt, reply["output_ids"], temperature)
        assert torch.allclose(served, expected, atol=1e-4), (served - expected).abs().max()


def test_input_token_logprobs(cpu_server, model):
    prompt = list(range(40, 60))
    status, reply = generate(cpu_server, input_ids=prompt, return_logprob=True, logprob_start_len=0,
                             sampling_params={"max_new_tokens": 1, "temperature": 0.5})
    entries = reply["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == prompt and entries[0][0] is None
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    expected = torch.log_softmax(logits[:-1] / 0.5, -1).gather(-1, torch.tensor(prompt[1:])[:, None]).squeeze(-1)
    assert torch.allclose(torch.tensor([e[0] for e in entries[1:]]), expected, atol=1e-4)


@pytest.mark.parametrize("body, fragment", [
    ({"sampling_params": {"max_new_tokens": 2}}, "exactly one of input_ids or text"),
    ({"input_ids": [], "sampling_params": {}}, "input_ids"),
    ({"input_ids": [1, 100000]}, "input_ids must be integers"),
    ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "temperature"),
    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
    ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "top_k"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": -3}}, "max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"max_tokens": 3}}, "unknown field 'max_tokens'"),
    ({"input_ids": [1], "sampling_params": {"n": 2}}, "not supported"),
    ({"input_ids": [1], "bogus": True}, "unknown field"),
    ({"input_ids": [[1], [2]], "sampling_params": [{"max_new_tokens": 1}]}, "one entry per prompt"),
    ({"input_ids": [1], "sampling_params": [{"max_new_tokens": 1}]}, "one entry per prompt"),
    ({"input_ids": list(range(200)) * 6, "sampling_params": {"max_new_tokens": 8}}, "maximum context length"),
])
def test_invalid_requests_get_400_and_server_keeps_serving(cpu_server, body, fragment):
    status, reply = http(cpu_server, "/generate", body)
    assert status == 400
    assert fragment in reply["error"]["message"]
    assert generate(cpu_server, sampling_params={"max_new_tokens": 1})[0] == 200


def test_malformed_json_body(cpu_server):
    import urllib.request

    req = urllib.request.Request(f"http://{cpu_server}/generate", data=b"{not json", method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 400


def test_health_info_and_flush(cpu_server, tiny_model_dir):
    assert http(cpu_server, "/health")[0] == 200
    assert http(cpu_server, "/health_generate")[0] == 200
    for path in ("/get_model_info", "/model_info"):
        status, info = http(cpu_server, path)
        assert status == 200 and info["model_path"] == str(tiny_model_dir) and info["is_generation"] is True
        assert info["weight_version"] == "0"
    status, info = http(cpu_server, "/get_server_info")
    assert status == 200 and info["port"] == int(cpu_server.split(":")[1]) and "version" in info
    assert {"decode_steps", "peak_running_requests"} <= set(info["internal_states"][0])
    assert http(cpu_server, "/flush_cache", method="POST")[0] == 200
    assert http(cpu_server, "/flush_cache")[0] == 200


def test_64_concurrent_requests_are_batched(cpu_server):
    status, before = http(cpu_server, "/get_server_info")
    steps_before = before["internal_states"][0]["decode_steps"]

    def one(i):
        return generate(cpu_server, input_ids=[i % 256] * (5 + i % 13), return_logprob=True,
                        sampling_params={"max_new_tokens": 32, "ignore_eos": True})

    with ThreadPoolExecutor(64) as pool:
        replies = list(pool.map(one, range(64)))
    assert all(status == 200 and len(r["output_ids"]) == 32 for status, r in replies)
    state = http(cpu_server, "/get_server_info")[1]["internal_states"][0]
    # 64 x 32 tokens one at a time would take 64 x 31 decode steps; batched they share steps.
    assert state["decode_steps"] - steps_before < 64 * 31 / 8
    assert state["peak_running_requests"] >= 32


@pytest.fixture()
def own_server(tiny_model_dir, tmp_path):
    """A server of the test's own, for tests that pause it or change its weights."""
    server = start_cpu_server(tiny_model_dir, tmp_path)
    yield server.address
    server.stop()


def _in_thread(fn):
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("result", fn()))
    thread.start()
    return thread, box


def _wait_for_running(address, n=1, timeout=30):
    deadline = time.monotonic() + timeout
    while http(address, "/get_server_info")[1]["internal_states"][0]["running_requests"] < n:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_pause_returns_partial_output_and_holds_new_requests(own_server):
    long = {"max_new_tokens": 900, "ignore_eos": True}
    thread, box = _in_thread(lambda: generate(own_server, return_logprob=True, sampling_params=long))
    _wait_for_running(own_server)
    time.sleep(0.3)
    status, reply = http(own_server, "/pause_generation", {"mode": "abort"})
    assert status == 200 and reply["status"] == "ok"
    thread.join(30)
    status, partial = box["result"]
    meta = partial["meta_info"]
    assert status == 200 and meta["finish_reason"]["type"] == "abort"
    assert 0 < len(partial["output_ids"]) < 900
    assert len(meta["output_token_logprobs"]) == len(partial["output_ids"]) == meta["completion_tokens"]

    # a request sent while paused waits for /continue_generation
    waiting, waiting_box = _in_thread(lambda: generate(own_server, sampling_params={"max_new_tokens": 3}))
    waiting.join(1.0)
    assert waiting.is_alive()
    assert http(own_server, "/continue_generation", {})[0] == 200
    waiting.join(30)
    assert waiting_box["result"][0] == 200 and len(waiting_box["result"][1]["output_ids"]) == 3


def test_abort_request_by_rid(own_server):
    thread, box = _in_thread(lambda: generate(own_server, rid="victim",
                                              sampling_params={"max_new_tokens": 900, "ignore_eos": True}))
    _wait_for_running(own_server)
    assert http(own_server, "/abort_request", {"rid": "victim"})[0] == 200
    thread.join(30)
    status, reply = box["result"]
    assert status == 200 and reply["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(reply["output_ids"]) < 900


def test_update_weights_from_disk(own_server, tiny_model_dir, tmp_path, model):
    from safetensors.torch import load_file

    state = load_file(str(tiny_model_dir / "model.safetensors"))
    torch.manual_seed(0)
    perturbed = {k: v + 0.05 * torch.randn_like(v) for k, v in state.items()}
    new_dir = tmp_path / "step_1"
    new_dir.mkdir()
    save_file(perturbed, str(new_dir / "model.safetensors"))

    status, reply = http(own_server, "/update_weights_from_disk", {"model_path": str(new_dir), "weight_version": "1"})
    assert status == 200 and reply["success"] is True and reply["num_paused_requests"] == 0
    assert http(own_server, "/get_model_info")[1]["weight_version"] == "1"
    name = "model.embed_tokens.weight"
    status, head = http(own_server, "/get_weights_by_name", {"name": name, "truncate_size": 10})
    assert torch.allclose(torch.tensor(head), perturbed[name].flatten()[:10])

    # the server now samples from the new weights: its logprobs match a forward pass of them
    status, reply = generate(own_server, return_logprob=True, sampling_params={"max_new_tokens": 16})
    assert reply["meta_info"]["weight_version"] == "1"
    model.load_state_dict(perturbed, strict=False)
    try:
        served = torch.tensor([e[0] for e in reply["meta_info"]["output_token_logprobs"]])
        expected = teacher_forced_logprobs(model, PROMPT, reply["output_ids"], 1.0)
        assert torch.allclose(served, expected, atol=1e-4)
    finally:
        model.load_state_dict(state, strict=False)

    # a version is bumped when none is given; bad paths fail cleanly and leave the server serving
    assert http(own_server, "/update_weights_from_disk", {"model_path": str(new_dir)})[1]["weight_version"] == "2"
    status, reply = http(own_server, "/update_weights_from_disk", {"model_path": str(tmp_path / "missing")})
    assert status == 400 and reply["success"] is False and "no safetensors" in reply["message"]
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file({"not.a.weight": torch.zeros(2)}, str(bad / "model.safetensors"))
    status, reply = http(own_server, "/update_weights_from_disk", {"model_path": str(bad)})
    assert status == 400 and "does not have" in reply["message"]
    assert http(own_server, "/get_model_info")[1]["weight_version"] == "2"
    assert generate(own_server, sampling_params={"max_new_tokens": 2})[0] == 200
