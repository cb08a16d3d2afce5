"""Every `sampling_params` the client builds is taken by SGLang's own SamplingParams (both supported releases, read
from their wheels): constructed, normalised and verified as SGLang's tokenizer manager does before it accepts a
request. 0.5.23 refuses unknown keys; none of the client's may be one."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

import _sglang_reference as ref
from areal_pipeline.config import GenerationConfig
from areal_pipeline.inference.client import RemoteSGLangEngine
from areal_pipeline.inference.openai_requests import parse_chat_request
from areal_pipeline.inference.types import ModelRequest, SamplingParams
from areal_pipeline.workflows.rlvr import sample_seed

TESTS = Path(__file__).resolve().parent


def workflow_sampling() -> list[SamplingParams]:
    """The sampling the workflows send: from `rollout.gconfig` (rlvr's seeds, a search agent's stop strings, a greedy
    evaluation) and from an OpenAI agent's request with every sampling field it may set."""
    chat = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                               "stop": "x", "seed": 3, "min_p": 0.05, "top_k": 5, "top_p": 0.9, "ignore_eos": True,
                               "skip_special_tokens": False, "stop_token_ids": [4], "temperature": 0.5})
    return [
        SamplingParams.from_config(GenerationConfig()),
        SamplingParams.from_config(GenerationConfig(greedy=True, stop=["\n\n", "</answer>"], stop_token_ids=[5],
                                                    top_p=0.9, top_k=20)),
        dataclasses.replace(SamplingParams.from_config(GenerationConfig(temperature=0.7)),
                            **sample_seed({"sampling_seed": 12345}, turn=2)),
        SamplingParams(ignore_eos=True, skip_special_tokens=False, sampling_seed=(1 << 63) - 1),
        chat.sampling.for_choice(1),
    ]


def client_sampling_params() -> list[dict]:
    """What the client sends for them (budget cut to the context length as the client cuts it)."""
    engine = RemoteSGLangEngine(["127.0.0.1:1"], context_length=64)
    return [engine._generate_payload(ModelRequest(input_ids=[1, 2, 3], sampling=s), [7])["sampling_params"]
            for s in workflow_sampling()]


def test_the_server_parses_what_the_client_sends_into_the_same_sampling():
    """One type from the workflow to the server: the CPU server's parse of the wire form is the value sent."""
    for sampling in workflow_sampling():
        assert SamplingParams.from_json(sampling.sglang()) == sampling
    wire = workflow_sampling()[-1].sglang()
    assert wire == {"max_new_tokens": 8, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "stop": ["x"],
                    "stop_token_ids": [4], "min_p": 0.05, "ignore_eos": True, "skip_special_tokens": False,
                    "sampling_seed": 4}
    # a plain request's wire form: the six fields every client sends, nothing at its default beyond them
    assert SamplingParams.from_config(GenerationConfig(max_new_tokens=5)).sglang() == {
        "max_new_tokens": 5, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "stop": [], "stop_token_ids": []}
    assert workflow_sampling()[-1].vllm(seeded=True) == {
        "max_tokens": 8, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "stop": ["x"], "stop_token_ids": [4],
        "min_p": 0.05, "ignore_eos": True, "skip_special_tokens": False, "seed": 4}
    assert "seed" not in workflow_sampling()[-1].vllm(seeded=False)
    assert SamplingParams(sampling_seed=(1 << 64) - 1).vllm(seeded=True)["seed"] == (1 << 63) - 1


@pytest.mark.parametrize("version", ref.VERSIONS)
def test_sglangs_sampling_params_take_every_dict_the_client_builds(version, tiny_model_dir):
    ref.wheel(version)
    extra = ref.msgspec_path() if version != "0.5.10.post1" else ""
    params = client_sampling_params()
    job = {"version": version, "tokenizer": str(tiny_model_dir), "vocab_size": 1000, "extra_path": extra,
           "params": params + [{**params[0], "not_a_sampling_key": 1}]}
    done = subprocess.run([sys.executable, str(TESTS / "_sglang_reference.py")], input=json.dumps(job),
                          capture_output=True, text=True, timeout=300, cwd=TESTS)
    assert done.returncode == 0, done.stderr[-3000:]
    errors = json.loads(done.stdout.strip().splitlines()[-1])
    assert errors[:-1] == [None] * len(params), list(zip(params, errors))
    assert "not_a_sampling_key" in errors[-1]  # SGLang does check the keys: the test can fail
