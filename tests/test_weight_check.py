"""Weight updates verified on the project's own server (the vLLM backend's are in test_vllm.py): the probe logprobs
a real CPU server gives match the pushed weights' and tell them from the previous ones."""

from __future__ import annotations

import asyncio

import pytest
import torch

from areal_pipeline.inference.client import RemoteSGLangEngine
from areal_pipeline.inference.weight_check import WeightMismatchError, probe_ids, verify_served
from areal_pipeline.model import load_model, load_tokenizer


def _logprobs(model_dir, ids: list[int]) -> list[float]:
    model = load_model(model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def test_the_project_server_is_checked_against_the_weights_pushed(cpu_server, tiny_model_dir, tmp_path):
    model = load_model(tiny_model_dir)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    moved = tmp_path / "moved"
    model.save_pretrained(moved, safe_serialization=True)
    load_tokenizer(tiny_model_dir).save_pretrained(moved)
    ids = probe_ids(load_tokenizer(tiny_model_dir))
    expected = {"base": _logprobs(tiny_model_dir, ids), "moved": _logprobs(moved, ids)}

    async def run():
        async with RemoteSGLangEngine([cpu_server]) as engine:
            try:
                await engine.update_weights(str(moved), 1)
                assert (await verify_served(engine, ids, expected["moved"], 1, 1e-3, backend="cpu"))[cpu_server] < 1e-4
                with pytest.raises(WeightMismatchError, match=rf"cpu server {cpu_server} gives"):
                    await verify_served(engine, ids, expected["base"], 1, 1e-3, backend="cpu")
            finally:  # the session's server goes back to the weights the other tests expect
                await engine.update_weights(str(tiny_model_dir), 0)
            assert (await verify_served(engine, ids, expected["base"], 0, 1e-3))[cpu_server] < 1e-4
    asyncio.run(run())
