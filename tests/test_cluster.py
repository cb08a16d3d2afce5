"""The pieces of a run across hosts that need no second host: the launch commands generated from a config, a
trainer node's torchrun arguments and addresses, rank 0's announcement, and the settings check between a run and
the trainer it drives (tests/test_multi_host.py runs them on simulated hosts)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from areal_pipeline.auth import CredentialError, read_token_file
from areal_pipeline.cluster import (ClusterConfigError, as_shell, as_slurm, credential_env, launch_plan,
                                    prefect_api_warning)
from areal_pipeline.run_spec import load_config
from areal_pipeline.training.nodes import (TrainerNodeError, address_toward, announce_path, is_local_address,
                                           node_address, settings_mismatch, torchrun_argv, training_settings,
                                           wait_for_trainer, write_announcement)

REPO = Path(__file__).resolve().parents[1]
ACROSS = ["output_dir=/shared/runs", "run_id=r", "trainer.nnodes=2", "trainer.address=auto",
          "trainer.rdzv_endpoint=train-a:29400", "inference.addresses=[gen:30000,gen:30001]",
          "trainer.weight_sync=distributed"]


def across(*more: str):
    return load_config(REPO / "configs" / "tiny_cpu.yaml", [*ACROSS, *more])


def test_the_launch_plan_starts_each_server_on_its_host_and_a_trainer_node_per_node():
    cfg = across()
    plan = launch_plan(cfg, "/shared/run.yaml", ACROSS, "/shared/model", "http://head:4200/api")
    assert [(p.role, p.host) for p in plan] == [("inference-server", "gen"), ("inference-server", "gen"),
                                               ("trainer-node", "train-a"), ("trainer-node", ""), ("run", "")]
    first, second = plan[0].argv, plan[1].argv
    assert first[:2] == ("areal-pipeline", "inference-server")
    # as the run would launch them: on their own address and port, seeds seed + i, seeded sampling honoured
    assert first[first.index("--host") + 1] == "gen" and first[first.index("--port") + 1] == "30000"
    assert first[first.index("--seed") + 1] == "1" and second[second.index("--seed") + 1] == "2"
    assert "--enable-deterministic-inference" in first
    assert plan[2].argv == ("areal-pipeline", "trainer-node", "--config", "/shared/run.yaml", *ACROSS)
    assert plan[-1].argv[:2] == ("areal-pipeline", "train") and plan[-1].env == {"PREFECT_API_URL": "http://head:4200/api"}


def test_every_part_is_given_the_credential_environment_and_nothing_else_of_it(tmp_path, monkeypatch):
    cfg = across(f"output_dir={tmp_path}")
    monkeypatch.delenv("AREAL_PIPELINE_TOKEN", raising=False)
    made = credential_env(cfg)  # no token given: a new one, in a file on the shared path
    path = Path(made["AREAL_PIPELINE_TOKEN_FILE"])
    assert path.parent == tmp_path / ".credentials" and len(read_token_file(path)) >= 32
    assert credential_env(cfg) == made and read_token_file(path) == read_token_file(path)  # kept, not remade
    plan = launch_plan(cfg, "/shared/run.yaml", ACROSS, "/shared/model", "http://head:4200/api", made)
    assert all(p.env.items() >= made.items() for p in plan)
    assert plan[-1].env == {**made, "PREFECT_API_URL": "http://head:4200/api"}
    assert f"AREAL_PIPELINE_TOKEN_FILE={path}" in as_shell(plan)
    path.chmod(0o644)  # readable by every user of the shared file system: refused, not used
    with pytest.raises(CredentialError, match="chmod 600"):
        credential_env(cfg)
    monkeypatch.setenv("AREAL_PIPELINE_AUTH", "off")  # the laptop switch reaches every part as it is
    assert credential_env(cfg) == {"AREAL_PIPELINE_AUTH": "off"}


def test_a_run_on_one_host_has_nothing_to_launch_elsewhere():
    with pytest.raises(ClusterConfigError, match="nothing runs on other hosts"):
        launch_plan(load_config(REPO / "configs" / "tiny_cpu.yaml"), "c.yaml", [], "/m")


def test_the_shell_and_slurm_forms_name_every_host_and_parse():
    cfg = across()
    plan = launch_plan(cfg, "/shared/run.yaml", ACROSS, "/shared/model")
    shell = as_shell(plan)
    assert "# inference-server on gen" in shell and "# trainer-node on train-a (the rendezvous host)" in shell
    script = as_slurm(plan, cfg, partition="gpu")
    assert "#SBATCH --nodes=4" in script and "#SBATCH --nodelist=gen,train-a" in script
    assert "srun --nodes=2 --ntasks-per-node=1 --nodelist=train-a --overlap areal-pipeline trainer-node" in script
    assert script.rstrip().splitlines()[-1].startswith("areal-pipeline train")
    if shutil.which("bash"):
        assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_the_cluster_command_prints_the_plan_with_the_config_s_absolute_path(tmp_path):
    done = subprocess.run([sys.executable, "-m", "cli", "cluster", "--format", "json", "--config",
                           "configs/tiny_cpu.yaml", *ACROSS[1:], f"output_dir={tmp_path}", f"model.path={tmp_path}"],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PREFECT_API_URL": "http://127.0.0.1:4200/api"})
    assert done.returncode == 0, done.stderr
    assert "cluster: warning: PREFECT_API_URL=http://127.0.0.1:4200/api names the head's loopback" in done.stderr
    plan = json.loads(done.stdout)
    assert plan[2]["argv"][3] == str(REPO / "configs" / "tiny_cpu.yaml")
    # every part finds the run's token in one file on the shared path, made for the run, the owner's alone; the
    # token itself is in no part's command or environment
    token_file = tmp_path / ".credentials" / "token"
    assert [part["env"].get("AREAL_PIPELINE_TOKEN_FILE") for part in plan] == [str(token_file)] * len(plan)
    assert token_file.stat().st_mode & 0o777 == 0o600 and token_file.parent.stat().st_mode & 0o077 == 0
    assert read_token_file(token_file) == os.environ["AREAL_PIPELINE_TOKEN"]
    assert os.environ["AREAL_PIPELINE_TOKEN"] not in done.stdout + done.stderr
    refused = subprocess.run([sys.executable, "-m", "cli", "cluster", "--config", "configs/tiny_cpu.yaml",
                              "trainer.nnodes=2"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "trainer.nnodes=2: a trainer of several nodes runs on them" in refused.stderr


def test_a_prefect_api_other_hosts_cannot_reach_is_warned_about():
    assert "not set: the run would use a temporary Prefect server" in prefect_api_warning("")
    assert "names the head's loopback" in prefect_api_warning("http://127.0.0.1:4200/api")
    assert "names the head's loopback" in prefect_api_warning("http://localhost:4200/api")
    assert prefect_api_warning("http://head:4200/api") is None


def test_a_trainer_node_meets_the_others_at_the_rendezvous_on_its_own_address():
    cfg = across("trainer.max_restarts=2")
    cfg.trainer.rdzv_endpoint = "127.0.0.1:29400"  # an address of this host, as train-a's is on train-a
    argv = torchrun_argv(cfg, Path("/shared/node.yaml"), "/m", "10.0.0.3")
    assert argv[argv.index("--nnodes") + 1] == "2" and argv[argv.index("--max-restarts") + 1] == "2"
    assert argv[argv.index("--local-addr") + 1] == "10.0.0.3"
    assert argv[argv.index("--rdzv-backend") + 1] == "c10d" and argv[argv.index("--rdzv-id") + 1] == "r"
    # the rendezvous store is hosted where the endpoint's address is local
    assert argv[argv.index("--rdzv-conf") + 1] == "is_host=true"
    assert argv[argv.index("--host") + 1] == "10.0.0.3"
    assert argv[argv.index("--announce") + 1] == "/shared/runs/r/trainer/endpoint.json"
    one = torchrun_argv(across("trainer.nnodes=1"), Path("/n.yaml"), "/m", "10.0.0.3")
    assert "--standalone" in one and "--rdzv-backend" not in one


def test_a_node_address_is_never_loopback():
    assert address_toward("127.0.0.1", 1) == "127.0.0.1"
    assert is_local_address("127.0.0.1") and not is_local_address("192.0.2.1")  # TEST-NET-1: never this host's
    with pytest.raises(TrainerNodeError, match="resolves to loopback"):
        node_address(across(), "127.0.0.1")
    with pytest.raises(TrainerNodeError, match="192.0.2.1 is not an address of this host"):
        node_address(across(), "192.0.2.1")
    with pytest.raises(TrainerNodeError, match="resolves to loopback"):  # a name is resolved first
        node_address(across(), "localhost")


def test_a_trainer_started_with_other_settings_is_named_key_by_key():
    ours = training_settings(across())
    assert ours["run_id"] == "r" and "ppo.eps_clip" in ours and "trainer.optimizer.lr" in ours
    theirs = training_settings(across("ppo.eps_clip=0.3"))
    assert settings_mismatch(ours, theirs) == ["ppo.eps_clip=0.3 (this run: 0.2)"]
    assert settings_mismatch(ours, dict(ours)) == []
    # what does not decide the updates may differ (the servers, the trainer's nodes)
    assert settings_mismatch(ours, training_settings(across("inference.addresses=[gen:1]"))) == []


class _Health(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"status": "ok", "world_size": 2, "version": None}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_the_run_finds_rank_0_where_it_announced_itself(tmp_path):
    cfg = across(f"output_dir={tmp_path}")
    with pytest.raises(TrainerNodeError, match="no trainer answered announced in .*within 1s .nothing announced"):
        wait_for_trainer(cfg, timeout=1)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        # a stale announcement (a rank 0 gone) is waited past until the new one answers
        write_announcement(announce_path(cfg), "127.0.0.1:1", "r", 2)
        with pytest.raises(TrainerNodeError, match="127.0.0.1:1: "):
            wait_for_trainer(cfg, timeout=1)
        write_announcement(announce_path(cfg), f"127.0.0.1:{server.server_address[1]}", "r", 2)
        address, health = wait_for_trainer(cfg, timeout=10)
        assert address == f"127.0.0.1:{server.server_address[1]}" and health["world_size"] == 2
    finally:
        server.shutdown()


@pytest.mark.parametrize("backend, flags", [
    ("cpu", ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all"]),
    ("sglang", ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all", "--max-loras-per-batch", "1",
                "--max-loaded-loras", "2"]),
    ("vllm", ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "1", "--max-cpu-loras", "2"])])
def test_servers_on_other_hosts_take_run_time_adapters_where_pushes_send_them(backend, flags):
    """trainer.lora.push=adapter with servers the plan launches: each is started as the run would start its own,
    able to load the adapters it is pushed (and vLLM with its run-time LoRA routes switched on)."""
    lora = ["trainer.lora.enabled=true", "trainer.lora.push=adapter", "trainer.weight_sync=disk",
            f"inference.backend={backend}", *(["model.tiny.num_attention_heads=2"] if backend == "vllm" else [])]
    overrides = [*ACROSS[:-1], *lora]
    plan = launch_plan(across(*lora), "/shared/run.yaml", overrides, "/shared/model", "http://head:4200/api")
    server = plan[0].argv
    start = server.index("--enable-lora")
    assert list(server[start:start + len(flags)]) == flags
    assert (plan[0].env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING") == "1") == (backend == "vllm")
    merged = launch_plan(across("trainer.lora.enabled=true"), "/shared/run.yaml", ACROSS, "/shared/model", "")
    assert "--enable-lora" not in merged[0].argv  # auto across hosts: merged pushes


def test_a_run_is_refused_by_a_real_trainer_started_with_other_settings_or_another_token(tiny_model_dir, tmp_path,
                                                                                         monkeypatch):
    """connect_trainer against a trainer process of its own (as a node starts one): the run with the trainer's
    settings gets an initialised client; a run with another learning rate is refused naming the key and both
    values before any command; a run with another token is refused as not admitted (the trainer's bare /health)."""
    from areal_pipeline.training.client import launch_trainer
    from areal_pipeline.training.nodes import connect_trainer
    from areal_pipeline.run_spec import load_config as load

    base = [f"output_dir={tmp_path}", "run_id=nodes", "trainer.optimizer.lr=1e-3", "trainer.setup_timeout=30"]
    process, _ = launch_trainer(load(None, base), str(tiny_model_dir), tmp_path / "logs")
    try:
        port = process.address.rpartition(":")[2]
        run = [*base, f"trainer.address={process.address}", f"trainer.port={port}", "trainer.nnodes=1"]
        client = connect_trainer(load(None, run))
        assert client.call("status")["version"] == 0
        with pytest.raises(TrainerNodeError, match=r"started with other settings than this run's: "
                                                    r"trainer\.optimizer\.lr=0\.001 \(this run: 0\.002\)"):
            connect_trainer(load(None, [*run, "trainer.optimizer.lr=2e-3"]))
        monkeypatch.delenv("AREAL_PIPELINE_TOKEN_FILE", raising=False)
        monkeypatch.setenv("AREAL_PIPELINE_TOKEN", "not-the-trainers-token")
        with pytest.raises(TrainerNodeError, match="refuses this run's credential"):
            connect_trainer(load(None, run))
    finally:
        process.stop()
