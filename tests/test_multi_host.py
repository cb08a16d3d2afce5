"""A run across four simulated hosts (network namespaces: tests/_hosts.py), started as a cluster starts it: the
commands `areal-pipeline cluster` generates from the run's config, each run on its host.

    head      a Prefect server on PostgreSQL, listening on head's address; the run (`areal-pipeline train`)
    gen       the inference server, listening on gen's address
    train-a   trainer node 0 (the c10d rendezvous host)     } torchrun --nnodes 2, gloo between the hosts
    train-b   trainer node 1                                 }

No process binds an address another host needs to loopback: every host has a loopback of its own, so one would
not be reached. The run directory is a shared path (the one file system the namespaces share stands for NFS).
Every service demands the run's token, which `cluster` puts in a file on the shared path (the hosts are given no
token of their own), and speaks TLS with a certificate made here for the hosts' names and addresses.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _hosts import SimulatedHosts, namespaces_unavailable
from _learning_helpers import base_model, first_and_last

REPO = Path(__file__).resolve().parents[1]
CLI = str(Path(sys.executable).with_name("areal-pipeline"))
HOSTS = ("head", "gen", "train-a", "train-b")
ITERATIONS = 20
# The run that loses a trainer node stops at 8 under the reference's learning-rate schedule: its weights are then the
# reference's at 8, bitwise, four iterations after the loss and the replay
VICTIM = ("total_iterations=8", f"trainer.optimizer.schedule_iterations={ITERATIONS}")

pytestmark = pytest.mark.skipif(namespaces_unavailable() is not None,
                                reason=f"simulated hosts: {namespaces_unavailable()}")


def overrides(shared: Path, model: str, run_id: str, *more: str) -> list[str]:
    return [f"output_dir={shared}", f"run_id={run_id}", f"model.path={model}", f"total_iterations={ITERATIONS}",
            "save_freq=1", "eval_freq=0", "iterations_per_flow_run=5",
            "trainer.nnodes=2", "trainer.address=auto", "trainer.rdzv_endpoint=train-a:29400",
            "trainer.collective_timeout=60", "inference.addresses=[gen:30000]", *more]


def launch_plan(hosts: SimulatedHosts, env: dict, config: list[str]) -> list[dict]:
    done = hosts.run("head", [CLI, "cluster", "--format", "json", *config], timeout=120, env=env, cwd=REPO,
                     capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def start(hosts: SimulatedHosts, host: str, launch: dict, env: dict, log: Path) -> subprocess.Popen:
    argv = [CLI if launch["argv"][0] == "areal-pipeline" else launch["argv"][0], *launch["argv"][1:]]
    return hosts.popen(host, argv, env={**env, **launch["env"]}, cwd=REPO, stdout=open(log, "ab"),
                       stderr=subprocess.STDOUT)


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def weights_at(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"step_{step}" / "model" / "model.safetensors"))


def tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else f"({path} missing)"


def prefect_server_on_head(hosts: SimulatedHosts, tmp_path: Path, request) -> dict[str, str]:
    """A standing Prefect server on PostgreSQL on `head`, listening on head's address; the environment of every
    host's commands, with PREFECT_API_URL naming it (nothing of the test session's own Prefect API)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PREFECT_") and k not in ("AREAL_PIPELINE_TOKEN", "AREAL_PIPELINE_TOKEN_FILE")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), NO_PROXY="*", no_proxy="*")
    # PostgreSQL runs as its own user, who must reach the data folder (pytest's temp folders are root's alone)
    pg = Path(tempfile.mkdtemp(prefix="areal-pg-", dir="/tmp"))
    pg.chmod(0o755)
    request.addfinalizer(lambda: shutil.rmtree(pg, ignore_errors=True))
    server = hosts.run("head", [CLI, "prefect-server", "start", "--host", "head", "--dir", str(pg / "server")],
                       timeout=240, env=env, capture_output=True, text=True)
    assert server.returncode == 0, server.stdout + server.stderr
    return {**env, "PREFECT_API_URL": "http://head:4200/api"}


def tls_environment(hosts: SimulatedHosts, folder: Path) -> dict[str, str]:
    """A CA made for the test, and a certificate it signed for every host's name and address: the services
    serve with it, the clients trust the CA alone."""
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert(*HOSTS, *(hosts.address(h) for h in HOSTS))
    folder.mkdir()
    ca.cert_pem.write_to_path(str(folder / "ca.pem"))
    cert.cert_chain_pems[0].write_to_path(str(folder / "cert.pem"))
    for more in cert.cert_chain_pems[1:]:
        more.write_to_path(str(folder / "cert.pem"), append=True)
    cert.private_key_pem.write_to_path(str(folder / "key.pem"))
    return {"AREAL_PIPELINE_TLS_CERT": str(folder / "cert.pem"), "AREAL_PIPELINE_TLS_KEY": str(folder / "key.pem"),
            "AREAL_PIPELINE_TLS_CA": str(folder / "ca.pem")}


# From another host: the status of each request to a service (url, header or "" for none); the CA is the test's
ASK_FROM_ELSEWHERE = """
import json, ssl, sys, urllib.error, urllib.request
context = ssl.create_default_context(cafile=sys.argv[1])
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context))
statuses = []
for url, method, header in json.loads(sys.argv[2]):
    request = urllib.request.Request(url, method=method, data=b"{}" if method == "POST" else None,
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": header} if header else {})})
    try:
        with opener.open(request, timeout=30) as reply:
            statuses.append(reply.status)
    except urllib.error.HTTPError as e:
        statuses.append(e.code)
    except OSError:  # not listening (yet)
        statuses.append(0)
print(json.dumps(statuses))
"""


def statuses_from(hosts: SimulatedHosts, host: str, env: dict, asks: list[tuple[str, str, str]]) -> list[int]:
    done = hosts.run(host, [sys.executable, "-c", ASK_FROM_ELSEWHERE, env["AREAL_PIPELINE_TLS_CA"], json.dumps(asks)],
                     timeout=120, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def refused_without_the_token(hosts: SimulatedHosts, env: dict, token: str, url: str, routes: list[tuple],
                              admitted: tuple[str, str, int]) -> None:
    """Each (method, path) of the service at `url`, asked from the head: 401 without the token, with a wrong one
    and with another scheme; its bare liveness probe answers; with the token, `admitted` (method, path) gets past
    the credential to its status (a body of {} may be a 400: the route's own answer)."""
    asks = [(url + path, method, header) for method, path in routes
            for header in ("", f"Bearer {token[:-1]}x", f"Basic {token}", "Bearer ")]
    assert statuses_from(hosts, "head", env, asks) == [401] * len(asks), asks
    method, path, status = admitted
    assert statuses_from(hosts, "head", env, [(url + "/health", "GET", ""),
                                              (url + path, method, f"Bearer {token}")]) == [200, status]


@pytest.mark.timeout(1500)
def test_a_run_across_four_hosts_learns_and_survives_a_lost_trainer_node(model_cache, tmp_path, request):
    model = base_model("tiny_cpu.yaml", model_cache)
    shared, logs = tmp_path / "shared", tmp_path / "logs"
    logs.mkdir()
    with SimulatedHosts(HOSTS) as hosts:
        env = {**prefect_server_on_head(hosts, tmp_path, request), **tls_environment(hosts, tmp_path / "tls")}

        def run(run_id: str, *more: str) -> tuple[subprocess.Popen, dict[str, subprocess.Popen]]:
            config = ["--config", "configs/tiny_cpu.yaml", *overrides(shared, model, run_id, *more)]
            plan = launch_plan(hosts, env, config)
            servers = [p for p in plan if p["role"] == "inference-server"]
            nodes = [p for p in plan if p["role"] == "trainer-node"]
            assert [s["host"] for s in servers] == ["gen"] and [n["host"] for n in nodes] == ["train-a", ""]
            if not hosts.pids("gen"):
                start(hosts, "gen", servers[0], env, logs / "gen.log")
            started = {host: start(hosts, host, node, env, logs / f"{host}-{run_id}.log")
                       for host, node in zip(("train-a", "train-b"), nodes)}
            (orchestrator,) = [p for p in plan if p["role"] == "run"]
            assert orchestrator["env"] == {"PREFECT_API_URL": "http://head:4200/api",
                                           "AREAL_PIPELINE_TOKEN_FILE": str(shared / ".credentials" / "token")}
            return start(hosts, "head", orchestrator, env, logs / f"head-{run_id}.log"), started

        # A: uninterrupted, weights to gen by process group (gloo between train-a and gen)
        reference, _ = run("ref", "trainer.weight_sync=distributed", f"keep_checkpoints={ITERATIONS}")
        assert reference.wait(timeout=900) == 0, tail(logs / "head-ref.log")
        announced = json.loads((shared / "ref" / "trainer" / "endpoint.json").read_text())
        assert announced["world_size"] == 2 and announced["address"].split(":")[0] in {
            hosts.address("train-a"), hosts.address("train-b")}, announced
        records = [json.loads(line) for line in (shared / "ref" / "metrics.jsonl").read_text().splitlines()]
        assert len(records) == ITERATIONS
        first, last = first_and_last(records)
        assert last > first + 0.1, [r["reward_mean"] for r in records]
        # the server on gen and the trainer's endpoint (still up) take nothing from another host without the token
        token = (shared / ".credentials" / "token").read_text().strip()
        refused_without_the_token(hosts, env, token, "https://gen:30000", [
            ("POST", "/generate"), ("POST", "/update_weights_from_disk"), ("GET", "/get_weights_by_name"),
            ("POST", "/init_weights_update_group"), ("POST", "/pause_generation"), ("POST", "/v1/chat/completions"),
            ("GET", "/v1/models"), ("GET", "/model_info")], admitted=("GET", "/v1/models", 200))
        refused_without_the_token(hosts, env, token, f"https://{announced['address']}",
                                  [("POST", "/command"), ("GET", "/status")], admitted=("POST", "/command", 400))
        # and a retrieval server on gen, started as a cluster starts one, with the run's token file
        from areal_pipeline.data.knowledge_base import knowledge_base

        corpus = shared / "corpus.jsonl"
        corpus.write_text("".join(json.dumps(row) + "\n" for row in knowledge_base().corpus))
        start(hosts, "gen", {"argv": [CLI, "retrieval-server", "--corpus", str(corpus), "--host", "gen", "--port",
                                      "8000", "--index-dir", str(shared / "indexes")],
                             "env": {"AREAL_PIPELINE_TOKEN_FILE": str(shared / ".credentials" / "token")}},
              env, logs / "retrieval.log")
        wait_for(lambda: statuses_from(hosts, "head", env, [("https://gen:8000/health", "GET", "")]) == [200]
                 if "retrieval server on" in tail(logs / "retrieval.log") else None, 120, "the retrieval server")
        refused_without_the_token(hosts, env, token, "https://gen:8000", [("POST", "/retrieve")],
                                  admitted=("POST", "/retrieve", 400))
        for log in logs.glob("*.log"):
            assert token not in log.read_text(errors="replace"), log
        hosts.kill_host("train-a"), hosts.kill_host("train-b")  # the scheduler ends the job's trainer steps

        # B: the same run with weights by disk; train-b is lost while iteration 3 is being updated, and its
        # scheduler starts it again: the update's retry waits for the trainer, restores it and goes on
        victim, nodes = run("victim", "trainer.weight_sync=disk", *VICTIM)
        batch = shared / "victim" / "iter_3" / "batch" / "manifest.json"
        wait_for(lambda: batch.exists() or victim.poll() is not None, 600, "iteration 3's batch")
        assert victim.poll() is None, tail(logs / "head-victim.log")
        assert hosts.kill_host("train-b")
        plan = launch_plan(hosts, env, ["--config", "configs/tiny_cpu.yaml",
                                        *overrides(shared, model, "victim", "trainer.weight_sync=disk", *VICTIM)])
        start(hosts, "train-b", [p for p in plan if p["role"] == "trainer-node"][1], env,
              logs / "train-b-victim-again.log")
        assert victim.wait(timeout=900) == 0, tail(logs / "head-victim.log")
        log = (shared / "victim" / "logs" / "train.log").read_text()
        assert "waiting for its nodes to come back" in log or "no trainer answered" in log, log[-3000:]

        assert len((shared / "victim" / "metrics.jsonl").read_text().splitlines()) == 8
        a, b = weights_at(shared / "ref", 8), weights_at(shared / "victim", 8)
        assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)

        # the head's Prefect server (PostgreSQL) recorded it: a node of the victim's ran twice, and completed (the
        # update train-b was lost in, or the first node after it that reached the trainer). Task-run states reach
        # the database through batched events, after the command has ended too: read until it is there.
        trainer_nodes = ("ppo_update", "proximal_logprobs", "ref_logprobs", "broadcast_weights", "checkpoint")
        seen: list = []

        def a_retried_trainer_node():
            retried = hosts.run("head", [sys.executable, "-c", RETRIED_TASK_RUNS], timeout=120, env=env,
                                capture_output=True, text=True)
            assert retried.returncode == 0, retried.stderr
            seen[:] = json.loads(retried.stdout)
            return any(name.rsplit("-", 1)[0] in trainer_nodes and name.rsplit("-", 1)[1] in ("3", "4")
                       for name, _ in seen)

        try:
            wait_for(a_retried_trainer_node, 60, "a retried trainer node of iteration 3 or 4", interval=2)
        except AssertionError as error:
            raise AssertionError(f"{error}; the retried task runs recorded: {seen}") from None


RETRIED_TASK_RUNS = """
import asyncio, json
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

async def retried():
    found, offset = [], 0
    victims = FlowRunFilter(tags=FlowRunFilterTags(all_=["run:victim"]))  # the reference run's are left out
    async with get_client() as client:
        while page := await client.read_task_runs(flow_run_filter=victims, limit=200, offset=offset):
            found += [(r.name, r.state_type.value) for r in page
                      if r.run_count > 1 and r.state_type is not None and r.state_type.value == "COMPLETED"]
            offset += len(page)
    return found

print(json.dumps(asyncio.run(retried())))
"""


FLOW_RUN_STATES = """
import asyncio, json, sys
from prefect.client.orchestration import get_client

async def states():
    async with get_client() as client:
        return {i: (await client.read_flow_run(i)).state_type.value for i in sys.argv[1:]}

print(json.dumps(asyncio.run(states())))
"""


@pytest.mark.timeout(900)
def test_a_prefect_worker_on_each_host_runs_its_part(tiny_model_dir, tmp_path, request):
    """The parts as flow runs of the cluster-node deployment, each run by the worker of its host (a work queue per
    host); the run on the head uses them; cancelling their flow runs stops them."""
    shared, logs = tmp_path / "shared", tmp_path / "logs"
    logs.mkdir()
    with SimulatedHosts(HOSTS) as hosts:
        env = prefect_server_on_head(hosts, tmp_path, request)
        prefect = str(Path(sys.executable).with_name("prefect"))
        for argv in (["work-pool", "create", "areal-process", "--type", "process"],
                     ["--no-prompt", "deploy", "--name", "cluster-node"]):
            done = hosts.run("head", [prefect, *argv], timeout=300, env=env, cwd=REPO, capture_output=True, text=True)
            assert done.returncode == 0, done.stdout + done.stderr
        workers = {host: hosts.popen(host, [prefect, "worker", "start", "--pool", "areal-process", "--work-queue", host],
                                     env={**env, "PREFECT_WORKER_QUERY_SECONDS": "1",
                                          "PREFECT_HOME": str(tmp_path / f"prefect-{host}")},
                                     cwd=tmp_path, stdout=open(logs / f"worker-{host}.log", "ab"),
                                     stderr=subprocess.STDOUT)
                   for host in ("gen", "train-a", "train-b")}
        config = ["--config", "configs/tiny_cpu.yaml",
                  *overrides(shared, str(tiny_model_dir), "pooled", "total_iterations=3",
                             "trainer.weight_sync=distributed")]
        submitted = hosts.run("head", [CLI, "cluster", "--submit", "--trainer-hosts", "train-a,train-b", *config],
                              timeout=120, env=env, cwd=REPO, capture_output=True, text=True)
        assert submitted.returncode == 0, submitted.stdout + submitted.stderr
        ids = dict(line.split(": flow run ") for line in submitted.stdout.splitlines() if ": flow run " in line)
        assert set(ids) == {"inference-server on gen", "trainer-node on train-a", "trainer-node on train-b"}, ids
        token_file = shared / ".credentials" / "token"
        assert f"then, on the head: AREAL_PIPELINE_TOKEN_FILE={token_file} " in submitted.stdout, submitted.stdout

        # a run with another token is refused by the trainer, and says so (then, given the parts', it trains)
        intruder = hosts.run("head", [CLI, "train", *config], timeout=600, env={**env, "AREAL_PIPELINE_TOKEN": "x"},
                             cwd=REPO, capture_output=True, text=True)
        assert intruder.returncode != 0 and "refuses this run's credential" in intruder.stdout + intruder.stderr, (
            intruder.stdout[-3000:] + intruder.stderr[-3000:])
        trained = hosts.run("head", [CLI, "train", *config], timeout=600, cwd=REPO, capture_output=True, text=True,
                            env={**env, "AREAL_PIPELINE_TOKEN_FILE": str(token_file)})
        # the output directory's token, which `cluster` made, is the one a run there finds by itself
        assert token_file == shared / ".credentials" / "token"
        assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:] + "".join(
            tail(logs / f"worker-{h}.log", 1500) for h in workers)
        assert len((shared / "pooled" / "metrics.jsonl").read_text().splitlines()) == 3

        def states() -> dict[str, str]:
            done = hosts.run("head", [sys.executable, "-c", FLOW_RUN_STATES, *ids.values()], timeout=120, env=env,
                             capture_output=True, text=True)
            assert done.returncode == 0, done.stderr
            return json.loads(done.stdout)

        assert set(states().values()) == {"RUNNING"}
        for flow_run in ids.values():
            done = hosts.run("head", [prefect, "flow-run", "cancel", flow_run], timeout=120, env=env,
                             capture_output=True, text=True)
            # a trainer node whose peer was cancelled first may have failed already (its rendezvous is gone)
            assert done.returncode == 0 or "already in terminal state FAILED" in done.stdout, done.stdout + done.stderr
        wait_for(lambda: set(states().values()) <= {"CANCELLED", "FAILED"}, 120, "the parts' flow runs to end", 1)
        assert states()[ids["inference-server on gen"]] == "CANCELLED"
        # nothing of the parts is left on their hosts: only each host's worker
        for host, worker in workers.items():
            wait_for(lambda: hosts.pids(host) == [worker.pid], 60, f"{host}'s part to stop", 0.5)
