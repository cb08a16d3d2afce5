import json
import re
from pathlib import Path

import pytest

from areal_pipeline.config import DatasetConfig
from areal_pipeline.data.datasets import DatasetError, load_records
from conftest import TEST_DATA, data_dirs


def _arith(**kw) -> DatasetConfig:
    return DatasetConfig(name="arithmetic", **kw)


def _evaluate(question: str) -> int:
    a, op, b = re.fullmatch(r"What is (\d+)([-+*])(\d+)\?", question).groups()
    return {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]


def test_arithmetic_is_deterministic_and_seeded():
    cfg = _arith(arithmetic_operators=["+", "-", "*"])
    assert load_records(cfg, "train", seed=3) == load_records(cfg, "train", seed=3)
    assert load_records(cfg, "test", seed=3) == load_records(cfg, "test", seed=3)
    assert load_records(cfg, "train", seed=3) != load_records(cfg, "train", seed=4)


@pytest.mark.parametrize(
    "kw",
    [
        {},  # default: 100 distinct questions, fewer than train + test sizes
        {"arithmetic_operators": ["+", "-", "*"], "arithmetic_max_operand": 99},  # large space: sampled
    ],
)
def test_arithmetic_splits_are_disjoint_and_answers_correct(kw):
    cfg = _arith(**kw)
    train, test = load_records(cfg, "train", seed=1), load_records(cfg, "test", seed=1)
    assert len(train) == cfg.arithmetic_train_size
    assert 0 < len(test) <= cfg.arithmetic_test_size
    assert not {r["question"] for r in train} & {r["question"] for r in test}
    assert len({r["question"] for r in test}) == len(test)
    for r in train + test:
        assert r["answer"] == str(_evaluate(r["question"]))
        assert r["messages"] == [{"role": "user", "content": f"{r['question']} Answer with the number."}]
        assert int(r["answer"]) >= 0
    assert len({r["prompt_id"] for r in train}) == len(train)
    assert train[0]["prompt_id"] == "arithmetic-train-00000"


def test_arithmetic_sizes_system_prompt_and_bad_operator():
    cfg = _arith(max_train_size=5, max_test_size=2, system_prompt="Be brief.")
    train, test = load_records(cfg, "train", seed=1), load_records(cfg, "test", seed=1)
    assert (len(train), len(test)) == (5, 2)
    assert train[0]["messages"][0] == {"role": "system", "content": "Be brief."}
    assert train[0]["messages"][1]["role"] == "user"
    with pytest.raises(DatasetError, match="subset of"):
        load_records(_arith(arithmetic_operators=["/"]), "train", seed=1)


def test_unknown_dataset_lists_valid_names():
    with pytest.raises(DatasetError, match="arithmetic, gsm8k, search_qa"):
        load_records(DatasetConfig(name="mnist"), "train", seed=1)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.open() if line.strip()]


@pytest.mark.parametrize("gsm8k_dir", data_dirs("gsm8k"))
@pytest.mark.parametrize("as_dir", [True, False])
def test_gsm8k_local(as_dir, gsm8k_dir):
    path = gsm8k_dir if as_dir else gsm8k_dir / "test.jsonl"
    cfg = DatasetConfig(name="gsm8k", path=str(path), max_test_size=10)
    records = load_records(cfg, "test", seed=1)
    assert len(records) == 10
    first = _rows(gsm8k_dir / "test.jsonl")[0]
    r = records[0]
    assert r["prompt_id"] == "gsm8k-test-00000"
    assert r["question"] == first["question"]
    assert r["answer"] == first["answer"] and "####" in r["answer"]
    assert r["messages"][-1]["content"].startswith(first["question"])
    assert "The answer is" in r["messages"][-1]["content"]
    if as_dir:
        train = load_records(DatasetConfig(name="gsm8k", path=str(path)), "train", seed=1)
        assert [r["question"] for r in train] == [r["question"] for r in _rows(gsm8k_dir / "train.jsonl")]
        assert len(train) == (24 if gsm8k_dir.parent == TEST_DATA else 7473)  # the slice, the full train split


@pytest.mark.parametrize("hotpotqa_dir", data_dirs("hotpotqa"))
def test_search_qa_hotpotqa(hotpotqa_dir):
    qa = hotpotqa_dir / "qa.jsonl"
    records = load_records(DatasetConfig(name="search_qa", path=str(qa)), "train", seed=1)
    first = _rows(qa)[0]
    assert len(records) == (30 if hotpotqa_dir.parent == TEST_DATA else 300)
    assert records[0]["prompt_id"] == first["id"]
    assert records[0]["question"] == first["question"]
    assert records[0]["answer"] == first["answer"]
    assert all(isinstance(r["answer"], list) and r["answer"] for r in records)


def test_search_qa_string_answer_and_generated_ids(tmp_path):
    (tmp_path / "test.jsonl").write_text(json.dumps({"question": "Capital of France?", "answer": "Paris"}) + "\n\n")
    records = load_records(DatasetConfig(name="search_qa", path=str(tmp_path)), "test", seed=1)
    assert records == [
        {
            "prompt_id": "search_qa-test-00000",
            "messages": [{"role": "user", "content": "Capital of France?"}],
            "answer": ["Paris"],
            "question": "Capital of France?",
        }
    ]


@pytest.mark.parametrize(
    "name, lines, line_no, what",
    [
        ("gsm8k", ['{"question": "q", "answer": "#### 1"}'] * 2 + ['{"question": "q",'], 3, "invalid JSON"),
        ("gsm8k", ['{"question": "q", "answer": "#### 1"}', '{"question": "q"}'], 2, "missing field 'answer'"),
        ("gsm8k", ['{"question": "", "answer": "#### 1"}'], 1, "field 'question' is empty"),
        ("search_qa", ['{"question": "q", "answer": ["a"]}', '{"question": "q", "answer": [1]}'], 2, "list"),
        ("search_qa", ['{"question": "q", "answer": 5}'], 1, "must be a string"),
        ("search_qa", ['["q", "a"]'], 1, "expected a JSON object"),
        ("search_qa", ['{"id": "x", "question": "q", "answer": "a"}'] * 2, 2, "duplicate id 'x'"),
    ],
)
def test_malformed_rows_name_file_and_line(tmp_path, name, lines, line_no, what):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DatasetError) as err:
        load_records(DatasetConfig(name=name, path=str(path)), "train", seed=1)
    assert f"{path}, line {line_no}" in str(err.value)
    assert what in str(err.value)


def test_missing_paths_give_clear_errors(tmp_path):
    with pytest.raises(DatasetError, match="dataset path not found: /nonexistent/gsm8k/train.jsonl"):
        load_records(DatasetConfig(name="gsm8k", path="/nonexistent/gsm8k/train.jsonl"), "train", seed=1)
    (tmp_path / "train.jsonl").write_text("")
    with pytest.raises(DatasetError, match=r"has no test\.jsonl .*train\.jsonl"):
        load_records(DatasetConfig(name="gsm8k", path=str(tmp_path)), "test", seed=1)
    # an empty search_qa path serves the generated questions, which have a train and a test split only
    with pytest.raises(DatasetError, match="splits 'train' and 'test', not 'dev'"):
        load_records(DatasetConfig(name="search_qa"), "dev", seed=1)


@pytest.mark.parametrize("name", ["gsm8k", "search_qa"])
def test_file_without_rows_is_named(tmp_path, name):
    (tmp_path / "train.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n')
    (tmp_path / "test.jsonl").write_text("\n\n")
    with pytest.raises(DatasetError, match=rf"^{tmp_path / 'test.jsonl'}: no rows \(the file is empty\)$"):
        load_records(DatasetConfig(name=name, path=str(tmp_path)), "test", seed=1)


def test_local_looking_path_is_never_sent_to_the_hub(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # "data/train.jsonl" is a hub id in form, but names a file
    with pytest.raises(DatasetError, match="gsm8k: dataset path not found: data/train.jsonl"):
        load_records(DatasetConfig(name="gsm8k", path="data/train.jsonl"), "train", seed=1)
