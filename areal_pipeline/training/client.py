"""Start the trainer process under torchrun and talk to its rank-0 endpoint."""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import uuid
from pathlib import Path
from typing import Any, Optional

from areal_pipeline import auth
from areal_pipeline.config import ExperimentConfig, save_config
from areal_pipeline.processes import ServerProcess
from areal_pipeline.utils import find_free_port, raise_if_deadline_passed, time_left

# The process group's init method of a trainer started without torchrun (default: env://, torchrun's variables)
TRAINER_INIT_METHOD_ENV = "AREAL_TRAINER_INIT_METHOD"


class TrainerError(RuntimeError):
    def __init__(self, message: str, code: str = "error", status: int = 500, details: Optional[dict] = None):
        super().__init__(message)
        self.code, self.status, self.details = code, status, details or {}


class TrainerClient:
    def __init__(self, address: str, timeout: float = 3600.0):
        self.address = address
        self.timeout = timeout
        # The trainer's policy version as its last reply gave it; None after a failed call or when never told
        # (ask with "status"). Every reply carries the version, so a run that goes well never has to ask.
        self.version: Optional[int] = None

    def forget_version(self) -> None:
        self.version = None

    def current_version(self) -> Optional[int]:
        """The trainer's version: as its last reply gave it, else asked with "status"."""
        return self.version if self.version is not None else self.call("status")["version"]

    def call(self, cmd: str, timeout: Optional[float] = None, **args: Any) -> dict:
        data = json.dumps({"cmd": cmd, **args}).encode()
        req = auth.request(self.address, "/command", data=data, method="POST",
                           headers={"Content-Type": "application/json"})
        self.version = None  # a call that fails may have left the trainer anywhere
        try:
            with auth.opener().open(req, timeout=time_left(timeout or self.timeout)) as resp:
                reply = json.loads(resp.read())
            if isinstance(reply, dict) and isinstance(reply.get("version"), int):
                self.version = reply["version"]
            return reply
        except urllib.error.HTTPError as e:
            body = e.read()
            try:
                error = json.loads(body)["error"]
            except (ValueError, KeyError, TypeError):
                error = {"message": body.decode(errors="replace")}
            details = {k: v for k, v in error.items() if k not in ("message", "code")}
            raise TrainerError(f"trainer {self.address} {cmd}: {error.get('message')}", error.get("code", "error"),
                               e.code, details) from None
        except OSError as e:
            raise_if_deadline_passed(e)
            raise TrainerError(f"trainer {self.address} unreachable during {cmd}: {e}", "unreachable", 0) from e

    def health(self) -> dict:
        with auth.opener().open(auth.request(self.address, "/health"), timeout=10) as resp:
            return json.loads(resp.read())


def build_trainer_command(cfg: ExperimentConfig, config_path: Path, model_path: str, port: int) -> list[str]:
    """One node on this host, every socket on loopback (`run_one_node_torchrun`); a trainer of several nodes runs
    on nodes of its own (training/nodes.py)."""
    t = cfg.trainer
    return [sys.executable, "-m", "areal_pipeline.training.client", "--standalone", "--local-addr", "127.0.0.1",
            "--nnodes", "1", "--nproc-per-node", str(t.nproc), *t.torchrun_args,
            "-m", "areal_pipeline.training.trainer_server", "--config", str(config_path), "--model", model_path,
            "--host", "127.0.0.1", "--port", str(port)]


def launch_trainer(cfg: ExperimentConfig, model_path: str, log_dir: Path,
                   gpus: tuple[int, ...] = ()) -> tuple[ServerProcess, TrainerClient]:
    """Start the trainer on `gpus` (areal_pipeline/placement.py; empty: as the environment is), wait for its
    endpoint, initialise it (model + optimizer loaded once)."""
    process = trainer_process(cfg, model_path, log_dir, gpus).start()
    try:
        process.wait_healthy(cfg.trainer.setup_timeout)
        client = TrainerClient(process.address, cfg.trainer.command_timeout)
        client.call("initialize")
    except BaseException:
        process.stop()
        raise
    return process, client


def trainer_process(cfg: ExperimentConfig, model_path: str, log_dir: Path, gpus: tuple[int, ...] = ()) -> ServerProcess:
    """The trainer's process, not started: its command, environment (CUDA_VISIBLE_DEVICES: `gpus`) and fork."""
    from areal_pipeline.placement import gpu_env

    config_path = save_config(cfg, Path(log_dir) / "trainer-config.yaml")
    port = find_free_port()
    command = build_trainer_command(cfg, config_path, model_path, port)
    # On GPUs never forked: the forkserver's process may have initialised the CUDA driver, which a fork cannot use
    # (a trainer placed on GPUs, or told to use CUDA without a placement, as bench/train_throughput.py does)
    fork = None if gpus or cfg.trainer.device == "cuda" else single_rank_fork(cfg, command, Path(log_dir))
    return ServerProcess(command, f"127.0.0.1:{port}", Path(log_dir) / "trainer.log",
                         env=gpu_env(gpus) if gpus else None, fork=fork, kind="trainer")


def single_rank_fork(cfg: ExperimentConfig, command: list[str], log_dir: Path):
    """A one-process trainer as a fork of the preloaded forkserver (areal_pipeline/forkserver.py): the rank itself,
    without a torchrun agent, its process group rendezvousing through a file (no store listens anywhere) and its
    gloo device on loopback. None for several ranks or nodes: those go through torchrun."""
    if cfg.trainer.nproc != 1:
        return None
    module = "areal_pipeline.training.trainer_server"
    argv = command[command.index(module) + 1:]
    store = log_dir / f"trainer-rendezvous-{uuid.uuid4().hex}"  # a new file a launch: FileStore wants none there
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           TRAINER_INIT_METHOD_ENV: f"file://{store.resolve()}?rank=0&world_size=1",
           "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME") or _loopback_interface()}
    return module, argv, env


def _loopback_interface() -> str:
    from areal_pipeline.training.weight_group import loopback_interface

    return loopback_interface()


def run_one_node_torchrun(argv: Optional[list[str]] = None) -> None:
    """torchrun for a one-node trainer with nothing listening beyond loopback: its c10d stores would listen on
    every interface whatever address they are given, and the ranks' gloo on the address the host name resolves
    to (`--local-addr 127.0.0.1` then names loopback as the ranks' MASTER_ADDR)."""
    from torch.distributed.run import main as torchrun

    from areal_pipeline.training.weight_group import bind_stores_to_named_address, loopback_interface

    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
    bind_stores_to_named_address()
    torchrun(argv)


if __name__ == "__main__":
    run_one_node_torchrun()
