"""Evaluation scores what it should: greedy pass@1 of a real CPU server on the records it is given (the test
split), bounded by eval_max_prompts, against answers known from an independent greedy decode of the model."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from areal_pipeline.data.datasets import load_records
from areal_pipeline.evaluation import evaluate_checkpoint
from areal_pipeline.inference.backend import engine_for
from areal_pipeline.policy_eval import evaluate_policy
from areal_pipeline.model import load_model, load_tokenizer
from areal_pipeline.pipeline import Pipeline
from areal_pipeline.rewards.math import extract_answer
from areal_pipeline.rewards.pool import RewardPool
from areal_pipeline.rollout.executor import run_episodes
from areal_pipeline.run_spec import build_workflow, load_config
from areal_pipeline.utils import run_async
from areal_pipeline.workflows.rlvr import chat_prompt_ids
from conftest import start_cpu_server

MAX_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def answering_model(default_base_model) -> Path:
    """The CPU default's warm-started base (built once a session): it answers every arithmetic question with a
    number, and not the same one for every question (the random model's greedy answer is blank lines)."""
    return Path(default_base_model)


@pytest.fixture(scope="module")
def server(answering_model, tmp_path_factory):
    process = start_cpu_server(answering_model, tmp_path_factory.mktemp("server-logs"))
    yield process.address
    process.stop()


@pytest.fixture(scope="module")
def reward_pool():
    pool = RewardPool(max_workers=1, timeout=30)
    yield pool
    pool.close()


def greedy_tokens(model_dir: Path, records: list[dict], max_new_tokens: int = MAX_NEW_TOKENS) -> list[list[int]]:
    """The tokens the model answers each record with greedily (its end of turn included), decoded in this
    process by transformers, not by the server."""
    tokenizer, model = load_tokenizer(model_dir), load_model(model_dir)
    answers = []
    for record in records:
        ids = torch.tensor([chat_prompt_ids(tokenizer, record["messages"])])
        with torch.no_grad():
            out = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens)
        answers.append(out[0, ids.shape[1]:].tolist())
    return answers


def greedy_completions(model_dir: Path, records: list[dict], max_new_tokens: int = MAX_NEW_TOKENS) -> list[str]:
    tokenizer = load_tokenizer(model_dir)
    return [tokenizer.decode(tokens, skip_special_tokens=True)
            for tokens in greedy_tokens(model_dir, records, max_new_tokens)]


def with_answers(records: list[dict], completions: list[str], right: list[bool]) -> list[dict]:
    """The records with the model's greedy answer as reference where `right`, and that answer plus one (which
    the model cannot produce greedily: it has one greedy answer) elsewhere."""
    out = []
    for record, completion, is_right in zip(records, completions, right):
        answer = int(extract_answer(completion))
        out.append({**record, "answer": str(answer if is_right else answer + 1)})
    return out


@pytest.fixture(scope="module")
def questions(answering_model):
    """Twelve test questions, the model's greedy completions of them and their lengths in tokens."""
    records = load_records(load_config(None, []).dataset, "test", seed=1)[:12]
    tokens = greedy_tokens(answering_model, records)
    tokenizer = load_tokenizer(answering_model)
    completions = [tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
    assert all(extract_answer(c) is not None for c in completions), completions
    assert len({extract_answer(c) for c in completions}) > 1, completions  # answers that tell records apart
    return records, completions, [len(t) for t in tokens]


def eval_config(tmp_path: Path, model_dir: Path, *overrides: str):
    return load_config(None, [f"output_dir={tmp_path}", f"model.path={model_dir}", "rollout.workflow=rlvr",
                              f"rollout.gconfig.max_new_tokens={MAX_NEW_TOKENS}", "rollout.gconfig.n_samples=4",
                              "rollout.gconfig.temperature=1.0", *overrides])


def evaluate(cfg, server: str, records: list[dict], tokenizer, reward_pool) -> dict:
    return evaluate_policy(cfg, lambda: engine_for([server], cfg.inference), records, tokenizer, reward_pool, {})


def test_pass_at_1_is_one_on_the_greedy_answers_and_zero_on_any_other(answering_model, server, reward_pool,
                                                                        questions, tmp_path):
    records, completions, lengths = questions
    cfg = eval_config(tmp_path, answering_model)
    tokenizer = load_tokenizer(answering_model)
    right = evaluate(cfg, server, with_answers(records, completions, [True] * 12), tokenizer, reward_pool)
    wrong = evaluate(cfg, server, with_answers(records, completions, [False] * 12), tokenizer, reward_pool)
    assert (right["num_prompts"], right["pass_at_1"], right["reward_mean"]) == (12, 1.0, 1.0)
    assert (wrong["num_prompts"], wrong["pass_at_1"], wrong["reward_mean"]) == (12, 0.0, 0.0)
    # one sample per prompt, the greedy one: the server's completions are transformers' greedy ones
    assert [s["completion"] for s in right["samples"]] == completions[:4]
    assert [s["prompt"] for s in right["samples"]] == [r["messages"][-1]["content"] for r in records[:4]]
    assert right["response_length"] == pytest.approx(sum(lengths) / 12)


def test_evaluation_decodes_greedily_where_sampling_would_not(answering_model, server, reward_pool, questions,
                                                             tmp_path):
    records, completions, _ = questions
    cfg = eval_config(tmp_path, answering_model)
    tokenizer = load_tokenizer(answering_model)
    scored = with_answers(records, completions, [True] * 12)
    first, second = (evaluate(cfg, server, scored, tokenizer, reward_pool) for _ in range(2))
    first.pop("seconds"), second.pop("seconds")  # how long each took: all that may differ
    assert first == second and first["pass_at_1"] == 1.0

    # the same workflow sampling at the config's temperature (seeded, so this holds run after run) misses some
    # of the greedy answers: an evaluation that sampled would score below 1
    workflow = build_workflow(dataclasses.replace(cfg, rollout=dataclasses.replace(
        cfg.rollout, gconfig=dataclasses.replace(cfg.rollout.gconfig, n_samples=1))), tokenizer, reward_pool)

    async def sample():
        async with engine_for([server], cfg.inference) as engine:
            return await run_episodes(workflow, engine, [{**r, "sampling_seed": i} for i, r in enumerate(scored)],
                                      max_concurrent_rollouts=12, progress=False)
    sampled = run_async(sample())
    assert [t.text for t in sampled] != completions
    assert sum(t.reward for t in sampled) < 12


def test_eval_max_prompts_bounds_the_records_scored(answering_model, server, reward_pool, questions, tmp_path):
    records, completions, _ = questions
    right = [True, False, True, True, False, False, True, False, False, False, True, False]
    scored = with_answers(records, completions, right)
    tokenizer = load_tokenizer(answering_model)
    for limit, expected_right, expected_prompts in ((3, 2, 3), (5, 3, 5), (0, 5, 12), (50, 5, 12)):
        cfg = eval_config(tmp_path, answering_model, f"eval_max_prompts={limit}")
        result = evaluate(cfg, server, scored, tokenizer, reward_pool)
        assert result["num_prompts"] == expected_prompts, limit
        assert result["pass_at_1"] == pytest.approx(expected_right / expected_prompts), limit
        assert result["reward_mean"] == pytest.approx(expected_right / expected_prompts), limit


def write_gsm8k_splits(directory: Path, model_dir: Path) -> tuple[int, int]:
    """A gsm8k-style data set whose test split the model answers right (greedily) and whose train split, the
    same questions and one more, it answers wrong: (train rows, test rows)."""
    questions = [r["question"] for r in load_records(load_config(None, []).dataset, "test", seed=1)[:6]]
    splits = {"train": questions, "test": questions[:5]}
    directory.mkdir(parents=True)
    for split, rows in splits.items():
        (directory / f"{split}.jsonl").write_text("".join(json.dumps({"question": q, "answer": "#### 0"}) + "\n"
                                                          for q in rows))
    cfg = load_config(None, ["dataset.name=gsm8k", f"dataset.path={directory}"])
    for split, right in (("train", False), ("test", True)):
        records = load_records(cfg.dataset, split, seed=1)
        completions = greedy_completions(model_dir, records)
        answers = [int(extract_answer(c)) + (0 if right else 1) for c in completions]
        (directory / f"{split}.jsonl").write_text("".join(json.dumps({"question": q, "answer": f"#### {a}"}) + "\n"
                                                          for q, a in zip(splits[split], answers)))
    return len(splits["train"]), len(splits["test"])


def test_the_evaluate_node_and_evaluate_checkpoint_score_the_test_split(answering_model, tmp_path):
    """pass@1 1.0 on the test split the model answers right, where the train split's would be 0.0: the node
    of an iteration and `evaluate_checkpoint` (the evaluate flow) read the test split, and all of it."""
    train_rows, test_rows = write_gsm8k_splits(tmp_path / "data", answering_model)
    cfg = eval_config(tmp_path, answering_model, "run_id=ev", "dataset.name=gsm8k", f"dataset.path={tmp_path / 'data'}",
                      "eval_freq=1", "inference.num_servers=1", "inference.num_threads=1")

    result = evaluate_checkpoint(cfg, answering_model)
    assert (result["model"], result["num_prompts"], result["pass_at_1"]) == (str(answering_model), test_rows, 1.0)

    pipeline = Pipeline(cfg)
    try:
        pipeline.services.start_inference()
        node = pipeline.evaluate(0)  # version 0: the base model the servers start with
    finally:
        pipeline.close()
        pipeline.services.stop()
    assert (node["version"], node["num_prompts"], node["pass_at_1"], node["cached"]) == (0, test_rows, 1.0, False)
    assert json.loads(pipeline.paths.evaluation(0).read_text())["pass_at_1"] == 1.0

    # the same data with the train split named as the one to score: the wrong answers are found
    swapped = dataclasses.replace(cfg, dataset=dataclasses.replace(cfg.dataset, test_split="train"))
    result = evaluate_checkpoint(swapped, answering_model)
    assert (result["num_prompts"], result["pass_at_1"]) == (train_rows, 0.0)
