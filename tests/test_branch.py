"""`areal-pipeline branch` and `--replay` on real runs (the warm-started default model, so that updates move the
weights): the parent's iterations are referenced (hard links), the branch starts from the parent's exact policy,
its new hyperparameters apply, a replay trains on the parent's very rollout shards; flow runs with their lineage."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
import torch

from _learning_helpers import base_model
from areal_pipeline.branching import BranchError, plan_branch
from areal_pipeline.config import ConfigError
from test_flows import REPO, assert_found_by_run_id, cli, fast_overrides, final_weights

PARENT_LR = 1e-3  # fast_overrides' learning rate


@pytest.fixture(scope="module")
def warm_model(model_cache) -> str:
    return base_model("tiny_cpu.yaml", model_cache)


@pytest.fixture(scope="module")
def parent(prefect_api, warm_model, tmp_path_factory) -> Path:
    """Run `p`: 4 iterations, a checkpoint at 3 and after the last (none at 1 or 2)."""
    from flows.train import train

    out = tmp_path_factory.mktemp("runs")
    train(config_path=str(REPO / "configs/tiny_cpu.yaml"),
          overrides=fast_overrides(out, Path(warm_model), run_id="p", iterations=4) + ["save_freq=3"])
    assert sorted(p.name for p in (out / "p" / "checkpoints").iterdir()) == ["step_3", "step_4"]
    return out / "p"


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


async def _flow_runs_named(prefix: str):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    async with get_client() as client:
        return await client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_=prefix)))


def test_a_branch_under_the_same_config_continues_the_parent_bitwise(parent):
    """Branch at 2, where the parent saved no checkpoint: its policy 2 is restored (initial weights + updates 1-2
    replayed under the parent's config); with nothing changed, iterations 3-4 reproduce the parent's weights."""
    from flows.branch import branch

    out = parent.parent
    result = branch(parent_run_id="p", at=2, run_id="same", output_dir=str(out), iterations=2)
    run_dir = out / "same"
    assert result["iterations"] == 4 and result["mode"] == "branch"
    record = json.loads((run_dir / "branch.json").read_text())
    assert (record["parent_run_id"], record["at"], record["mode"]) == ("p", 2, "branch")
    assert record["start_checkpoint"].startswith("restored") and record["hard_links"] is True
    # iterations 1..2 are the parent's files (hard links), not copies; 3..4 are the branch's own
    for k in (1, 2):
        assert os.path.samefile(run_dir / f"iter_{k}/metrics.json", parent / f"iter_{k}/metrics.json")
        assert os.path.samefile(run_dir / f"iter_{k}/rollout/part-00000.parquet",
                                parent / f"iter_{k}/rollout/part-00000.parquet")
    assert not os.path.samefile(run_dir / "iter_3/update.json", parent / "iter_3/update.json")
    # the initial policy's evaluation is the parent's too (iteration 0 of the curves), not made again
    assert os.path.samefile(run_dir / "iter_0/eval.json", parent / "iter_0/eval.json")
    assert [r["iteration"] for r in _records(run_dir)] == [1, 2, 3, 4]
    assert _records(run_dir)[:2] == _records(parent)[:2]
    assert _same_weights(final_weights(run_dir, 4), final_weights(parent, 4))

    # in Prefect: the branch's flow run, tagged with its parent, and the new run's train run as its child
    (branch_run,) = asyncio.run(_flow_runs_named("same: branch of p at 2"))
    assert branch_run.state.is_completed() and {"branch", "branch-of:p"} <= set(branch_run.tags)
    children = [r for r in asyncio.run(_flow_runs_named("%")) if r.parent_task_run_id is not None
                and r.parameters.get("run_id") == "same" and r.flow_id != branch_run.flow_id]
    assert children, "the train flow run of the branch"
    assert record["parent_flow_runs"]  # the parent's train flow run that trained iteration 2
    # the new run's train run is named after it; it and its iteration runs carry the parent's run id
    assert_found_by_run_id("same", ["same/iter-3", "same/iter-4"], "branch-of:p", config="config")


def test_a_branch_with_a_new_learning_rate_from_the_command_line(parent, prefect_api):
    """`areal-pipeline branch` at 3, where the parent saved a checkpoint: referenced, and the new learning rate
    is the one the branch's update uses."""
    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    out_dir = parent.parent
    run = cli("branch", "--from", "p", "--at", "3", "--run-id", "slow", "--iterations", "1",
              "--output-dir", str(out_dir), "trainer.optimizer.lr=5e-4", env=env)
    out, _ = run.communicate(timeout=600)
    assert run.returncode == 0, out[-3000:]
    assert f"branch slow of p at iteration 3: iterations 4..4 in {out_dir / 'slow'}" in out
    run_dir = out_dir / "slow"
    assert os.path.samefile(run_dir / "checkpoints/step_3/model/model.safetensors",
                            parent / "checkpoints/step_3/model/model.safetensors")
    records = _records(run_dir)
    assert [r["iteration"] for r in records] == [1, 2, 3, 4]
    assert records[3]["lr"] == pytest.approx(5e-4) and _records(parent)[3]["lr"] == pytest.approx(PARENT_LR)
    assert not _same_weights(final_weights(run_dir, 4), final_weights(parent, 4))
    assert json.loads((run_dir / "branch.json").read_text())["overrides"] == ["trainer.optimizer.lr=5e-4"]


def test_a_replay_retrains_on_the_parents_rollouts(parent):
    from flows.branch import branch

    out = parent.parent
    result = branch(parent_run_id="p", at=1, run_id="replayed", output_dir=str(out), mode="replay",
                    overrides=["trainer.optimizer.lr=2e-3"])
    run_dir = out / "replayed"
    assert result["mode"] == "replay" and result["regenerated"] == []
    mine, theirs = _records(run_dir), _records(parent)
    assert [r["iteration"] for r in mine] == [1, 2, 3, 4]
    for k in (2, 3, 4):  # the very shards: no new rollout
        assert os.path.samefile(run_dir / f"iter_{k}/rollout/manifest.json", parent / f"iter_{k}/rollout/manifest.json")
        assert not os.path.samefile(run_dir / f"iter_{k}/batch/manifest.json", parent / f"iter_{k}/batch/manifest.json")
        assert mine[k - 1]["reward_mean"] == theirs[k - 1]["reward_mean"]  # identical data
        assert mine[k - 1]["lr"] == pytest.approx(2e-3)
    assert mine[0] == theirs[0]
    assert not _same_weights(final_weights(run_dir, 4), final_weights(parent, 4))


def test_bad_branches_are_refused_with_the_reason(parent):
    out = parent.parent
    cases = [
        (dict(parent_dir=out / "nope", at=1, run_id="x"), "no run directory"),
        (dict(parent_dir=parent, at=0, run_id="x"), "K >= 1"),
        (dict(parent_dir=parent, at=5, run_id="x"), "finished iterations 1..4, so it cannot be branched at 5"),
        (dict(parent_dir=parent, at=2, run_id="p"), "run id of its own"),
        (dict(parent_dir=parent, at=2, run_id="x", overrides=["model.trust_remote_code=true"]), "model.* cannot change"),
        (dict(parent_dir=parent, at=2, run_id="x", overrides=["trainer.lora.enabled=true"]),
         r"trainer.lora.enabled cannot change in a branch: it continues the parent's adapters"),
        (dict(parent_dir=parent, at=2, run_id="x", overrides=["run_id=y"]), "--run-id"),
        (dict(parent_dir=parent, at=4, run_id="x"), "nothing to train"),
        (dict(parent_dir=parent, at=2, run_id="x", replay=True, overrides=["rollout.gconfig.temperature=0.5"]),
         "rollout.* cannot change in a replay"),
        (dict(parent_dir=parent, at=2, run_id="x", replay=True, iterations=5), "at most 2"),
    ]
    for kwargs, message in cases:
        with pytest.raises(BranchError, match=message.replace("*", r"\*").replace(".", r"\.")):
            plan_branch(**kwargs)
    with pytest.raises(ConfigError, match="trainer.optimizer.lr=-1"):
        plan_branch(parent, 2, "x", ["trainer.optimizer.lr=-1"])
    (out / "taken").mkdir()
    with pytest.raises(BranchError, match="already exists and is not a branch"):
        plan_branch(parent, 2, "taken")
