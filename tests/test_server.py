"""The CPU inference server against SGLang's protocol, as a real subprocess on loopback."""

from __future__ import annotations

import json
import math
import random
import sys
import threading
import time
import urllib.error
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from areal_pipeline import auth
from areal_pipeline.processes import ServerLaunchError, ServerProcess
from areal_pipeline.utils import find_free_port
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
    # ignore_eos: a sampled EOS would end the reply early, and whether one is sampled depends on the shared server's
    # earlier requests
    status, reply = generate(cpu_server, sampling_params={"max_new_tokens": 7, "temperature": 1.0, "ignore_eos": True},
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
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 10 ** 30}}, "maximum context length"),
    ({"input_ids": None, "text": "a" * 2000}, "maximum context length"),
    # NaN, infinite and out-of-range sampling values (json.dumps writes NaN and Infinity as Python reads them)
    ({"input_ids": [1], "sampling_params": {"temperature": float("nan")}}, "'temperature' must be a finite number"),
    ({"input_ids": [1], "sampling_params": {"temperature": float("inf")}}, "'temperature' must be a finite number"),
    ({"input_ids": [1], "sampling_params": {"temperature": 10 ** 400}}, "'temperature' must be a finite number"),
    ({"input_ids": [1], "sampling_params": {"top_p": float("nan")}}, "'top_p' must be a finite number"),
    ({"input_ids": [1], "sampling_params": {"top_p": 1.5}}, "'top_p' must be in (0, 1]"),
    ({"input_ids": [1], "sampling_params": {"min_p": float("-inf")}}, "'min_p' must be a finite number"),
    ({"input_ids": [1], "sampling_params": {"min_p": 2}}, "'min_p' must be in [0, 1]"),
    ({"input_ids": [1], "sampling_params": {"top_k": -2}}, "'top_k' must be -1"),
    ({"input_ids": [1], "sampling_params": {"sampling_seed": 2 ** 70}}, "'sampling_seed' must be an integer in"),
    ({"input_ids": [1], "sampling_params": {"frequency_penalty": float("nan")}}, "not supported"),
    # wrong-typed fields
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": "8"}}, "'max_new_tokens' must be an integer >= 0"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 1.5}}, "'max_new_tokens' must be an integer"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": True}}, "'max_new_tokens' must be an integer"),
    ({"input_ids": [1], "sampling_params": {"temperature": "0.5"}}, "'temperature' must be a finite number"),
    ({"input_ids": [1], "sampling_params": {"top_k": 2.5}}, "'top_k' must be -1"),
    ({"input_ids": [1], "sampling_params": {"stop": 5}}, "'stop' must be a non-empty string"),
    ({"input_ids": [1], "sampling_params": {"stop": [["x"]]}}, "'stop' must be a non-empty string"),
    ({"input_ids": [1], "sampling_params": {"stop_token_ids": 5}}, "'stop_token_ids' must be a list of integers"),
    ({"input_ids": [1], "sampling_params": {"ignore_eos": "yes"}}, "'ignore_eos' must be true or false"),
    ({"input_ids": [1], "sampling_params": {"sampling_seed": "1"}}, "'sampling_seed' must be an integer"),
    ({"input_ids": [1], "sampling_params": "greedy"}, "sampling_params must be a JSON object"),
    ({"input_ids": [[1], [2]], "sampling_params": [{"max_new_tokens": 1}, 7]}, "sampling_params must be a JSON object"),
    ({"input_ids": [1], "return_logprob": "yes"}, "'return_logprob' must be true or false"),
    ({"input_ids": [1], "logprob_start_len": "0"}, "'logprob_start_len' must be an integer >= -1"),
    ({"input_ids": [1], "logprob_start_len": -5}, "'logprob_start_len' must be an integer >= -1"),
    ({"input_ids": [1], "stream": "no"}, "'stream' must be true or false"),
    ({"input_ids": [1], "rid": {"id": 1}}, "'rid' must be a string"),
    ({"input_ids": [[1], 2]}, "input_ids as a batch must be a list of lists"),
    ({"input_ids": [True, 2]}, "input_ids must be integers"),
    ({"input_ids": [1.0]}, "input_ids must be integers"),
    ({"input_ids": {"0": 1}}, "input_ids must be a non-empty list"),
    ({"input_ids": None, "text": 5}, "text must be a string"),
    ({"input_ids": None, "text": []}, "text must be a string or a non-empty list"),
])
def test_invalid_requests_get_400_and_server_keeps_serving(cpu_server, body, fragment):
    status, reply = http(cpu_server, "/generate", body)
    assert status == 400, reply
    assert fragment in reply["error"]["message"]
    assert generate(cpu_server, sampling_params={"max_new_tokens": 1})[0] == 200


@pytest.mark.parametrize("path, body, fragment", [
    ("/get_weights_by_name", {"name": 5}, "'name' must be a string"),
    ("/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": "ten"}, "'truncate_size' must be"),
    ("/abort_request", {"rid": ["a"]}, "'rid' must be a string"),
    ("/abort_request", {"abort_all": "yes"}, "'abort_all' must be true or false"),
    ("/pause_generation", {"mode": ["abort"]}, "is not supported"),
    ("/update_weights_from_disk", {"model_path": 5}, "'model_path' must be a string"),
    ("/update_weights_from_disk", {"model_path": "/x", "weight_version": [1]}, "'weight_version' must be a string"),
    ("/update_weights_from_disk", {"model_path": "/x", "abort_all_requests": "no"}, "'abort_all_requests' must be"),
    ("/destroy_weights_update_group", {"group_name": ["g"]}, "'group_name' must be a string"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": "x", "rank_offset": 1,
                                    "world_size": 2}, "'master_port' must be an integer in [1, 65535]"),
])
def test_control_endpoints_reject_wrong_types_with_400(cpu_server, path, body, fragment):
    status, reply = http(cpu_server, path, body)
    assert status == 400 and fragment in reply["error"]["message"], reply
    assert http(cpu_server, "/health")[0] == 200


def post_raw(address: str, path: str, data: bytes, content_type: str | None) -> tuple[int, dict]:
    """(status, JSON reply) of a POST with exactly this body and Content-Type (None: urllib's form default)."""
    headers = {} if content_type is None else {"Content-Type": content_type}
    req = auth.request(address, path, data=data, method="POST", headers=headers)
    try:
        with auth.opener().open(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("data, content_type, status, fragment", [
    (b"{not json", "application/json", 415, "not valid JSON"),
    (b'{"input_ids": [1]', "application/json", 415, "not valid JSON"),
    (b'{"input_ids": [1], "rid": "\xff"}', "application/json", 415, "not valid JSON"),  # not UTF-8
    (b'{"input_ids": [1]}', None, 415, "must be JSON (Content-Type: application/json), not 'application/x-www"),
    (b'{"input_ids": [1]}', "text/plain", 415, "not 'text/plain'"),
    (b"[" * 100_000 + b"]" * 100_000, "application/json", 400, "nested too deeply"),
    (b'{"input_ids": [' + b"9" * 5000 + b"]}", "application/json", 400, "a number that cannot be read"),
    (b"[1, 2, 3]", "application/json", 400, "must be a JSON object, not list"),
    (b'{"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}', "application/json; charset=utf-8", 200, ""),
    (b'{"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}', "application/vnd.api+json", 200, ""),
])
def test_a_body_that_is_not_json_is_415(cpu_server, data, content_type, status, fragment):
    got, reply = post_raw(cpu_server, "/generate", data, content_type)
    assert got == status, reply
    assert status == 200 or fragment in reply["error"]["message"]


def while_polling_health(address: str, call) -> tuple[object, float, list[float]]:
    """(what `call()` returned, the seconds it took, the latencies of the /health calls made meanwhile; inf for
    one that did not answer 200, so that a failing /health fails the caller's latency check)."""
    latencies: list[float] = []
    done, polling = threading.Event(), threading.Event()

    def poll():
        while not done.is_set():
            started = time.perf_counter()
            polling.set()
            try:
                ok = http(address, "/health", timeout=60)[0] == 200
            except OSError:  # refused, reset or timed out
                ok = False
            latencies.append(time.perf_counter() - started if ok else math.inf)
            time.sleep(0.02)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    polling.wait(10)  # /health is being polled when the request goes out
    try:
        started = time.perf_counter()
        result = call()
        took = time.perf_counter() - started
    finally:
        done.set()
        poller.join()
    return result, took, latencies


def test_oversized_requests_are_refused_quickly_while_health_answers(cpu_server):
    """A body over the limit (64 MiB) is 413 before it is read; a 40 MB text prompt (it took 114 s to tokenise,
    with /health silent for 90 s) and 25 MB of ids are 400 at once; /health answers all along."""
    too_big = json.dumps({"input_ids": [1000] * (20 << 20)}).encode()
    huge_text = json.dumps({"text": "ab " * 13_400_000, "sampling_params": {"max_new_tokens": 8}}).encode()
    huge_ids = json.dumps({"input_ids": [100] * (5 << 20)}).encode()
    assert len(too_big) > 64 << 20 > len(huge_text) > 40_000_000 > len(huge_ids) > 25_000_000
    for data, status, fragment in [(too_big, 413, "the limit is 67108864"),
                                   (huge_text, 400, "exceeds the model's maximum context length"),
                                   (huge_ids, 400, "exceeds the model's maximum context length")]:
        (got, reply), took, latencies = while_polling_health(
            cpu_server, lambda: post_raw(cpu_server, "/generate", data, "application/json"))
        assert got == status and fragment in reply["error"]["message"], reply
        assert took < 5, f"{len(data)} bytes refused after {took:.1f}s"
        assert latencies and max(latencies) < 2, f"/health took up to {max(latencies):.2f}s"
    assert generate(cpu_server, sampling_params={"max_new_tokens": 2})[0] == 200


def test_body_limit_is_configurable(tiny_model_dir, tmp_path):
    server = start_cpu_server(tiny_model_dir, tmp_path, "--max-body-bytes", "1000")
    try:
        status, reply = generate(server.address, input_ids=[1] * 400, sampling_params={"max_new_tokens": 1})
        assert status == 413 and "the limit is 1000" in reply["error"]["message"]
        assert generate(server.address, sampling_params={"max_new_tokens": 1})[0] == 200
    finally:
        server.stop()


def test_bfloat16_on_the_device_given(tiny_model_dir, tmp_path):
    """--device cpu --dtype bfloat16: the engine serves in bfloat16 (the path a GPU without SGLang takes, on the
    CPU), its logprobs those of the bfloat16 model, and a float32 checkpoint loads into it."""
    server = start_cpu_server(tiny_model_dir, tmp_path, "--device", "cpu", "--dtype", "bfloat16")
    try:
        info = http(server.address, "/get_server_info")[1]
        assert info["device"] == "cpu" and info["dtype"] == "bfloat16"
        assert info["gpu_uuid"] is None  # on a GPU its UUID: the trainer's NCCL group must not share it
        status, reply = generate(server.address, return_logprob=True,
                                 sampling_params={"max_new_tokens": 8, "ignore_eos": True, "top_k": 5, "top_p": 0.9})
        assert status == 200 and reply["meta_info"]["completion_tokens"] == 8
        output = [t for _, t, _ in reply["meta_info"]["output_token_logprobs"]]
        served = [lp for lp, _, _ in reply["meta_info"]["output_token_logprobs"]]
        assert all(math.isfinite(lp) and lp <= 0 for lp in served)
        from areal_pipeline.model import load_model

        bf16 = teacher_forced_logprobs(load_model(tiny_model_dir, "bfloat16"), PROMPT, output, 1.0)
        assert max(abs(a - b) for a, b in zip(served, bf16)) < 0.05
        status, reply = http(server.address, "/update_weights_from_disk",
                             {"model_path": str(tiny_model_dir), "weight_version": "3"})
        assert status == 200 and reply["success"], reply
        status, weights = http(server.address, "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 4})
        assert status == 200 and len(weights) == 4
        # a CPU server joins weight-update groups over gloo only, and says why
        status, body = http(server.address, "/init_weights_update_group",
                            {"master_address": "127.0.0.1", "master_port": find_free_port(), "rank_offset": 1,
                             "world_size": 2, "backend": "nccl"})
        assert status == 400 and "NCCL needs the server on a GPU" in body["error"]["message"]
    finally:
        server.stop()


@pytest.mark.parametrize("device, message", [
    ("cuda", "--device cuda: no CUDA GPU is visible to this process"),
    ("cuda:x", "'cuda:x' is not cpu, cuda or cuda:N"),
    ("tpu", "'tpu' is not cpu, cuda or cuda:N"),
])
def test_a_device_this_machine_lacks_ends_the_server_with_the_reason(tiny_model_dir, tmp_path, device, message):
    if torch.cuda.is_available() and device == "cuda":
        pytest.skip("this machine has a GPU")
    port = find_free_port()
    server = ServerProcess([sys.executable, "-m", "areal_pipeline.inference.server", "--model", str(tiny_model_dir),
                            "--host", "127.0.0.1", "--port", str(port), "--device", device],
                           f"127.0.0.1:{port}", tmp_path / "server.log").start()
    try:
        with pytest.raises(ServerLaunchError, match="exited with code"):
            server.wait_healthy(120)
        assert message in server.log_tail()
    finally:
        server.stop()


def test_server_info_from_the_command_line_server(tiny_model_dir, tmp_path):
    """`areal-pipeline inference-server` (its args carry the CLI's dispatch function) answers /get_server_info."""
    port = find_free_port()
    server = ServerProcess([sys.executable, "-m", "cli", "inference-server", "--model",
                            str(tiny_model_dir), "--host", "127.0.0.1", "--port", str(port)],
                           f"127.0.0.1:{port}", tmp_path / "server.log").start()
    try:
        server.wait_healthy(120)
        status, info = http(server.address, "/get_server_info")
        assert status == 200 and info["port"] == port and info["model"] == str(tiny_model_dir)
        assert info["max_body_bytes"] == 64 << 20 and "func" not in info
    finally:
        server.stop()


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
    started = time.monotonic()

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
    # the engine's busy time grew by its generating, within the requests' wall time, and not while it waits
    busy = state["busy_seconds"] - before["internal_states"][0]["busy_seconds"]
    assert 0 < busy <= time.monotonic() - started
    time.sleep(0.3)
    assert http(cpu_server, "/get_server_info")[1]["internal_states"][0]["busy_seconds"] == state["busy_seconds"]


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

    # a version stays when none is given (as SGLang's does); bad paths fail cleanly and leave the server serving
    assert http(own_server, "/update_weights_from_disk", {"model_path": str(new_dir)})[1]["weight_version"] == "1"
    assert http(own_server, "/update_weights_from_disk", {"model_path": str(new_dir), "weight_version": "2"})[1][
        "weight_version"] == "2"
    status, reply = http(own_server, "/update_weights_from_disk", {"model_path": str(tmp_path / "missing")})
    assert status == 400 and reply["success"] is False and "no safetensors" in reply["message"]
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file({"not.a.weight": torch.zeros(2)}, str(bad / "model.safetensors"))
    status, reply = http(own_server, "/update_weights_from_disk", {"model_path": str(bad)})
    assert status == 400 and "does not have" in reply["message"]
    assert http(own_server, "/get_model_info")[1]["weight_version"] == "2"
    assert generate(own_server, sampling_params={"max_new_tokens": 2})[0] == 200


def test_a_bad_weight_push_is_400_and_leaves_the_served_weights_untouched(own_server, tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    greedy = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    name = "model.embed_tokens.weight"

    def served():
        return (generate(own_server, sampling_params=greedy)[1]["output_ids"],
                http(own_server, "/get_weights_by_name", {"name": name, "truncate_size": 10})[1],
                http(own_server, "/get_model_info")[1]["weight_version"])

    before = served()
    torch.manual_seed(0)
    state = load_file(str(tiny_model_dir / "model.safetensors"))
    perturbed = {k: v + 0.05 * torch.randn_like(v) for k, v in state.items()}

    def checkpoint(dirname: str, state: dict) -> Path:
        directory = tmp_path / dirname
        directory.mkdir()
        save_file(state, str(directory / "model.safetensors"))
        return directory

    truncated = checkpoint("truncated", perturbed)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    last = sorted(perturbed)[-1]  # a loader that checked as it copied would have taken every other tensor in
    one_nan = perturbed[last].clone().index_fill_(0, torch.tensor([0]), float("nan"))
    with_nan = checkpoint("nan", {**perturbed, last: one_nan})
    with_inf = checkpoint("inf", {**perturbed, name: perturbed[name].clone().fill_(float("inf"))})
    for directory, fragment in [(truncated, "cannot read weights"), (with_nan, f"tensor {last}"),
                                (with_inf, f"tensor {name}")]:
        status, reply = http(own_server, "/update_weights_from_disk", {"model_path": str(directory),
                                                                       "weight_version": "1"})
        assert status == 400 and reply["success"] is False and fragment in reply["message"], reply
        assert directory.name == "truncated" or "NaN or infinite" in reply["message"]
        assert served() == before
    # the comparison would have seen a change: the same weights, whole and finite, change the greedy answer
    status, reply = http(own_server, "/update_weights_from_disk", {"model_path": str(checkpoint("good", perturbed))})
    assert status == 200 and served()[0] != before[0]
