"""LoRA adapters on the project's server (areal_pipeline/inference/lora_serving.py), through SGLang's routes, as a real
subprocess: served bitwise as the trainer merges them, loads swapping one for the next without drift, and every
refusal with its reason."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from areal_pipeline.config.schema import LoRAConfig
from areal_pipeline.inference.lora_serving import EVICTED
from areal_pipeline.training import lora
from conftest import http, start_cpu_server

PROMPT = [258, 117, 115, 101, 114, 10, 51, 43, 52, 61]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base_dir: Path, out: Path, seed: int, rank: int = 4, targets=("all-linear",),
                 scale_b: float = 0.05) -> Path:
    """A PEFT adapter directory of the tiny model with non-zero B (a trained adapter's shape), as the trainer writes it."""
    from peft import get_peft_model

    from areal_pipeline.model import load_model

    settings = LoRAConfig(enabled=True, rank=rank, alpha=2.0 * rank, target_modules=list(targets))
    model = get_peft_model(load_model(str(base_dir)), lora.peft_config(settings, str(base_dir)))
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in model.state_dict().items():
        if ".lora_A." in name or ".lora_B." in name:
            noise = torch.randn(tensor.shape, generator=generator)
            state[name] = noise * (scale_b if ".lora_B." in name else 0.3)
    lora.write_adapter_dir(out, lora.peft_state(state), settings, str(base_dir))
    return out


def merged_weights(base_dir: Path, adapter_dir: Path) -> dict[str, torch.Tensor]:
    """The trainer's merged policy of `adapter_dir` over the base (training/lora.py's merged_state)."""
    from peft import get_peft_model

    from areal_pipeline.model import load_model

    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    targets = config["target_modules"]
    settings = LoRAConfig(enabled=True, rank=config["r"], alpha=config["lora_alpha"],
                          target_modules=["all-linear"] if targets == "all-linear" else sorted(targets))
    model = get_peft_model(load_model(str(base_dir)), lora.peft_config(settings))
    state = model.state_dict()
    saved = load_file(str(adapter_dir / "adapter_model.safetensors"))
    state.update(lora.module_state(saved, list(state)))
    return lora.merged_state(state, settings)


def served_weight(address: str, name: str) -> torch.Tensor:
    status, values = http(address, "/get_weights_by_name", {"name": name, "truncate_size": 1 << 30})
    assert status == 200, values
    return torch.tensor(values, dtype=torch.float32)


def probe(address: str, adapter=None) -> tuple[int, object]:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}, "return_logprob": True,
            "logprob_start_len": 0}
    if adapter is not None:
        body["lora_path"] = adapter
    return http(address, "/generate", body)


@pytest.fixture(scope="module")
def weights_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lora-weights")


@pytest.fixture(scope="module")
def lora_server(tiny_model_dir, weights_root, tmp_path_factory):
    server = start_cpu_server(tiny_model_dir, tmp_path_factory.mktemp("lora-logs"), "--weights-root", str(weights_root),
                              "--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", *TARGETS)
    yield server
    server.stop()


@pytest.fixture
def clean(lora_server):
    """The server serving its base again after the test, whatever it loaded."""
    yield lora_server.address
    status, reply = http(lora_server.address, "/v1/models")
    for entry in reply["data"][1:]:
        http(lora_server.address, "/unload_lora_adapter", {"lora_name": entry["id"]})
    http(lora_server.address, "/continue_generation", {})


def test_a_loaded_adapter_is_served_bitwise_as_the_trainer_merges_it(clean, tiny_model_dir, weights_root):
    from peft import PeftModel

    from areal_pipeline.model import load_model

    adapter = make_adapter(tiny_model_dir, weights_root / "a1", seed=1)
    status, reply = http(clean, "/load_lora_adapter", {"lora_name": "policy-v1", "lora_path": str(adapter)})
    assert status == 200 and reply == {"success": True, "error_message": "",
                                       "loaded_adapters": {"policy-v1": str(adapter)}}
    merged = merged_weights(tiny_model_dir, adapter)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        assert torch.equal(served_weight(clean, name).view(merged[name].shape), merged[name]), name
    base = load_model(str(tiny_model_dir))
    untouched = "model.embed_tokens.weight"
    assert torch.equal(served_weight(clean, untouched).view(base.state_dict()[untouched].shape),
                       base.state_dict()[untouched])
    # what the server computes is peft's own adapted model's (unmerged: x W + s x A B)
    status, reply = probe(clean, "policy-v1")
    assert status == 200, reply
    served = torch.tensor([entry[0] for entry in reply["meta_info"]["input_token_logprobs"][1:]])
    with torch.no_grad():
        logits = PeftModel.from_pretrained(base, str(adapter)).eval()(torch.tensor([PROMPT])).logits[0]
    expected = torch.log_softmax(logits.float(), -1)[:-1].gather(-1, torch.tensor(PROMPT[1:])[:, None]).squeeze(-1)
    assert (served - expected).abs().max() < 1e-4
    status, base_reply = http(clean, "/v1/models")
    assert [entry["id"] for entry in base_reply["data"]][1:] == ["policy-v1"]


def test_loads_swap_adapters_without_drift_and_an_unload_restores_the_base_bitwise(clean, tiny_model_dir, weights_root):
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight"]
    before = {name: served_weight(clean, name) for name in names}
    adapters = [make_adapter(tiny_model_dir, weights_root / f"swap{i}", seed=10 + i) for i in range(3)]
    loads = 120
    for k in range(loads):
        status, reply = http(clean, "/load_lora_adapter", {"lora_name": f"policy-v{k}",
                                                           "lora_path": str(adapters[k % 3])})
        # one adapter held, however many loads: the one before is evicted by each
        assert status == 200 and list(reply["loaded_adapters"]) == [f"policy-v{k}"], reply
    last = merged_weights(tiny_model_dir, adapters[(loads - 1) % 3])
    for name in names:
        assert torch.equal(served_weight(clean, name).view(last[name].shape), last[name])
    # an adapter of fewer targets: the layers only the evicted one adapted serve the base again
    narrow = make_adapter(tiny_model_dir, weights_root / "narrow", seed=20, targets=("q_proj",))
    assert http(clean, "/load_lora_adapter", {"lora_name": "narrow", "lora_path": str(narrow)})[0] == 200
    assert torch.equal(served_weight(clean, names[1]), before[names[1]])
    status, reply = http(clean, "/unload_lora_adapter", {"lora_name": "narrow"})
    assert status == 200 and reply["loaded_adapters"] == {}
    for name in names:
        assert torch.equal(served_weight(clean, name), before[name]), f"{name} drifted from the base"
    status, reply = probe(clean)
    assert status == 200  # the base is served again, to requests naming no adapter


def test_requests_must_name_the_loaded_adapter(clean, tiny_model_dir, weights_root):
    adapter = make_adapter(tiny_model_dir, weights_root / "named", seed=3)
    assert http(clean, "/load_lora_adapter", {"lora_name": "policy-v2", "lora_path": str(adapter)})[0] == 200
    status, reply = probe(clean, "policy-v1")
    assert status == 400
    assert reply["error"]["message"] == ("The following requested LoRA adapters are not loaded: policy-v1\n"
                                         "Loaded adapters: ['policy-v2'].")
    status, reply = probe(clean)
    assert status == 400 and "the base is not served while it is loaded" in reply["error"]["message"]
    status, reply = http(clean, "/generate", {"input_ids": [PROMPT, PROMPT], "lora_path": ["policy-v2"],
                                              "sampling_params": {"max_new_tokens": 1}})
    assert status == 400 and "lora_path list length (1) must match batch size (2)" in reply["error"]["message"]
    status, replies = http(clean, "/generate", {"input_ids": [PROMPT, PROMPT], "lora_path": "policy-v2",
                                                "sampling_params": {"max_new_tokens": 1}})
    assert status == 200 and len(replies) == 2
    # the OpenAI routes take the adapter as the model, as SGLang's and vLLM's do
    chat = {"messages": [{"role": "user", "content": "2+2="}], "max_tokens": 2}
    status, reply = http(clean, "/v1/chat/completions", {**chat, "model": "policy-v2"})
    assert status == 200, reply
    status, reply = http(clean, "/v1/chat/completions", {**chat, "model": "default"})
    assert status == 400 and "the base is not served" in reply["error"]["message"]


def test_a_load_aborts_the_requests_running_on_the_adapter_it_evicts(clean, tiny_model_dir, weights_root):
    first = make_adapter(tiny_model_dir, weights_root / "evicted", seed=4)
    second = make_adapter(tiny_model_dir, weights_root / "evicting", seed=5)
    assert http(clean, "/load_lora_adapter", {"lora_name": "old", "lora_path": str(first)})[0] == 200
    replies = []
    long_generation = threading.Thread(target=lambda: replies.append(http(clean, "/generate", {
        "input_ids": PROMPT, "lora_path": "old", "return_logprob": True,
        "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}, timeout=120)))
    long_generation.start()
    deadline = time.monotonic() + 60
    while http(clean, "/server_info")[1]["internal_states"][0]["running_requests"] == 0:
        assert time.monotonic() < deadline, "the generation never started"
        time.sleep(0.01)
    assert http(clean, "/load_lora_adapter", {"lora_name": "new", "lora_path": str(second)})[0] == 200
    long_generation.join(120)
    status, reply = replies[0]
    assert status == 200
    # ended as a pause ends a request (its tokens so far), never continued on weights it did not name
    assert reply["meta_info"]["finish_reason"] == {"type": "abort", "message": EVICTED}
    assert 0 < reply["meta_info"]["completion_tokens"] < 1000


def test_loads_that_do_not_fit_are_refused_with_the_reason(clean, tiny_model_dir, weights_root, tmp_path_factory):
    good = make_adapter(tiny_model_dir, weights_root / "good", seed=6)

    def load(path, name="x"):
        return http(clean, "/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})

    def refused(path):
        status, reply = load(path)
        assert reply["success"] is False and reply["loaded_adapters"] == {}, reply  # a refused load changes nothing
        return status, reply["error_message"]

    outside = make_adapter(tiny_model_dir, tmp_path_factory.mktemp("elsewhere") / "a", seed=7)
    status, message = refused(outside)
    assert status == 403 and "--weights-root" in message
    status, message = refused(make_adapter(tiny_model_dir, weights_root / "rank16", seed=8, rank=16))
    assert status == 400 and "rank 16, above this server's --max-lora-rank 8" in message
    nan = weights_root / "nan"
    nan.mkdir()
    (nan / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
    tensors = load_file(str(good / "adapter_model.safetensors"))
    first = sorted(tensors)[0]
    tensors[first] = tensors[first].clone()
    tensors[first][0, 0] = float("nan")
    save_file(tensors, str(nan / "adapter_model.safetensors"))
    status, message = refused(nan)
    assert status == 400 and "non-finite" in message
    missing = weights_root / "missing"
    missing.mkdir()
    status, message = refused(missing)
    assert status == 400 and "no readable PEFT adapter config" in message
    assert load(good, "kept")[0] == 200
    status, reply = load(good, "kept")
    assert status == 400 and reply["error_message"] == "Failed to load LoRA adapter kept because it is already loaded"
    assert reply["loaded_adapters"] == {"kept": str(good)}
    status, reply = http(clean, "/unload_lora_adapter", {"lora_name": "other"})
    assert status == 400 and reply["error_message"].startswith("LoRA with name other does not exist.")
    # the base under an adapter is not replaced while the adapter is merged into it
    status, reply = http(clean, "/update_weights_from_disk", {"model_path": str(weights_root)})
    assert status == 400 and "unload it (/unload_lora_adapter)" in reply["message"]


def test_a_server_started_without_lora_refuses_adapters_as_sglang_does(cpu_server, tiny_model_dir, weights_root):
    status, reply = http(cpu_server, "/load_lora_adapter", {"lora_name": "a", "lora_path": str(weights_root)})
    assert status == 400 and reply["error_message"] == "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
    status, reply = probe(cpu_server, "a")
    assert status == 400 and "not loaded: a" in reply["error"]["message"]


def test_a_target_outside_the_servers_targets_is_refused(tiny_model_dir, tmp_path):
    server = start_cpu_server(tiny_model_dir, tmp_path, "--enable-lora", "--max-lora-rank", "8",
                              "--lora-target-modules", "q_proj", "v_proj")
    try:
        adapter = make_adapter(tiny_model_dir, tmp_path / "mlp", seed=9, targets=("q_proj", "down_proj"))
        status, reply = http(server.address, "/load_lora_adapter", {"lora_name": "a", "lora_path": str(adapter)})
        assert status == 400
        assert "targets down_proj, not among this server's --lora-target-modules q_proj v_proj" in reply["error_message"]
    finally:
        server.stop()
