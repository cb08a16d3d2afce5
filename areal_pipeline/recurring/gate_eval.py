"""The gate's evaluation: the champion and the candidate answer the same held-out prompts, greedily, once each, on
inference servers of the gate's own (the line's inference settings): started on the champion's weights, which are
then swapped for the candidate's (one start for both). Each policy's probe logprobs are read off those servers
too: computed by a server that loaded the checkpoint from disk, they are what the line's production servers must
give once they serve it (publish.py)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from areal_pipeline.config import ExperimentConfig
from areal_pipeline.data.datasets import load_records
from areal_pipeline.utils import run_async

ANSWERS_SHOWN = 6  # prompts whose two answers the approval form and the gate's artifact show


def run_gate(cfg: ExperimentConfig, out: Path, data_dir: str, champion: tuple[str, int], candidate: tuple[str, int],
             seed: int) -> dict[str, Any]:
    """The gate's record (gate.py's figures and decision, both policies' probe logprobs, a few answers side by
    side), written to `out` once: a resumed firing finds it and the gate decides no differently."""
    from areal_pipeline.recurring.gate import decide
    from areal_pipeline.run_dir import read_json, write_json

    record = read_json(out)
    if record is not None:
        return record
    results, prompts = evaluate_policies(cfg, data_dir, [("champion", *champion), ("candidate", *candidate)],
                                         out.parent / "logs" / "gate")
    rewards = {name: {p: v["reward"] for p, v in result["per_prompt"].items()} for name, result in results.items()}
    r = cfg.recurring
    record = decide(rewards["champion"], rewards["candidate"], test=r.gate_test, min_improvement=r.min_improvement,
                    confidence=r.confidence, resamples=r.gate_resamples, seed=seed)
    record.update(
        policies={name: {k: result[k] for k in ("model", "version", "pass_at_1", "reward_mean", "seconds")}
                  for name, result in results.items()},
        probe={name: result["probe"] for name, result in results.items()},
        per_prompt={p: {name: rewards[name][p] for name in rewards} for p in sorted(prompts)},
        answers=answers_side_by_side(results, prompts))
    return write_json(out, record)


def evaluate_policies(cfg: ExperimentConfig, data_dir: str, policies: list[tuple[str, str, int]],
                      log_dir: Path) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """`policies`: (name, model directory, version) in order; each one's per-prompt rewards and answers on the
    firing's gate prompts (`data_dir`/test.jsonl) and its probe logprobs, by name; and the prompts' records by id."""
    from areal_pipeline.inference.weight_check import probe_ids
    from areal_pipeline.pipeline import Pipeline
    from areal_pipeline.policy_eval import evaluate_policy

    gate_cfg = copy.deepcopy(cfg)
    gate_cfg.dataset.path = data_dir
    gate_cfg.model.path = policies[0][1]
    gate_cfg.eval_max_prompts = 0  # the gate's prompts are already the ones it scores
    gate_cfg.trainer.lora.push = "merged"  # the gate's servers load model directories (merged policies), not adapters
    records = load_records(gate_cfg.dataset, gate_cfg.dataset.test_split, gate_cfg.seed)
    pipeline = Pipeline(gate_cfg, log_dir=log_dir)
    results: dict[str, dict[str, Any]] = {}
    try:
        pipeline.services.start_tools()
        pipeline.services.start_inference()
        probe = probe_ids(pipeline.tokenizer)
        for i, (name, model_dir, version) in enumerate(policies):
            if i:
                run_async(_load(pipeline, model_dir, version))
            record = evaluate_policy(gate_cfg, pipeline._engine, records, pipeline.tokenizer, pipeline.reward_pool,
                                     pipeline._tool_kwargs(), per_prompt=True)
            results[name] = {"model": model_dir, "version": version, "per_prompt": record["per_prompt"],
                             "pass_at_1": record["pass_at_1"], "reward_mean": record["reward_mean"],
                             "probe": run_async(_probe(pipeline, probe)), "seconds": record["seconds"]}
    finally:
        pipeline.close()
        pipeline.services.stop()
    missing = [r["prompt_id"] for r in records for name in results if r["prompt_id"] not in results[name]["per_prompt"]]
    if missing:
        raise RuntimeError(f"the gate's evaluation left prompts unscored (e.g. {missing[:3]}): its episodes failed")
    return results, {r["prompt_id"]: r for r in records}


async def _load(pipeline, model_dir: str, version: int) -> None:
    async with pipeline._engine() as engine:
        await engine.update_weights(model_dir, version)


async def _probe(pipeline, probe: list[int]) -> list[float]:
    async with pipeline._engine() as engine:
        return [float(v) for v in await engine.probe_logprobs(engine.addresses[0], probe)]


def answers_side_by_side(results: dict[str, dict[str, Any]], prompts: dict[str, dict[str, Any]],
                         shown: int = ANSWERS_SHOWN) -> list[dict[str, Any]]:
    """A few prompts with both policies' answers and rewards: first those where they differ (what a person
    approving wants to read), then others."""
    champion, candidate = results["champion"], results["candidate"]
    ids = sorted(prompts)
    differing = [p for p in ids if champion["per_prompt"][p]["reward"] != candidate["per_prompt"][p]["reward"]]
    chosen = (differing + [p for p in ids if p not in differing])[:shown]
    return [{"prompt_id": p, "prompt": prompts[p].get("question") or _prompt_text(prompts[p]),
             "answer": prompts[p].get("answer"),
             "champion": champion["per_prompt"][p], "candidate": candidate["per_prompt"][p]} for p in chosen]


def _prompt_text(record: dict[str, Any]) -> str:
    return next((m["content"] for m in reversed(record["messages"]) if m["role"] == "user"), "")
