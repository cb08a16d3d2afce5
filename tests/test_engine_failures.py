"""Every request to the CPU server ends with a reply or an error, whatever step of the engine fails.

A request is popped from the engine's queue before its prefill: when that admission step failed, the request was
neither queued nor running, no abort path found it, and its HTTP call hung for ever (#17). On the CPU no request
that passes validation makes the prefill fail, so the fault is injected into the model's forward pass the way an
out-of-memory error in a prefill would surface (on a GPU, torch.OutOfMemoryError), in a server run in-process.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from aiohttp import web

from areal_pipeline.inference.client import InferenceServerError, RemoteSGLangEngine
from areal_pipeline.inference.engine import BatchEngine
from areal_pipeline.inference.server import InferenceServer
from areal_pipeline.inference.types import ModelRequest, SamplingParams
from areal_pipeline.utils import find_free_port
from conftest import http

POISON = 7  # a prompt holding this token fails in its prefill
PROMPT = [258, 117, 115, 101, 114, 10, 51, 43, 52, 61]
TIMEOUT = 30  # far beyond any reply here: a call that takes it has hung


class _Faults:
    """The model's forward, failing where told: in a prefill of a prompt holding POISON, or in the next decode step."""

    def __init__(self, model):
        self.real = model.forward
        self.fail_next_decode = threading.Event()
        model.forward = self

    def __call__(self, *args, **kwargs):
        ids = kwargs["input_ids"]
        if ids.shape[1] > 1 and bool((ids == POISON).any()):
            raise torch.OutOfMemoryError("injected: out of memory in the prefill")
        if ids.shape[1] == 1 and self.fail_next_decode.is_set():
            self.fail_next_decode.clear()
            raise RuntimeError("injected: a decode step failed")
        return self.real(*args, **kwargs)


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    """(address, engine, faults) of a server on loopback in this process, its model's forward wrapped."""
    engine = BatchEngine(str(tiny_model_dir), max_batch_size=16, seed=0)
    engine.start()
    assert engine.ready.wait(120), engine.load_error
    faults = _Faults(engine.model)
    port = find_free_port()
    loop = asyncio.new_event_loop()
    started = threading.Event()
    runner = web.AppRunner(InferenceServer(engine, server_args={}).app())

    async def up():
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        started.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(up()), loop.run_forever()), daemon=True)
    thread.start()
    assert started.wait(30)
    yield f"127.0.0.1:{port}", engine, faults
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(30)


def _in_thread(fn):
    box: dict = {}
    thread = threading.Thread(target=lambda: box.setdefault("result", fn()), daemon=True)
    thread.start()
    return thread, box


def _wait_running(engine: BatchEngine, n: int) -> None:
    deadline = time.monotonic() + TIMEOUT
    while len(engine._batch) < n:
        assert time.monotonic() < deadline, "the long request never started"
        time.sleep(0.01)


def test_a_failed_admission_answers_its_requests_with_an_error_and_spares_the_running_batch(served):
    address, engine, _ = served
    long = {"max_new_tokens": 200, "ignore_eos": True}
    thread, box = _in_thread(lambda: http(address, "/generate", {"input_ids": PROMPT, "sampling_params": long},
                                          timeout=TIMEOUT * 4))
    _wait_running(engine, 1)

    started = time.monotonic()
    # one poisoned prompt in a batch of two: the whole admission fails, and both requests are answered
    status, body = http(address, "/generate", {"input_ids": [PROMPT, PROMPT[:5] + [POISON]],
                                               "sampling_params": {"max_new_tokens": 4}}, timeout=TIMEOUT)
    assert status == 500, body
    assert "internal error while admitting the request" in body["error"]["message"]
    assert "OutOfMemoryError" in body["error"]["message"]
    assert time.monotonic() - started < TIMEOUT

    # the request that was running when admission failed goes on to its end
    thread.join(TIMEOUT * 4)
    status, reply = box["result"]
    assert status == 200 and reply["meta_info"]["finish_reason"] == {"type": "length", "length": 200}

    # and the server keeps serving, the OpenAI endpoint's failure being an error too
    status, reply = http(address, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}})
    assert status == 200 and reply["meta_info"]["completion_tokens"] == 3
    status, body = http(address, "/v1/completions", {"model": "m", "prompt": PROMPT[:5] + [POISON], "max_tokens": 2},
                        timeout=TIMEOUT)
    assert status == 500 and "admitting" in body["error"]["message"], body
    assert engine.num_running() == 0


def test_the_client_gets_an_error_not_a_hang(served):
    address, _, _ = served

    async def poisoned():
        async with RemoteSGLangEngine([address], request_retries=1, retry_delay=0.05) as client:
            await client.agenerate(ModelRequest(input_ids=PROMPT + [POISON], sampling=SamplingParams(max_new_tokens=4)))

    with pytest.raises(InferenceServerError, match="failed after 2 attempts.*HTTP 500.*admitting"):
        asyncio.run(asyncio.wait_for(poisoned(), TIMEOUT))


def test_a_failed_decode_step_answers_the_running_requests_with_an_error_and_serves_the_queued_ones(served):
    address, engine, faults = served
    long = {"max_new_tokens": 300, "ignore_eos": True}
    thread, box = _in_thread(lambda: http(address, "/generate", {"input_ids": PROMPT, "sampling_params": long},
                                          timeout=TIMEOUT))
    _wait_running(engine, 1)
    faults.fail_next_decode.set()
    thread.join(TIMEOUT)
    assert not thread.is_alive(), "the running request hung after a failed decode step"
    status, body = box["result"]
    assert status == 500 and "a decode step failed" in body["error"]["message"], body
    status, reply = http(address, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5}})
    assert status == 200 and reply["meta_info"]["completion_tokens"] == 5
