import math

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


def test_warm_start_answers_in_format_and_leaves_room_for_rl(default_base_model):
    """The warm-started base model (configs/tiny_cpu.yaml's, built once a session) answers held-out questions with
    a number then end of turn, knows the sums (right or one too high almost always), but is right only about a
    third of the time: room for RL."""
    from areal_pipeline.config import DatasetConfig

    from areal_pipeline.data.datasets import load_records

    model_dir = default_base_model
    model, tokenizer = load_model(model_dir), load_tokenizer(model_dir)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def logprob(prompt: list[int], answer: int) -> float:
        target = tokenizer(str(answer))["input_ids"] + [eos]
        logits = model(torch.tensor([prompt + target])).logits[0, len(prompt) - 1:-1]
        return torch.log_softmax(logits, -1).gather(1, torch.tensor(target)[:, None]).sum().item()

    records = load_records(DatasetConfig(), "test", seed=1)[:12]  # never seen by the warm start
    right, habit, greedy = [], [], []
    with torch.no_grad():
        for r in records:
            prompt = tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True,
                                                   return_dict=False)
            out = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt):]
            assert out[-1] == eos and tokenizer.decode(out[:-1]).isdigit(), tokenizer.decode(out)
            greedy.append(tokenizer.decode(out[:-1]) == r["answer"])
            right.append(math.exp(logprob(prompt, int(r["answer"]))))
            habit.append(math.exp(logprob(prompt, int(r["answer"]) + 1)))
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    assert 0.1 <= mean(right) <= 0.5, right  # sampled pass@1
    assert mean(right) + mean(habit) >= 0.5, habit
    assert mean(greedy) <= 0.5


def test_length_sorted_micro_batches_give_one_padded_batchs_loss_and_gradients():
    """`pretrain_micro_batches`: rows of very different lengths, run in groups of similar length with gradients
    accumulated, give the loss and gradients of the whole batch padded to its longest row."""
    import random

    from transformers import Qwen2ForCausalLM

    from areal_pipeline.model import build_byte_tokenizer, tiny_qwen2_config
    from areal_pipeline.warm_start import IGNORE, _accumulate_by_length, _padded

    tokenizer = build_byte_tokenizer()
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(tiny_qwen2_config(tokenizer, TinyModelConfig(hidden_size=32, intermediate_size=64,
                                                                          num_hidden_layers=2)))
    rng = random.Random(0)
    rows = [[rng.randrange(3, 200) for _ in range(n)] for n in (5, 60, 7, 41, 12, 33, 9)]
    # the first tokens unlabelled (a prompt), and one row labelled from its first token on
    targets = [[IGNORE] * (len(r) // 2) + r[len(r) // 2:] for r in rows[:-1]] + [list(rows[-1])]

    whole = model(**_padded(tokenizer, rows, targets)).loss
    whole.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    for micro_batches in (2, 3, 7):
        accumulated = _accumulate_by_length(model, tokenizer, rows, targets, micro_batches)
        assert abs(accumulated - whole.item()) < 1e-5, micro_batches
        for name, parameter in model.named_parameters():
            torch.testing.assert_close(parameter.grad, expected[name], rtol=1e-4, atol=1e-6, msg=name)
        model.zero_grad()


def test_the_warm_start_takes_the_micro_batches_it_is_given(tmp_path):
    """A few steps with and without `pretrain_micro_batches`: the same training up to rounding, by another path."""
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, pretrain_steps=3, pretrain_batch_size=8)
    one = load_model(build_tiny_model(tmp_path / "one", TinyModelConfig(**small)))
    four = load_model(build_tiny_model(tmp_path / "four", TinyModelConfig(**small, pretrain_micro_batches=4)))
    pairs = list(zip(one.state_dict().values(), four.state_dict().values()))
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in pairs)
    assert not all(torch.equal(a, b) for a, b in pairs)  # the micro-batches ran: rounding differs somewhere
