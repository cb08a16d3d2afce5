"""Resuming a failed train run as Prefect users do: the UI's Retry button on a deployment run, and
`prefect flow-run retry` on a run started from the command line; a real Prefect API server on loopback, the
real `serve` and `prefect` processes."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import httpx
import pytest
import torch

from test_flows import (REPO, cli, fast_overrides, final_weights, serve_cli, stop_serve, wait_for_deployment,
                        wait_until)

ITERATIONS = 3
# A schedule that decays: a retry that laid it over other iterations than the first attempt would update with
# other learning rates, and end with other weights
LINEAR = ["trainer.optimizer.lr_scheduler_type=linear", "trainer.optimizer.min_lr_ratio=0.25"]


def block_iteration_2(run_dir: Path) -> Path:
    """The injected fault: a file where iteration 2's directory goes, so its rollout cannot write its shards (a
    deterministic error: the node fails at once, without retries) until the test removes it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    blocker = run_dir / "iter_2"
    blocker.write_text("not a directory\n")
    return blocker


async def _read_flow_run(flow_run_id):
    from prefect.client.orchestration import get_client

    async with get_client() as client:
        return await client.read_flow_run(flow_run_id)


async def _train_runs_of(run_id: str):
    """The parent `train` flow runs whose parameters name `run_id` (as `run_id=` or an override)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    async with get_client() as client:
        runs = await client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["train"])))
    return [r for r in runs if r.parameters.get("run_id") == run_id
            or f"run_id={run_id}" in (r.parameters.get("overrides") or [])]


async def _iteration_runs(run_id: str):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    async with get_client() as client:
        runs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_=f"{run_id}/iter-")))
    return sorted(((r.name, r.state.type.value) for r in runs), key=lambda pair: pair)


def wait_final(flow_run_id, timeout: float = 420, serve_log: Optional[Path] = None):
    """The flow run once in a final state; past `timeout` (below the test's own time-out, so that this message is
    the one reported) an error with its last state and the tail of serve's output."""
    try:
        return wait_until(lambda: (lambda r: r if r.state.is_final() else None)(
            asyncio.run(_read_flow_run(flow_run_id))), timeout, f"flow run {flow_run_id} to finish", interval=0.5)
    except AssertionError as e:
        state = asyncio.run(_read_flow_run(flow_run_id)).state
        tail = serve_log.read_text()[-4000:] if serve_log is not None and serve_log.exists() else ""
        raise AssertionError(f"{e}; its state: {state.type.value} ({state.name}: {state.message}); "
                             f"serve's output ends:\n{tail}") from None


def assert_resumed(run_id: str, tmp_path: Path, reference: dict,
                   iteration_runs: list[tuple[str, str]]) -> None:
    """The iteration runs are `iteration_runs`: iteration 2 failed and ran again (iteration 1 not); the weights are
    those of a run that never failed."""
    assert asyncio.run(_iteration_runs(run_id)) == iteration_runs
    weights = final_weights(tmp_path / run_id, ITERATIONS)
    lrs = [json.loads(line)["lr"] for line in (tmp_path / run_id / "metrics.jsonl").read_text().splitlines()]
    assert lrs == reference["lr"]  # the schedule of a run that never failed, iteration by iteration
    assert weights.keys() == reference["weights"].keys()
    assert all(torch.equal(weights[n], reference["weights"][n]) for n in weights)
    assert len(lrs) == ITERATIONS  # the retry trained to the end first asked for, no further
    from areal_pipeline.run_spec import load_config

    saved = load_config(tmp_path / run_id / "config.yaml")  # the plan it trained, not the retry's own count
    assert (saved.total_iterations, saved.trainer.optimizer.schedule_iterations) == (ITERATIONS, ITERATIONS)


@pytest.fixture(scope="module")
def reference(prefect_api, tiny_model_dir, tmp_path_factory) -> dict:
    """The final weights and the learning rates of the same run never failing (run once: both tests resume to
    it)."""
    from flows.train import train

    out = tmp_path_factory.mktemp("reference")
    train(config_path=str(REPO / "configs/tiny_cpu.yaml"),
          overrides=[*fast_overrides(out, tiny_model_dir, run_id="ref", iterations=ITERATIONS), *LINEAR])
    lrs = [json.loads(line)["lr"] for line in (out / "ref" / "metrics.jsonl").read_text().splitlines()]
    assert len(set(lrs)) == ITERATIONS  # the rate changes every iteration
    return {"weights": final_weights(out / "ref", ITERATIONS), "lr": lrs}


def test_the_ui_retry_button_resumes_a_failed_deployment_run(prefect_api, tiny_model_dir, reference, tmp_path):
    """A deployment run (started as from the UI's Run button, `iterations=3`) fails in iteration 2; once the fault
    is gone, the UI's Retry button (the very request it sends) has the served deployment run it again, and it
    finishes iterations 2 and 3 only."""
    from prefect.client.orchestration import get_client

    blocker = block_iteration_2(tmp_path / "ui")
    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    serve = serve_cli(tmp_path / "serve.log", "--config", "configs/tiny_cpu.yaml", "--iterations", str(ITERATIONS),
                      *fast_overrides(tmp_path, tiny_model_dir, run_id="ui"), *LINEAR, env=env)
    try:
        async def start_run():
            async with get_client() as client:
                deployment = await wait_for_deployment(client, "train/train", run_id="ui")
                return (await client.create_flow_run_from_deployment(deployment.id)).id

        flow_run_id = asyncio.run(start_run())
        failed = wait_final(flow_run_id, serve_log=tmp_path / "serve.log")
        assert failed.state.is_failed(), failed.state
        blocker.unlink()
        reply = httpx.post(f"{prefect_api}/flow_runs/{flow_run_id}/set_state",
                           json={"state": {"type": "SCHEDULED", "name": "AwaitingRetry"}})
        assert reply.status_code in (200, 201) and reply.json()["status"] == "ACCEPT", reply.text
        retried = wait_final(flow_run_id, serve_log=tmp_path / "serve.log")
        assert retried.state.is_completed() and retried.run_count == 2, retried.state
    finally:
        stop_serve(serve)
    assert_resumed("ui", tmp_path, reference, [
        ("ui/iter-1", "COMPLETED"), ("ui/iter-2", "COMPLETED"), ("ui/iter-2", "FAILED"), ("ui/iter-3", "COMPLETED")])


def test_prefect_flow_run_retry_resumes_a_failed_command_line_run(prefect_api, tiny_model_dir, reference,
                                                                   tmp_path):
    """`areal-pipeline train` against a standing Prefect server fails in iteration 2; `prefect flow-run retry ID
    --entrypoint flows/train.py:train` (the README's command) finishes it. Two iterations share a flow run: the
    retry runs that flow run's iteration 2 again, not its finished iteration 1."""
    blocker = block_iteration_2(tmp_path / "cli")
    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    run = cli("train", "--config", "configs/tiny_cpu.yaml",
              *fast_overrides(tmp_path, tiny_model_dir, run_id="cli", iterations=ITERATIONS, per_flow_run=2), *LINEAR,
              env=env)
    out, _ = run.communicate(timeout=600)
    assert run.returncode != 0, out[-3000:]
    assert "Retrying" not in out and "Not a directory" in out.strip().splitlines()[-1], out[-3000:]
    (failed,) = asyncio.run(_train_runs_of("cli"))
    assert failed.state.is_failed()
    blocker.unlink()
    retry = subprocess.run([str(Path(sys.executable).parent / "prefect"), "flow-run", "retry", str(failed.id),
                            "--entrypoint", "flows/train.py:train"], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=600)
    assert retry.returncode == 0, (retry.stdout + retry.stderr)[-3000:]
    retried = asyncio.run(_read_flow_run(failed.id))
    assert retried.state.is_completed() and retried.run_count == 2, retried.state
    assert_resumed("cli", tmp_path, reference, [
        ("cli/iter-1..2", "COMPLETED"), ("cli/iter-1..2", "FAILED"), ("cli/iter-3", "COMPLETED")])
    assert [json.loads(line)["iteration"] for line in (tmp_path / "cli" / "metrics.jsonl").read_text().splitlines()
            ] == [1, 2, 3]  # iteration 1 recorded once

