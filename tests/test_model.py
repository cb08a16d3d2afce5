import torch

from areal_pipeline.config import TinyModelConfig
from areal_pipeline.model import build_tiny_model, eos_token_ids, load_model, load_tokenizer, resolve_model_path


def test_tiny_model_is_an_ordinary_hf_directory(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in tiny_model_dir.iterdir()}
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert model.config.model_type == "qwen2" and model.config.vocab_size == len(tokenizer)
    out = model(torch.tensor([[1, 2, 3]])).logits
    assert out.shape == (1, 3, len(tokenizer))


def test_byte_tokenizer_round_trips_and_chat_template(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    text = "What is 12+30? Ünïcode ✓"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text.encode()) and tokenizer.decode(ids) == text
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                           tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert eos_token_ids(tokenizer) == [tokenizer.convert_tokens_to_ids("<|im_end|>")]


def test_build_is_deterministic_and_configurable(tmp_path):
    a = load_model(build_tiny_model(tmp_path / "a", seed=3))
    b = load_model(build_tiny_model(tmp_path / "b", seed=3))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    big = load_model(build_tiny_model(tmp_path / "c", TinyModelConfig(hidden_size=64, num_hidden_layers=2)))
    assert big.config.hidden_size == 64 and big.config.num_hidden_layers == 2


def test_resolve_model_path_builds_embedded_model_once(tmp_path):
    from areal_pipeline.config import ModelConfig

    path = resolve_model_path(ModelConfig(), tmp_path, seed=1)
    mtime = (tmp_path / "_models").stat().st_mtime_ns
    assert resolve_model_path(ModelConfig(), tmp_path, seed=1) == path
    assert (tmp_path / "_models").stat().st_mtime_ns == mtime
    assert resolve_model_path(ModelConfig(path="Qwen/Qwen2.5-0.5B-Instruct"), tmp_path, 1) == "Qwen/Qwen2.5-0.5B-Instruct"
