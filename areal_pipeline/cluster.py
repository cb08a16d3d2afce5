"""The launch commands of a run across hosts, generated from its config, for whatever starts processes on a cluster
(a shell on each host, Slurm's srun, a Kubernetes job's command): `areal-pipeline cluster` prints them.

    inference servers   one per `inference.addresses` entry, on that host, listening on that address
    trainer nodes       `trainer.nnodes` x `areal-pipeline trainer-node`, the first on trainer.rdzv_endpoint's host
    the run             `areal-pipeline train` on the head, against a Prefect server every host's worker reaches

The orchestrating run never reaches into another host: it finds the servers and the trainer at their addresses
(trainer.address=auto: rank 0 announces itself on the shared path) and waits for them within their setup
timeouts, so the parts may start in any order.
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from areal_pipeline import auth
from areal_pipeline.config import ExperimentConfig, adapter_push
from areal_pipeline.config.addresses import is_loopback, split_address

CLI = "areal-pipeline"


@dataclass(frozen=True)
class Launch:
    role: str  # inference-server | trainer-node | run
    host: str  # where it runs (a host name or address of the config); "" for any node the scheduler picks
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)


class ClusterConfigError(ValueError):
    pass


def server_argv(cfg: ExperimentConfig, model_path: str, address: str, index: int) -> list[str]:
    """The server at `address`, as the run would launch it (the same flags, seed `seed + index`)."""
    from areal_pipeline.inference.launcher import build_cpu_server_command, build_sglang_command, build_vllm_command

    inf = cfg.inference
    host, port = split_address(address)
    seed = cfg.seed + index
    if inf.backend == "cpu":
        command = build_cpu_server_command(model_path, host, port, inf, seed, experiment=cfg)
        return [CLI, "inference-server", *command[3:]]  # `python -m areal_pipeline.inference.server` is this command
    lora = cfg.trainer.lora if adapter_push(cfg) else None  # trainer.lora.push=adapter: run-time adapter loading
    if inf.backend == "sglang":
        return build_sglang_command(model_path, host, port, inf.sglang, seed, 0 if inf.device == "cuda" else None,
                                    lora=lora)
    return build_vllm_command(model_path, host, port, inf.vllm, seed, lora_rank=lora.rank if lora else 0)


def credential_env(cfg: ExperimentConfig) -> dict[str, str]:
    """How every part of a run across hosts finds the run's token (auth.py): the file AREAL_PIPELINE_TOKEN_FILE
    names, else one made here (mode 0600, holding AREAL_PIPELINE_TOKEN where that is set, else a new token) as
    `<output_dir>/.credentials/token`, on the shared path every host reads: one for the runs of an output
    directory, which may share servers (a line's firings do). Only the file's path travels: a launch's environment
    is printed, and passed as a worker flow run's parameters. With auth off, that it is off."""
    from areal_pipeline.prefect_auth import AUTH_FILE_ENV as PREFECT_AUTH_FILE_ENV

    # the Prefect API's basic-auth string, by its file alone (prefect_server.py)
    prefect = {name: str(Path(os.environ[name]).resolve()) for name in (PREFECT_AUTH_FILE_ENV,)
               if os.environ.get(name, "").strip()}
    if auth.auth_disabled():
        return {auth.AUTH_ENV: "off", **prefect}
    given = os.environ.get(auth.TOKEN_FILE_ENV, "").strip()
    if given:
        auth.read_token_file(given)
        return {auth.TOKEN_FILE_ENV: str(Path(given).resolve()), **prefect}
    path = auth.output_dir_token_file(cfg.output_dir)
    auth.write_token_file(path, os.environ.get(auth.TOKEN_ENV, "").strip() or None)
    return {auth.TOKEN_FILE_ENV: str(path), **prefect}


def launch_plan(cfg: ExperimentConfig, config_path: str, overrides: list[str], model_path: str,
                prefect_api_url: str = "", credentials: Optional[dict[str, str]] = None) -> list[Launch]:
    """Every process of the run across hosts, in the order a scheduler may start them. `credentials`: the
    environment naming the run's token (`credential_env`), given to every one of them."""
    credentials = dict(credentials or {})
    t = cfg.trainer
    if not cfg.inference.addresses and not t.address:
        raise ClusterConfigError("nothing runs on other hosts: set inference.addresses (the servers' host:port) "
                                 "and/or trainer.address=auto with trainer.nnodes and trainer.rdzv_endpoint")
    config = ["--config", config_path, *overrides]
    server_env = dict(credentials)
    if cfg.inference.backend != "cpu":  # SGLang's or vLLM's interpreter runs the project's with_token first
        from areal_pipeline.inference.launcher import project_on_path

        server_env["PYTHONPATH"] = project_on_path({})["PYTHONPATH"]
    if cfg.inference.backend == "vllm" and adapter_push(cfg):  # vLLM's /v1/load_lora_adapter exists only so
        server_env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    plan = [Launch("inference-server", split_address(a)[0], tuple(server_argv(cfg, model_path, a, i)), server_env)
            for i, a in enumerate(cfg.inference.addresses)]
    if t.address:
        # the first node runs where the rendezvous is hosted, else at rank 0's given address; with auto, anywhere
        anchor = t.rdzv_endpoint or ("" if t.address == "auto" else t.address)
        first = split_address(anchor)[0] if anchor else ""
        plan += [Launch("trainer-node", first if node == 0 else "", (CLI, "trainer-node", *config), credentials)
                 for node in range(t.nnodes)]
    env = {**credentials, **({"PREFECT_API_URL": prefect_api_url} if prefect_api_url else {})}
    plan.append(Launch("run", "", (CLI, "train", *config), env))
    return plan


def prefect_api_warning(url: str) -> Optional[str]:
    """What is wrong with the Prefect API URL the run is given, for a run across hosts (None: nothing)."""
    from urllib.parse import urlparse

    if not url:
        return ("PREFECT_API_URL is not set: the run would use a temporary Prefect server on the head, seen by no "
                "other host and gone when the run ends; start a standing one (`areal-pipeline prefect-server start "
                "--host <head's address>`) and export its URL before `areal-pipeline cluster`")
    host = urlparse(url).hostname or ""
    if is_loopback(host):
        return (f"PREFECT_API_URL={url} names the head's loopback: workers and browsers on other hosts cannot reach "
                "it; start the Prefect server with --host <head's address> and use that address")
    return None


def command_line(launch: Launch) -> str:
    """The launch as one shell line: its environment, then its command."""
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in launch.env.items())
    return (env + " " if env else "") + shlex.join(launch.argv)


def as_shell(plan: list[Launch]) -> str:
    """A comment naming each host, then its command."""
    lines = []
    for launch in plan:
        where = {"inference-server": f"on {launch.host}", "run": "on the head (where the Prefect server is reached)",
                 "trainer-node": f"on {launch.host} (the rendezvous host)" if launch.host else "on another trainer node"}
        lines += [f"# {launch.role} {where[launch.role]}", command_line(launch), ""]
    return "\n".join(lines)


def as_json(plan: list[Launch]) -> str:
    return json.dumps([asdict(launch) for launch in plan], indent=2)


def as_slurm(plan: list[Launch], cfg: ExperimentConfig, partition: str = "") -> str:
    """An sbatch script: the servers and the trainer nodes as background job steps on their hosts, the run in the
    batch step; when the run ends the script ends, and Slurm ends the steps with it."""
    servers = [launch for launch in plan if launch.role == "inference-server"]
    nodes = [launch for launch in plan if launch.role == "trainer-node"]
    run = next(launch for launch in plan if launch.role == "run")
    named = sorted({launch.host for launch in servers + nodes if launch.host})
    header = ["#!/bin/bash", f"#SBATCH --job-name={cfg.run_id}",
              f"#SBATCH --nodes={1 + len({s.host for s in servers}) + len(nodes)}",
              f"#SBATCH --nodelist={','.join(named)}" if named else "",
              f"#SBATCH --partition={partition}" if partition else "",
              "#SBATCH --ntasks-per-node=1", "#SBATCH --exclusive"]
    body = ["set -euo pipefail", "# the batch step runs on the allocation's first node: the head (the run)"]
    body += [f"srun --nodes=1 --ntasks=1 --nodelist={launch.host} --overlap {command_line(launch)} &" for launch in servers]
    if nodes:
        first = f" --nodelist={nodes[0].host}" if nodes[0].host else ""
        body.append(f"srun --nodes={len(nodes)} --ntasks-per-node=1{first} --overlap {command_line(nodes[0])} &")
    body.append(command_line(run))
    return "\n".join([line for line in header if line] + [""] + body) + "\n"
