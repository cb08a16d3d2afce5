"""inference.addresses: a run uses inference servers started outside it (real CPU servers on loopback, started here
as a user would start SGLang), pushes every version to them, and leaves them running when it ends."""

from __future__ import annotations

import time

import pytest
import torch
from safetensors.torch import load_file

from areal_pipeline.processes import ServerLaunchError
from areal_pipeline.pipeline import run_plain
from areal_pipeline.run_spec import load_config
from areal_pipeline.services import Services
from conftest import http, start_cpu_server

PROBE = "model.layers.0.mlp.down_proj.weight"


@pytest.fixture
def running_servers(tiny_model_dir, tmp_path):
    """Two CPU servers started outside any run (as `python -m areal_pipeline.inference.server`)."""
    servers = []
    try:
        for _ in range(2):
            servers.append(start_cpu_server(tiny_model_dir, tmp_path / "server-logs"))
        yield servers
    finally:
        for server in servers:
            server.stop()


def _run_cfg(tiny_model_dir, tmp_path, servers, *overrides: str):
    return load_config(None, [
        f"output_dir={tmp_path / 'runs'}", f"model.path={tiny_model_dir}", "total_iterations=2", "save_freq=1",
        "rollout.batch_size=4", "rollout.gconfig.n_samples=2", "eval_freq=0", "dataset.arithmetic_train_size=64",
        "trainer.device=cpu", f"inference.addresses=[{','.join(s.address for s in servers)}]", *overrides])


def _served_by_the_trainer(servers, cfg) -> None:
    """Each server is alive, at version 2, with the trainer's weights of step 2, and served part of the rollouts."""
    trained = load_file(str(next((cfg.run_dir / "checkpoints" / "step_2" / "model").glob("*.safetensors"))))[PROBE]
    for server in servers:
        assert server.popen.poll() is None and server.is_healthy(), f"the run stopped {server.address}"
        assert http(server.address, "/get_model_info")[1]["weight_version"] == "2"
        status, served = http(server.address, "/get_weights_by_name", {"name": PROBE, "truncate_size": 64})
        assert status == 200
        assert torch.allclose(torch.tensor(served), trained.flatten()[:64].float(), atol=0, rtol=0)
        stats = http(server.address, "/get_server_info")[1]["internal_states"][0]
        assert stats["finished_requests"] > 0, f"{server.address} served no rollout"


def test_a_run_uses_running_servers_through_a_weights_dir_and_leaves_them_running(tiny_model_dir, tmp_path,
                                                                                  running_servers):
    shared = tmp_path / "shared-weights"
    cfg = _run_cfg(tiny_model_dir, tmp_path, running_servers, f"trainer.weights_dir={shared}")
    records = run_plain(cfg)
    assert [r["iteration"] for r in records] == [1, 2]
    _served_by_the_trainer(running_servers, cfg)
    # the versions went through the configured directory (the newest kept), not the run directory
    assert [p.name for p in (shared / cfg.run_id).iterdir()] == ["v2"]
    assert not (cfg.run_dir / "weights").exists()


def test_a_run_pushes_to_running_servers_over_a_process_group(tiny_model_dir, tmp_path, running_servers):
    cfg = _run_cfg(tiny_model_dir, tmp_path, running_servers, "trainer.weight_sync=distributed",
                   "trainer.weight_sync_master_address=127.0.0.1")
    run_plain(cfg)
    _served_by_the_trainer(running_servers, cfg)
    assert not (cfg.run_dir / "weights").exists()


def test_servers_that_do_not_answer_are_named(tmp_path, dead_address):
    address = dead_address
    cfg = load_config(None, [f"output_dir={tmp_path}", f"inference.addresses=[{address}]",
                             "inference.setup_timeout=1"])
    services = Services(cfg, "unused", tmp_path)
    started = time.monotonic()
    try:
        with pytest.raises(ServerLaunchError, match=f"inference server\\(s\\) {address} \\(inference.addresses\\) "
                                                    "did not answer GET /health"):
            services.start_inference()
    finally:
        services.stop()
    assert time.monotonic() - started < 60  # its 1 s setup timeout, not the default's minutes
