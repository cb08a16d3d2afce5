"""Every `sampling_params` the client builds is taken by SGLang's own SamplingParams (both supported releases, read
from their wheels): constructed, normalised and verified as SGLang's tokenizer manager does before it accepts a
request. 0.5.23 refuses unknown keys; none of the client's may be one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import _sglang_reference as ref
from areal_pipeline.config import GenerationConfig
from areal_pipeline.inference.client import RemoteSGLangEngine
from areal_pipeline.inference.openai_api import Sampling
from areal_pipeline.inference.types import ModelRequest
from areal_pipeline.workflows.rlvr import sample_seed

TESTS = Path(__file__).resolve().parent


def client_sampling_params() -> list[dict]:
    """What the client sends for the configurations the workflows use (rlvr's seeds, the agents' OpenAI fields)."""
    engine = RemoteSGLangEngine(["127.0.0.1:1"], context_length=64)
    requests = [
        ModelRequest(input_ids=[1, 2, 3], gconfig=GenerationConfig()),
        ModelRequest(input_ids=[1, 2, 3], gconfig=GenerationConfig(greedy=True, stop=["\n\n", "</answer>"],
                                                                   stop_token_ids=[5], top_p=0.9, top_k=20)),
        ModelRequest(input_ids=[1, 2, 3], gconfig=GenerationConfig(temperature=0.7),
                     extra_sampling_params=sample_seed({"sampling_seed": 12345}, 3, turn=2)),
        ModelRequest(input_ids=[1, 2, 3], gconfig=GenerationConfig(),
                     extra_sampling_params={"min_p": 0.0, "ignore_eos": True, "skip_special_tokens": False,
                                            "sampling_seed": (1 << 63) - 1}),
    ]
    params = [engine._generate_payload(r, [7])["sampling_params"] for r in requests]
    return params + [Sampling(max_tokens=8, stop=["x"], seed=3, min_p=0.05).sglang_params(8, choice=1)]


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
