"""A node runs the same wherever it runs: handed the run's context (its directory and its services' addresses,
areal_pipeline/run_context.py) and its inputs, an iteration's nodes each run in a new process (`areal-pipeline node`,
what a worker elsewhere runs) against a run's live services write the same shards and reach the same weights as the
train flow. A node whose services are gone fails at once, naming them, and starts nothing of its own."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from areal_pipeline.config import save_config
from areal_pipeline.data.shards import content_sha256, read_table
from areal_pipeline.pipeline import Pipeline
from areal_pipeline.run_context import RunContext, attach, context_of, run_attached_node
from areal_pipeline.run_dir import read_json, run_lock
from areal_pipeline.run_spec import load_config
from areal_pipeline.services import NotOwnedError, ServiceGoneError
from areal_pipeline.steps import due_steps

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "tiny_cpu.yaml"
NODE_TIMEOUT_S = 300
# The server's logprobs depend on which requests share a decode batch, which timing decides: one request a batch,
# so that both runs roll out the very same rows.
ONE_REQUEST_A_BATCH = "inference.max_batch_size=1"
# The untrained model answers nothing right: rewards shifted and left unnormalised give every sampled token an
# advantage, so that the update moves the weights.
EVERY_TOKEN_ADVANTAGED = ["ppo.reward_bias=-0.5", "ppo.reward_norm.mean_level=none", "ppo.reward_norm.std_level=none",
                          "ppo.adv_norm.mean_level=none", "ppo.adv_norm.std_level=none"]


def overrides(tiny_model_dir: Path, output_dir: Path) -> list[str]:
    """One short iteration that checkpoints (it is the run's last), without evaluation."""
    return [f"output_dir={output_dir}", f"model.path={tiny_model_dir}", "run_id=nodes", "total_iterations=1",
            "eval_freq=0", "rollout.batch_size=4", "rollout.gconfig.n_samples=2", "rollout.gconfig.max_new_tokens=8",
            "dataset.arithmetic_train_size=64", ONE_REQUEST_A_BATCH, *EVERY_TOKEN_ADVANTAGED]


def node_in_a_new_process(step: str, k: int, context: dict, inputs: list, timeout: float = NODE_TIMEOUT_S):
    return subprocess.run([sys.executable, "-m", "cli", "node", step, str(k), "--context", json.dumps(context),
                           "--inputs", json.dumps(inputs)], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def model_weights(run_dir: Path, k: int) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"step_{k}" / "model" / "model.safetensors"))


def test_an_iterations_nodes_in_new_processes_match_the_flow(prefect_api, tiny_model_dir, tmp_path):
    from flows.train import train

    train(config_path=str(CONFIG), overrides=overrides(tiny_model_dir, tmp_path / "flow"))
    by_flow = tmp_path / "flow" / "nodes"

    cfg = load_config(CONFIG, overrides(tiny_model_dir, tmp_path / "apart"))
    pipeline = Pipeline(cfg)
    with run_lock(cfg.run_dir):
        try:
            pipeline.start()
            context = context_of(pipeline).to_dict()
            served_by = {s.address: s.popen.pid for s in pipeline.services.inference}
            outputs: dict[str, dict] = {}
            steps = due_steps(pipeline, 1)
            assert [s.name for s in steps] == ["rollout", "advantages", "ppo_update", "broadcast_weights", "checkpoint"]
            for step in steps:
                done = node_in_a_new_process(step.name, 1, context, [outputs.get(name) for name in step.inputs])
                assert done.returncode == 0, done.stderr[-3000:]
                outputs[step.name] = json.loads(done.stdout.strip().splitlines()[-1])
                assert outputs[step.name].get("cached") is not True, (step.name, outputs[step.name])
            assert outputs["ppo_update"]["version"] == 1 and outputs["broadcast_weights"]["pushed"] is True
            # the new processes drove this run's own services, and started none
            assert pipeline.services.trainer_client.call("status")["version"] == 1
            pipeline.services.forget_served()
            assert pipeline.server_versions() == [1]
            assert {s.address: s.popen.pid for s in pipeline.services.inference} == served_by
            assert all(s.popen.poll() is None for s in pipeline.services.inference)
            assert_cached_from_the_context_alone(context)
        finally:
            pipeline.close()
            pipeline.services.stop()

    apart = cfg.run_dir
    for output in ("rollout", "batch"):
        assert content_sha256(read_table(apart / "iter_1" / output, schema=None)) == content_sha256(
            read_table(by_flow / "iter_1" / output, schema=None)), output
    assert read_table(apart / "iter_1" / "rollout").num_rows == 8
    update, flow_update = read_json(apart / "iter_1" / "update.json"), read_json(by_flow / "iter_1" / "update.json")
    assert (update["loss"], update["grad_norm"]) == (flow_update["loss"], flow_update["grad_norm"])
    weights, flow_weights = model_weights(apart, 1), model_weights(by_flow, 1)
    assert weights.keys() == flow_weights.keys()
    assert all(torch.equal(value, flow_weights[name]) for name, value in weights.items())
    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    assert any(not torch.equal(value, initial[name]) for name, value in weights.items() if name in initial)


def assert_cached_from_the_context_alone(context: dict) -> None:
    """A Prefect worker where the run is not live finds a finished node's cache key from the context it is handed,
    and sees the run going on while its owner holds the run's lock."""
    from tasks import runs
    from tasks.nodes import output_cache_key

    assert runs.find(context["run_id"]) is None
    task = SimpleNamespace(task=SimpleNamespace(name="rollout"))
    key = output_cache_key(lambda paths, k: paths.rollout(k))(task, {"run": context, "k": 1})
    assert key is not None and key.startswith("rollout-nodes-1-")
    assert output_cache_key(lambda paths, k: paths.rollout(k))(task, {"run": context, "k": 2}) is None
    assert runs.goes_on(RunContext.from_dict(context))


def test_a_node_whose_services_are_gone_fails_naming_them(tiny_model_dir, tmp_path, dead_address):
    cfg = load_config(CONFIG, overrides(tiny_model_dir, tmp_path))
    save_config(cfg, cfg.run_dir / "config.yaml")  # a run whose process is gone, its services with it
    context = RunContext(run_dir=str(cfg.run_dir.resolve()), run_id="nodes", inference=(dead_address,),
                         trainer=dead_address)

    started = time.monotonic()
    done = node_in_a_new_process("rollout", 1, context.to_dict(), [], timeout=120)
    assert done.returncode != 0
    assert f"ServiceGoneError: run nodes: inference server {dead_address} does not answer" in done.stderr
    assert "cannot start or restart them" in done.stderr.strip().splitlines()[-1]
    assert time.monotonic() - started < 60
    assert not (cfg.run_dir / "iter_1" / "rollout").exists()

    with pytest.raises(ServiceGoneError, match=f"trainer {dead_address} does not answer") as gone:
        run_attached_node(context, "ppo_update", 1, ())
    from areal_pipeline.errors import is_transient

    assert is_transient(gone.value)  # the owner restarts its services at the same addresses: a retry may pass

    pipeline = attach(context)
    try:
        for start in (pipeline.services.start_inference, pipeline.services.start_trainer,
                      pipeline.services.start_tools):
            with pytest.raises(NotOwnedError, match="cannot start its"):
                start()
        assert pipeline.services.addresses == [dead_address] and not pipeline.services.inference
    finally:
        pipeline.close()
        pipeline.services.stop()

    from tasks import runs

    assert not runs.goes_on(context)  # no process holds the run's lock
    # a Prefect worker's process: one attached pipeline per run, until a node names other services of it
    attached = runs.pipeline_for(context)
    assert attached.services.attached is not None and runs.pipeline_for(context) is attached
    moved = runs.pipeline_for(RunContext(context.run_dir, "nodes", inference=(dead_address,), trainer="127.0.0.1:1"))
    assert moved is not attached and attached.services.stopped and moved.services.trainer_client.address.endswith(":1")
    runs.close_attached()
    assert moved.services.stopped
