"""RemoteSGLangEngine against real CPU inference servers (subprocesses) and a scripted fake for retries."""

import asyncio
import dataclasses
import shutil
import time
from pathlib import Path

import pytest
from aiohttp import web

from areal_pipeline.config import GenerationConfig, InferenceConfig
from areal_pipeline.inference.client import RID_CACHE_SIZE, InferenceServerError, RemoteSGLangEngine
from areal_pipeline.inference.launcher import launch_servers
from areal_pipeline.inference.types import ModelRequest, SamplingParams
from areal_pipeline.run_spec import load_config
from conftest import SESSION_TEMP
from _http_helpers import serve_on_loopback

CONTEXT = 1024
PROMPT = [10, 20, 30, 40]


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from areal_pipeline.model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def perturbed_model(tiny_model, tmp_path_factory) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("models") / "perturbed"
    shutil.copytree(tiny_model, out)
    [weights] = out.glob("*.safetensors")
    state = load_file(str(weights))
    torch.manual_seed(0)
    save_file({k: (v + 0.5 * torch.randn_like(v)).contiguous() for k, v in state.items()}, str(weights),
              metadata={"format": "pt"})
    return out


def _launch(model: Path, log_dir: Path, num_servers: int):
    cfg = InferenceConfig(num_servers=num_servers, num_threads=1, context_length=CONTEXT, max_batch_size=32,
                          setup_timeout=180)
    # the weights they load come from the session's temp folder (the perturbed model), as a run's from its own
    run = load_config(None, [f"output_dir={SESSION_TEMP[0]}"])
    return launch_servers(str(model), cfg, seed=1, log_dir=log_dir, experiment=run)


@pytest.fixture(scope="session")
def two_servers(tiny_model, tmp_path_factory):
    servers = _launch(tiny_model, tmp_path_factory.mktemp("logs"), num_servers=2)
    yield [s.address for s in servers]
    for s in servers:
        s.stop()


@pytest.fixture
def one_server(tiny_model, tmp_path):
    """A private server: weight-update tests change its weights and version."""
    [server] = _launch(tiny_model, tmp_path, num_servers=1)
    yield server.address
    server.stop()


def _request(max_new_tokens=16, rid=None, **gconfig):
    req = ModelRequest(input_ids=list(PROMPT),
                       sampling=SamplingParams.from_config(GenerationConfig(max_new_tokens=max_new_tokens, **gconfig)))
    if rid is not None:
        req.rid = rid
    return req


def test_generate_returns_aligned_tokens_logprobs_versions(two_servers):
    async def main():
        async with RemoteSGLangEngine(two_servers) as engine:
            await engine.wait_healthy(30)
            # More concurrent requests than aiohttp's default connection limit (100).
            return await asyncio.gather(*(engine.agenerate(_request(24)) for _ in range(128)))

    responses = run(main())
    assert {r.server for r in responses} == set(two_servers)
    for resp in responses:
        assert resp.input_tokens == PROMPT and resp.input_len == len(PROMPT)
        assert 0 < resp.output_len <= 24
        assert len(resp.output_logprobs) == len(resp.output_versions) == resp.output_len
        assert all(lp <= 0 for lp in resp.output_logprobs)
        assert resp.output_versions == [0] * resp.output_len
        assert resp.stop_reason == "stop" or (resp.stop_reason == "length" and resp.output_len == 24)
        assert resp.latency > 0 and resp.server in two_servers


def test_ignore_eos_fills_budget_and_greedy_is_deterministic(two_servers):
    async def main():
        async with RemoteSGLangEngine(two_servers) as engine:
            long = engine.agenerate(ModelRequest(input_ids=list(PROMPT),
                                                 sampling=SamplingParams(max_new_tokens=300, ignore_eos=True)))
            greedy = [engine.agenerate(_request(32, greedy=True)) for _ in range(2)]
            return await asyncio.gather(long, *greedy)

    long, g1, g2 = run(main())
    assert long.output_len == 300 and long.stop_reason == "length"
    assert g1.output_tokens == g2.output_tokens and g1.server != g2.server


def test_round_robin_and_rid_stickiness(two_servers):
    async def main():
        async with RemoteSGLangEngine(two_servers) as engine:
            fresh = [(await engine.agenerate(_request(2))).server for _ in range(4)]
            sticky = [(await engine.agenerate(_request(2, rid="episode-7"))).server for _ in range(5)]
            return fresh, sticky

    fresh, sticky = run(main())
    assert set(fresh) == set(two_servers)
    assert fresh[0] != fresh[1] and fresh[0::2] == [fresh[0]] * 2 and fresh[1::2] == [fresh[1]] * 2
    assert len(set(sticky)) == 1


def test_rid_cache_is_lru():
    engine = RemoteSGLangEngine.from_config(["a:1", "b:2", "c:3"], InferenceConfig(request_retries=7))
    assert engine.request_retries == 7
    first = engine.choose_server("rid-0")
    for i in range(1, RID_CACHE_SIZE):
        engine.choose_server(f"rid-{i}")
    assert engine.choose_server("rid-0") == first  # a hit refreshes it
    for i in range(RID_CACHE_SIZE, RID_CACHE_SIZE + 10):
        engine.choose_server(f"rid-{i}")
    assert engine.choose_server("rid-0") == first
    assert "rid-1" not in engine._rid_to_server  # the least recently used went first


def test_dead_server_is_retried_then_named(dead_address):
    dead = dead_address

    async def main():
        async with RemoteSGLangEngine([dead], request_retries=2, retry_delay=0.05) as engine:
            await engine.agenerate(_request())

    start = time.monotonic()
    with pytest.raises(InferenceServerError) as info:
        run(main())
    assert time.monotonic() - start >= 0.05 + 0.1  # two backoff sleeps
    message = str(info.value)
    assert dead in message and "/generate" in message and "after 3 attempts" in message
    assert "ClientConnectorError" in message or "Connect" in message


def test_bad_request_surfaces_server_message(two_servers):
    async def main():
        async with RemoteSGLangEngine(two_servers, retry_delay=120) as engine:
            await engine.agenerate(_request(max_new_tokens=CONTEXT))

    start = time.monotonic()
    with pytest.raises(InferenceServerError) as info:
        run(main())
    assert time.monotonic() - start < 90  # not retried: a retry waits 120 s first
    assert info.value.status == 400
    assert "maximum context length" in str(info.value) and "/generate" in str(info.value)


def test_a_generation_at_the_context_length_ends_by_length_without_a_request(two_servers, dead_address):
    """A prompt one token short of the context length leaves no room (SGLang refuses prompt + budget reaching the
    limit): the client ends it by length, with no tokens, and sends nothing; one more token of room generates."""
    req = _request(max_new_tokens=4)
    prompt = len(req.input_ids)

    async def main(addresses, context_length):
        async with RemoteSGLangEngine(addresses, context_length=context_length, request_retries=0) as engine:
            return await engine.agenerate(req)

    full = run(main([dead_address], prompt + 1))  # nothing answers there: a request would fail
    assert (full.output_tokens, full.output_logprobs, full.stop_reason) == ([], [], "length")
    roomy = run(main(two_servers, prompt + 2))
    assert len(roomy.output_tokens) == 1 and roomy.stop_reason == "length"


async def _fake_server(statuses: list[int]):
    """A server answering /generate with the given statuses in turn (then 200), counting calls."""
    calls = []

    async def generate(request):
        calls.append(await request.json())
        status = statuses[len(calls) - 1] if len(calls) <= len(statuses) else 200
        if status != 200:
            return web.json_response({"error": {"message": f"scripted {status}"}}, status=status)
        meta = {"finish_reason": {"type": "length", "length": 2}, "weight_version": "default",
                "output_token_logprobs": [[-0.5, 7, None], [-0.25, 8, None]]}
        return web.json_response({"text": "", "output_ids": [7, 8], "meta_info": meta})

    runner, address = await serve_on_loopback("/generate", generate)
    return runner, address, calls


def test_5xx_is_retried_4xx_is_not():
    async def main():
        runner, address, calls = await _fake_server([503, 500])
        try:
            async with RemoteSGLangEngine([address], retry_delay=0.01) as engine:
                engine.set_version(3)
                resp = await engine.agenerate(_request(2, temperature=0.7))
                assert len(calls) == 3
                assert resp.output_tokens == [7, 8] and resp.output_logprobs == [-0.5, -0.25]
                assert resp.output_versions == [3, 3]  # "default" is not a version: the client's own
                assert calls[0]["sampling_params"]["temperature"] == 0.7
                assert calls[0]["return_logprob"] is True and calls[0]["stream"] is False

                req = _request(5, greedy=True, temperature=0.7, stop=["\n"], stop_token_ids=[3])
                req.sampling = dataclasses.replace(req.sampling, ignore_eos=True)
                await engine.agenerate(req)
                # no rid: SGLang 0.5.10 refuses one it still holds, as a re-sent request's may be
                assert calls[-1] == {
                    "input_ids": PROMPT, "return_logprob": True, "stream": False,
                    "sampling_params": {"max_new_tokens": 5, "temperature": 0.0, "top_p": 1.0, "top_k": -1,
                                        "stop": ["\n"], "stop_token_ids": [3], "ignore_eos": True},
                }
        finally:
            await runner.cleanup()

        runner, address, calls = await _fake_server([422])
        try:
            async with RemoteSGLangEngine([address], retry_delay=0.01) as engine:
                with pytest.raises(InferenceServerError, match="HTTP 422: scripted 422"):
                    await engine.agenerate(_request(2))
                assert len(calls) == 1
        finally:
            await runner.cleanup()

        runner, address, calls = await _fake_server([502] * 10)
        try:
            async with RemoteSGLangEngine([address], request_retries=1, retry_delay=0.01) as engine:
                with pytest.raises(InferenceServerError, match="after 2 attempts; last error: HTTP 502: scripted 502"):
                    await engine.agenerate(_request(2))
                assert len(calls) == 2
        finally:
            await runner.cleanup()

    run(main())


async def _wait_until_decoding(engine: RemoteSGLangEngine, address: str, min_tokens: int) -> None:
    base = (await engine.get_server_info(address))["internal_states"][0]["generated_tokens"]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        state = (await engine.get_server_info(address))["internal_states"][0]
        if state["generated_tokens"] - base >= min_tokens:
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the long generation never started")


@pytest.mark.parametrize("controller", ["same-engine", "separate-engine"])
def test_generation_survives_pause_and_weight_update(one_server, perturbed_model, controller):
    """The trajectory is interrupted by a weight update and finishes under the new version.

    "separate-engine" is a trainer in another process: the generating client knows nothing of the pause,
    the server holds its re-sent request until it is continued, and the version comes from the reply.
    """
    budget = CONTEXT - len(PROMPT) - 1  # the most SGLang takes: prompt + budget below the context length

    async def main():
        async with RemoteSGLangEngine([one_server]) as engine, RemoteSGLangEngine([one_server]) as other:
            updater = engine if controller == "same-engine" else other
            req = ModelRequest(input_ids=list(PROMPT), sampling=SamplingParams(max_new_tokens=budget, ignore_eos=True))
            task = asyncio.create_task(engine.agenerate(req))
            await _wait_until_decoding(updater, one_server, min_tokens=20)
            await updater.pause()
            await asyncio.sleep(0.3)  # the interrupted request is re-sent and must be held, not served
            assert not task.done()
            await updater.update_weights_from_disk(str(perturbed_model), version=1)
            await updater.resume()
            resp = await asyncio.wait_for(task, timeout=120)
            info = await engine.get_model_info()
            return resp, info, updater.get_version()

    resp, info, updater_version = run(main())
    assert resp.output_len == budget and resp.stop_reason == "length"
    assert len(resp.output_logprobs) == budget and resp.input_tokens == PROMPT
    switch = resp.output_versions.index(1)
    assert 20 <= switch < budget
    assert resp.output_versions == [0] * switch + [1] * (budget - switch)
    assert info["weight_version"] == "1" and updater_version == 1


def test_group_generation_matches_separate_requests_and_survives_a_weight_update(one_server, perturbed_model):
    """A GRPO group in SGLang's batch form: the samples are those of separate requests with the same seeds, and
    a weight update in the middle interrupts all of them, which finish together under the new version."""
    budget = CONTEXT - len(PROMPT) - 1  # the most SGLang takes: prompt + budget below the context length

    def group(max_new_tokens):
        return [ModelRequest(input_ids=list(PROMPT), sampling=SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True,
                                                                             sampling_seed=10 + i)) for i in range(3)]

    async def main():
        async with RemoteSGLangEngine([one_server]) as engine:
            together = await engine.agenerate_group(group(8))
            alone = await asyncio.gather(*(engine.agenerate(r) for r in group(8)))
            task = asyncio.create_task(engine.agenerate_group(group(budget)))
            await _wait_until_decoding(engine, one_server, min_tokens=60)
            await engine.pause()
            await engine.update_weights_from_disk(str(perturbed_model), version=1)
            await engine.resume()
            return together, alone, await asyncio.wait_for(task, timeout=120)

    together, alone, interrupted = run(main())
    assert [r.output_tokens for r in together] == [r.output_tokens for r in alone]
    assert len({tuple(r.output_tokens) for r in together}) == 3  # each sample its own seed
    for resp in interrupted:
        assert resp.output_len == budget and resp.stop_reason == "length" and resp.input_tokens == PROMPT
        assert len(resp.output_logprobs) == budget
        switch = resp.output_versions.index(1)
        assert 0 < switch < budget and resp.output_versions == [0] * switch + [1] * (budget - switch)


def test_update_weights_full_sequence_and_failure_resumes(one_server, perturbed_model):
    async def main():
        async with RemoteSGLangEngine([one_server]) as engine:
            before = await engine.agenerate(_request(8, greedy=True))
            await engine.update_weights(str(perturbed_model), version=5)
            after = await engine.agenerate(_request(8, greedy=True))
            with pytest.raises(InferenceServerError, match="no safetensors weights"):
                await engine.update_weights(str(perturbed_model / "missing"), version=6)
            # the failed update left the servers running and the version unchanged
            last = await asyncio.wait_for(engine.agenerate(_request(8, greedy=True)), timeout=30)
            return before, after, last, engine.get_version()

    before, after, last, version = run(main())
    assert before.output_versions == [0] * before.output_len
    assert after.output_versions == [5] * after.output_len
    assert after.output_logprobs != before.output_logprobs
    assert last.output_versions == [5] * last.output_len and version == 5


def test_wait_healthy_times_out_naming_the_dead_server(two_servers, dead_address):
    dead = dead_address

    async def main():
        async with RemoteSGLangEngine([*two_servers, dead]) as engine:
            await engine.wait_healthy(timeout=1)

    with pytest.raises(TimeoutError, match=dead):
        run(main())
