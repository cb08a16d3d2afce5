"""What every workflow shares: the sequence builder, per-token returns from the shards to the advantages, the
registry; and the helpers the other test_workflows_* files use to check trajectories token by token."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Callable

import pyarrow.parquet as pq
import pytest
import torch

from areal_pipeline.checksums import file_entry
from areal_pipeline.config import ConfigError
from areal_pipeline.data.shards import read_table, read_trajectories, write_shards
from areal_pipeline.data.trajectory import NO_VERSION, SequenceBuilder, Trajectory
from areal_pipeline.inference.types import ModelRequest, ModelResponse
from areal_pipeline.rollout.group import run_group
from areal_pipeline.run_spec import build_workflow, load_config
from areal_pipeline.training.advantages import normalize_advantages
from areal_pipeline.training.batches import compute_batch, pad
from areal_pipeline.workflows import WORKFLOWS

# ---------------------------------------------------------------------------------------------- helpers


class InlinePool:
    """RewardPool's interface without worker processes, for scripted tests."""

    async def ascore(self, fn, *args) -> float:
        return float(fn(*args))

    async def ascore_many(self, fn, calls) -> list[float]:
        return [float(fn(*args)) for args in calls]


def play(workflow, engine, data: dict, n_samples: int = 1, baseline=None) -> list[Trajectory]:
    """One prompt's group of episodes as the rollout plays it (rollout/group.py), from outside an event loop."""
    return asyncio.run(run_group(workflow, engine, data, n_samples, baseline))


class ScriptedEngine:
    """An engine whose outputs come from `respond(request, turn)` (turn counted per rid), with made-up
    logprobs and version 3; it records every request and response."""

    VERSION = 3

    def __init__(self, respond: Callable[[ModelRequest, int], list[int]], stop_reason: str = "stop"):
        self.respond, self.stop_reason = respond, stop_reason
        self.calls: list[tuple[ModelRequest, ModelResponse]] = []

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        turn = sum(r.rid == req.rid for r, _ in self.calls)
        out = list(self.respond(req, turn))[: req.sampling.max_new_tokens]
        resp = ModelResponse(input_tokens=list(req.input_ids), output_tokens=out,
                             output_logprobs=[-0.01 * (i + 1) for i in range(len(out))],
                             output_versions=[self.VERSION] * len(out), stop_reason=self.stop_reason, latency=0.0,
                             server="scripted")
        self.calls.append((req, resp))
        return resp

    async def agenerate_group(self, reqs: list[ModelRequest]) -> list[ModelResponse]:
        return [await self.agenerate(req) for req in reqs]


class RecordingEngine:
    """Wraps a real engine and records what each request carried and what came back."""

    def __init__(self, engine):
        self.engine = engine
        self.calls: list[tuple[ModelRequest, ModelResponse]] = []

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        resp = await self.engine.agenerate(req)
        self.calls.append((req, resp))
        return resp

    async def agenerate_group(self, reqs: list[ModelRequest]) -> list[ModelResponse]:
        responses = await self.engine.agenerate_group(reqs)  # the real batched call
        self.calls.extend(zip(reqs, responses))
        return responses


def assert_token_invariants(t: Trajectory, calls: list[tuple[ModelRequest, ModelResponse]],
                            prompt_ids: list[int]) -> list[tuple[ModelRequest, ModelResponse]]:
    """The trajectory is exactly what its requests were conditioned on plus what came back: each request's
    input_ids are a prefix of it, each response's tokens follow that prefix with loss_mask 1 and the
    response's logprobs and versions, and every other token has loss_mask 0, logprob 0, NO_VERSION.
    Returns the trajectory's calls, in order."""
    by_rid: dict[str, list] = {}
    for req, resp in calls:
        by_rid.setdefault(req.rid, []).append((req, resp))
    # An episode's turns share one rid (one server), and its last generation ends the trajectory.
    matches = [own for own in by_rid.values() if own[-1][0].input_ids + own[-1][1].output_tokens == t.input_ids]
    assert matches, "no episode's requests and responses make up this trajectory"
    own = matches[0]
    assert len(own) == t.num_turns
    assert t.input_ids[: len(prompt_ids)] == prompt_ids
    generated = set()
    for req, resp in own:
        start = len(req.input_ids)
        end = start + resp.output_len
        assert t.input_ids[:start] == req.input_ids, "a request was conditioned on another sequence"
        assert t.input_ids[start:end] == resp.output_tokens
        assert t.logprobs[start:end] == pytest.approx(resp.output_logprobs, abs=1e-6)
        assert t.versions[start:end] == resp.output_versions
        generated.update(range(start, end))
    for i in range(len(t.input_ids)):
        if i in generated:
            assert t.loss_mask[i] == 1
        else:
            assert (t.loss_mask[i], t.logprobs[i], t.versions[i]) == (0, 0.0, NO_VERSION), i
    return own


def assert_logprobs_match_model(model, t: Trajectory, atol: float = 1e-3) -> None:
    """A teacher-forced forward pass of the policy over the trained sequence gives the recorded logprobs:
    tokens, logprobs and positions line up across every turn."""
    ids = torch.tensor([t.input_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
    mask = torch.tensor(t.loss_mask[1:], dtype=torch.bool)
    torch.testing.assert_close(logp[mask], torch.tensor(t.logprobs[1:])[mask], atol=atol, rtol=0)


# ---------------------------------------------------------------------------------------------- sequence builder


def _resp(inputs, tokens, version=1):
    return ModelResponse(input_tokens=list(inputs), output_tokens=tokens, output_logprobs=[-0.5] * len(tokens),
                         output_versions=[version] * len(tokens), stop_reason="stop", latency=0.0)


def test_sequence_builder_appends_turns_and_environment():
    seq = SequenceBuilder([1, 2])
    seq.add_model_turn(_resp([1, 2], [3, 4], version=5))
    seq.add_environment([9])
    seq.add_model_turn(_resp([1, 2, 3, 4, 9], [6], version=6))
    t = seq.trajectory(prompt_id="p", group_id="p", sample_idx=0, reward=1.0,
                       token_returns=seq.turn_returns([0.5, 2.0]))
    assert t.input_ids == [1, 2, 3, 4, 9, 6] and t.num_turns == 2
    assert t.loss_mask == [0, 0, 1, 1, 0, 1]
    assert t.logprobs == [0.0, 0.0, -0.5, -0.5, 0.0, -0.5]
    assert t.versions == [NO_VERSION, NO_VERSION, 5, 5, NO_VERSION, 6]
    assert t.token_returns == [0.0, 0.0, 0.5, 0.5, 0.0, 2.0]
    with pytest.raises(ValueError, match="conditioned on a different sequence"):
        seq.add_model_turn(_resp([1, 2, 3], [7]))
    with pytest.raises(ValueError, match="1 returns for 2 model turns"):
        seq.turn_returns([1.0])
    with pytest.raises(ValueError, match="token_returns has 2 entries for 6 tokens"):
        Trajectory(prompt_id="p", group_id="p", sample_idx=0, input_ids=t.input_ids, loss_mask=t.loss_mask,
                   logprobs=t.logprobs, versions=t.versions, reward=0.0, token_returns=[1.0, 2.0])


# ---------------------------------------------------------------------------------------------- shards + advantages


def _trajectory(pid: str, k: int, prompt: int, turns: list[int], reward: float, returns=None) -> Trajectory:
    """`prompt` tokens, then model turns of the given lengths, each followed by one environment token;
    `returns(position)` gives the token returns on generated tokens."""
    mask = [0] * prompt
    for g in turns:
        mask += [1] * g + [0]
    return Trajectory(prompt_id=pid, group_id=pid, sample_idx=k, input_ids=list(range(len(mask))), loss_mask=mask,
                      logprobs=[-0.5 * m for m in mask], versions=[0 if m else NO_VERSION for m in mask],
                      reward=reward, stop_reason="stop",
                      token_returns=None if returns is None else [returns(i) if m else 0.0 for i, m in enumerate(mask)])


def test_token_returns_round_trip_and_old_shards_stay_readable(tmp_path):
    with_returns = [_trajectory("p", 0, 3, [2, 2], 1.0, lambda i: 0.25)]
    write_shards(with_returns, tmp_path / "new", run_id="r", iteration=0)
    assert read_trajectories(tmp_path / "new") == with_returns
    # a shard written before the column existed
    write_shards([_trajectory("p", 0, 3, [2], 1.0), _trajectory("p", 1, 3, [2], 0.0)], tmp_path / "old",
                 run_id="r", iteration=0)
    part = tmp_path / "old" / "part-00000.parquet"
    pq.write_table(pq.read_table(part).drop(["token_returns"]), part)
    manifest = json.loads((tmp_path / "old" / "manifest.json").read_text())
    manifest["shards"][0].update(file_entry(part.read_bytes()))
    (tmp_path / "old" / "manifest.json").write_text(json.dumps(manifest))
    old = read_trajectories(tmp_path / "old")
    assert [t.token_returns for t in old] == [None, None] and old[0].loss_mask == [0, 0, 0, 1, 1, 0]
    table, _ = compute_batch(read_table(tmp_path / "old"), load_config().ppo)  # the usual path: GRPO
    advantages = table.column("advantages").to_pylist()
    assert advantages[0][3] > 0 > advantages[1][3]


def test_compute_batch_uses_token_returns_as_advantages(tmp_path):
    trajectories = [
        _trajectory("a", 0, 2, [2, 3], 0.81, lambda i: -1.09 if i < 4 else 1.0),
        _trajectory("a", 1, 2, [3], 1.0, lambda i: 1.0),
        _trajectory("b", 0, 4, [1, 1], 0.0, lambda i: -1.9 if i < 5 else -1.0),
    ]
    write_shards(trajectories, tmp_path, run_id="r", iteration=0)
    rollout = read_table(tmp_path)
    raw = [t.token_returns for t in trajectories]

    off = load_config(None, ["ppo.adv_norm.mean_level=none", "ppo.adv_norm.std_level=none",
                             "ppo.reward_scaling=5", "ppo.reward_bias=-1"]).ppo
    table, stats = compute_batch(rollout, off)
    # unchanged: no reward transform, no group normalisation, no discounting of the returns
    assert table.column("advantages").to_pylist() == [pytest.approx(r) for r in raw]
    assert table.column("returns").to_pylist() == [pytest.approx(r) for r in raw]
    assert table.column("task_reward").to_pylist() == pytest.approx([0.81, 1.0, 0.0])
    assert stats["reward_mean"] == pytest.approx((0.81 + 1.0) / 3)

    batch_norm = load_config().ppo  # adv_norm: batch mean/std over generated tokens
    table, _ = compute_batch(rollout, batch_norm)
    width = max(len(t.input_ids) for t in trajectories)
    mask = pad([t.loss_mask for t in trajectories], width)
    expected = normalize_advantages(pad(raw, width), mask, batch_norm.adv_norm)
    for row, n, exp in zip(table.column("advantages").to_pylist(), (len(t.input_ids) for t in trajectories), expected):
        assert row == pytest.approx(exp[:n].tolist(), abs=1e-5)

    mixed = trajectories[:1] + [_trajectory("c", 0, 2, [2], 1.0)]
    write_shards(mixed, tmp_path / "mixed", run_id="r", iteration=0)
    with pytest.raises(ValueError, match=r"mixes trajectories with token_returns \(1\) and without \(1\)"):
        compute_batch(read_table(tmp_path / "mixed"), off)


# ---------------------------------------------------------------------------------------------- registry


EXAMPLE_AGENT = Path(__file__).resolve().parents[1] / "examples" / "calculator_agent.py:agent"


def test_registry_builds_every_workflow_with_its_reward(tiny_model_dir, tmp_path):
    from areal_pipeline.model import load_tokenizer
    from areal_pipeline.rewards import exact_match_reward, f1_reward, math_reward

    tokenizer = load_tokenizer(tiny_model_dir)
    built = {}
    for name in WORKFLOWS:
        # the config refuses an OpenAI agent workflow without its agent
        needs = {"openai_agent": [f"rollout.agent.entry={EXAMPLE_AGENT}"]}
        cfg = load_config(None, [f"rollout.workflow={name}", f"output_dir={tmp_path}", *needs.get(name, [])])
        built[name] = build_workflow(cfg, tokenizer, InlinePool())
    assert [type(w).__name__ for w in built.values()] == [
        "RLVRWorkflow", "ReflectionWorkflow", "MultiTurnWorkflow", "SearchAgentWorkflow", "OpenAIAgentWorkflow",
        "GridWorldWorkflow"]
    # the pooled reward travels by reference; the pool's workers load it
    assert all(str(built[n].reward_fn) == "areal_pipeline.rewards.math:math_reward"
               and built[n].reward_fn.load() is math_reward for n in ("rlvr", "reflection", "multi_turn"))
    assert built["search_agent"].reward_fn is f1_reward
    assert type(built["search_agent"].retrieval).__name__ == "LocalRetrievalClient"  # no server address given
    cfg = load_config(None, ["rollout.workflow=search_agent", "rollout.agent.reward=exact_match",
                             f"output_dir={tmp_path}"])
    remote = build_workflow(cfg, tokenizer, InlinePool(), tool_addresses={"retrieval": "127.0.0.1:1"})
    assert remote.reward_fn is exact_match_reward and remote.retrieval.address == "127.0.0.1:1"
    with pytest.raises(ValueError, match="unknown workflow 'agent'; valid: rlvr, reflection, multi_turn, "
                                         "search_agent, openai_agent"):
        build_workflow(load_config(None, ["rollout.workflow=agent"]), tokenizer, InlinePool())
    with pytest.raises(ConfigError, match="rollout.agent.reward='bleu': must be one of f1, exact_match"):
        load_config(None, ["rollout.workflow=search_agent", "rollout.agent.reward=bleu"])  # refused at load
