"""Where real SGLang differs from a naive double, the project's server behaves as SGLang does (sglang-protocol.md's
last section), and the client copes: duplicate request ids, /health while paused, seeds only with
--enable-deterministic-inference, prompt + max_new_tokens reaching the context length."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from areal_pipeline.inference.client import RemoteSGLangEngine
from areal_pipeline.inference.types import ModelRequest, SamplingParams
from conftest import http, start_cpu_server

PROMPT = [258, 117, 115, 101, 114, 10, 51, 43, 52, 61]
CONTEXT = 48


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    """Started as SGLang is by default: no deterministic inference; a short health-check timeout for the test."""
    process = start_cpu_server(tiny_model_dir, tmp_path_factory.mktemp("logs"), "--context-length", str(CONTEXT),
                               "--health-check-timeout", "1.5", deterministic=False)
    yield process.address
    process.stop()


def generate(address: str, **body):
    return http(address, "/generate", {"input_ids": PROMPT, **body}, timeout=120)


def in_background(fn) -> tuple[threading.Thread, dict]:
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(value=fn()), daemon=True)
    thread.start()
    return thread, result


def test_a_request_id_in_flight_is_refused_as_sglang_0_5_10_refuses_it(server):
    assert http(server, "/pause_generation", {"mode": "abort"})[0] == 200
    try:  # a request sent while paused waits, holding its id
        first, result = in_background(lambda: generate(server, rid="traj-1", sampling_params={"max_new_tokens": 2}))
        time.sleep(0.5)
        status, body = generate(server, rid="traj-1", sampling_params={"max_new_tokens": 2})
        assert status == 400 and body["error"]["message"] == "Duplicate request IDs detected: ['traj-1']"
        status, body = generate(server, input_ids=[PROMPT, PROMPT], rid=["a", "a"])
        assert status == 400 and "Duplicate request IDs detected within the request: ['a']" in body["error"]["message"]
    finally:
        http(server, "/continue_generation", {})
    first.join(60)
    assert result["value"][0] == 200
    assert generate(server, rid="traj-1", sampling_params={"max_new_tokens": 2})[0] == 200  # finished: free again


def test_health_waits_while_paused_and_says_503_after_its_timeout(server):
    assert http(server, "/pause_generation", {"mode": "abort"})[0] == 200
    try:
        started = time.monotonic()
        assert http(server, "/health", timeout=30)[0] == 503
        assert time.monotonic() - started >= 1.4
        assert http(server, "/model_info", timeout=5)[0] == 200  # what the pipeline probes a running server with
        waiting, result = in_background(lambda: http(server, "/health", timeout=30)[0])
        time.sleep(0.3)
    finally:
        http(server, "/continue_generation", {})
    waiting.join(30)
    assert result["value"] == 200  # continued within the timeout: healthy


def test_sampling_seed_is_ignored_without_deterministic_inference(server):
    params = {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 7}
    outputs = {tuple(generate(server, sampling_params=params)[1]["output_ids"]) for _ in range(3)}
    assert len(outputs) > 1  # the server's own generator drew them: the seed made no difference


def test_min_p_is_refused_with_deterministic_inference_where_sglang_would_die(tiny_model_dir, tmp_path):
    from areal_pipeline.processes import ServerProcess

    seeded: ServerProcess = start_cpu_server(tiny_model_dir, tmp_path)  # as the launcher starts it
    try:
        status, body = generate(seeded.address, sampling_params={"max_new_tokens": 2, "min_p": 0.1})
        assert status == 400 and "--enable-deterministic-inference" in body["error"]["message"]
        assert generate(seeded.address, sampling_params={"max_new_tokens": 2, "sampling_seed": 1})[0] == 200
    finally:
        seeded.stop()


def test_prompt_plus_budget_reaching_the_context_length_is_refused_and_the_client_cuts_the_budget(server):
    room = CONTEXT - len(PROMPT)
    status, body = generate(server, sampling_params={"max_new_tokens": room})
    assert status == 400 and "maximum context length of 48 tokens" in body["error"]["message"]
    assert generate(server, sampling_params={"max_new_tokens": room - 1, "ignore_eos": True})[0] == 200

    async def run():
        async with RemoteSGLangEngine([server], context_length=CONTEXT) as engine:
            sampling = SamplingParams(max_new_tokens=room + 10, temperature=1.0)
            return await engine.agenerate(ModelRequest(input_ids=PROMPT, sampling=sampling))

    resp = asyncio.run(run())
    assert len(resp.output_tokens) <= room - 1 and resp.stop_reason in ("length", "stop")
