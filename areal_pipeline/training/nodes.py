"""A trainer on nodes of its own: each node runs `areal-pipeline trainer-node`, started by a scheduler (Slurm's
srun, a Kubernetes job, a shell on each host), and the run reaches rank 0's control endpoint over the network.

    areal-pipeline trainer-node --config run.yaml      # on every trainer node (torchrun under it)
    areal-pipeline train --config run.yaml             # on the head; trainer.address=auto finds rank 0

The nodes meet at `trainer.rdzv_endpoint` (torchrun's c10d rendezvous); which node becomes rank 0 is the
rendezvous' choice, so rank 0 announces its endpoint in `<run_dir>/trainer/endpoint.json` on the shared path, and
the run (trainer.address=auto) reads it there. A node lost mid-update fails the other node's ranks; torchrun
restarts them (trainer.max_restarts) once the scheduler has started the lost node again, and the run brings the
new ranks to its version from its checkpoint and batch shards, as it does a restarted local trainer.

Every address is a node's own: its ranks' gloo/NCCL sockets, rank 0's control endpoint and the weight-update
group's store listen on the address the node reaches the rendezvous from (or `--address`), never loopback.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from areal_pipeline.config import ExperimentConfig, to_dict
from areal_pipeline.config.addresses import is_loopback, split_address
from areal_pipeline.utils import atomic_write_text, get_logger

if TYPE_CHECKING:
    import torch

logger = get_logger(__name__)

class TrainerNodeError(RuntimeError):
    pass


def announce_path(cfg: ExperimentConfig) -> Path:
    """Where rank 0 of a trainer node announces its control endpoint (trainer.address=auto reads it)."""
    return Path(cfg.run_dir) / "trainer" / "endpoint.json"


def address_toward(host: str, port: int) -> str:
    """This host's address that packets to `host` leave from (the route's source address; nothing is sent)."""
    family, kind, proto, _, target = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.connect(target)
        return probe.getsockname()[0]


def is_local_address(host: str) -> bool:
    """Whether `host` names an address of this host (one a socket here can bind)."""
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as s:
            try:
                s.bind((address[0], 0))
                return True
            except OSError:
                continue
    return False


def node_address(cfg: ExperimentConfig, given: str = "") -> str:
    """The address this trainer node serves at: `given`, else the one it reaches the rendezvous from, else the
    one its host name resolves to. Never loopback: the other node and the run could not reach it."""
    t = cfg.trainer
    if given:  # a name is resolved here: the ranks' interface is looked up by address
        address = socket.getaddrinfo(given, 0, type=socket.SOCK_STREAM)[0][4][0]
    elif t.rdzv_endpoint:
        address = address_toward(*split_address(t.rdzv_endpoint))
    else:
        address = socket.gethostbyname(socket.gethostname())
    if is_loopback(address):
        raise TrainerNodeError(f"this node's address resolves to loopback ({address}), which other hosts cannot "
                               "reach: pass --address with an address of this node they reach")
    if not is_local_address(address):
        raise TrainerNodeError(f"--address {address} is not an address of this host")
    return address


def torchrun_argv(cfg: ExperimentConfig, config_path: Path, model_path: str, address: str) -> list[str]:
    """torchrun's arguments for this node: the rendezvous (c10d at trainer.rdzv_endpoint; one node: standalone),
    this node's address for its ranks, and the trainer module with rank 0's endpoint on that address."""
    t = cfg.trainer
    argv = ["--nnodes", str(t.nnodes), "--nproc-per-node", str(t.nproc), "--max-restarts", str(t.max_restarts),
            "--local-addr", address]
    if t.nnodes == 1:
        argv.append("--standalone")
    else:
        host, _ = split_address(t.rdzv_endpoint)
        # the store is hosted where the endpoint's address is local: decided here rather than by torch's guess from
        # the host name, which a node with several names or addresses gets wrong
        argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", t.rdzv_endpoint, "--rdzv-id", cfg.run_id,
                 "--rdzv-conf", f"is_host={str(is_local_address(host)).lower()}"]
    return [*argv, *t.torchrun_args, "-m", "areal_pipeline.training.trainer_server", "--config", str(config_path),
            "--model", model_path, "--host", address, "--port", str(t.port), "--announce", str(announce_path(cfg))]


def node_environment(address: str) -> dict[str, str]:
    """The ranks' collectives on the interface holding `address` (gloo and NCCL pick another one otherwise)."""
    from areal_pipeline.training.weight_group import interface_of

    interface = interface_of(address)
    if interface is None:
        raise TrainerNodeError(f"no network interface holds {address}")
    env = {name: os.environ.get(name) or interface for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    # torchrun's agents otherwise share the rendezvous' TCP store with the ranks and keep its address from the
    # first round: after a lost node, rank 0's agent never publishes it to the new round and both nodes wait for
    # each other until the store's timeout (a node restarting into a running job is exactly what must work)
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


def run_trainer_node(cfg: ExperimentConfig, model_path: str, address: str = "") -> None:
    """Run this node's part of the trainer under torchrun until it ends (a scheduler's job step)."""
    from torch.distributed.run import main as torchrun

    from areal_pipeline.config import save_config

    address = node_address(cfg, address)
    folder = Path(cfg.run_dir) / "trainer"
    config_path = save_config(cfg, folder / f"node-{address}-config.yaml")
    os.environ.update(node_environment(address))
    argv = torchrun_argv(cfg, config_path, model_path, address)
    logger.info("trainer node %s: torchrun %s", address, " ".join(argv))
    torchrun(argv)


# ----- the run's side ---------------------------------------------------------------------------------------------
def training_settings(cfg: ExperimentConfig) -> dict[str, Any]:
    """What decides the trainer's updates, as dotted keys: a trainer started with other values would train
    another run than the one that drives it."""
    keep = {"seed": cfg.seed, "total_iterations": cfg.total_iterations, "run_id": cfg.run_id,
            "rollout.gconfig.temperature": cfg.rollout.gconfig.temperature}
    for section in ("ppo", "trainer.optimizer", "trainer.lora", "model"):
        node: Any = cfg
        for part in section.split("."):
            node = getattr(node, part)
        keep.update(_flatten(to_dict(node), section))
    return keep


def _flatten(tree: dict, prefix: str) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}.{key}"))
        else:
            flat[f"{prefix}.{key}"] = value
    return flat


def settings_mismatch(ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """'key=theirs (this run: ours)' for every setting that differs."""
    return [f"{key}={theirs.get(key)!r} (this run: {value!r})" for key, value in ours.items()
            if json.dumps(theirs.get(key)) != json.dumps(value)]


def write_announcement(path: Path, address: str, run_id: str, world_size: int) -> None:
    atomic_write_text(Path(path), json.dumps({"address": address, "run_id": run_id, "world_size": world_size,
                                              "pid": os.getpid(), "host": socket.gethostname(),
                                              "started": time.time()}))


def announced_address(cfg: ExperimentConfig) -> Optional[str]:
    """The control endpoint rank 0 last announced for this run (None: none yet, or a file being replaced)."""
    try:
        return json.loads(announce_path(cfg).read_text())["address"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def wait_for_trainer(cfg: ExperimentConfig, timeout: float) -> tuple[str, dict]:
    """The address of the running trainer (trainer.address, or with "auto" the one announced) and its /health,
    once it answers; TrainerNodeError past `timeout` (its nodes may be starting, or their scheduler restarting
    a lost node), naming where it looked."""
    from areal_pipeline.training.client import TrainerClient

    deadline = time.monotonic() + timeout
    auto = cfg.trainer.address == "auto"
    last_error = "nothing announced yet"
    while True:
        address = announced_address(cfg) if auto else cfg.trainer.address
        if address is not None:
            try:
                return address, TrainerClient(address).health()
            except (OSError, ValueError) as e:
                last_error = f"{address}: {e}"
        if time.monotonic() >= deadline:
            where = f"announced in {announce_path(cfg)}" if auto else "at trainer.address"
            raise TrainerNodeError(f"no trainer answered {where} within {timeout:.0f}s ({last_error}): start the "
                                   "trainer nodes (`areal-pipeline trainer-node`, on each; `areal-pipeline cluster` "
                                   "prints the commands), or check trainer.address")
        time.sleep(0.5)


def connect_trainer(cfg: ExperimentConfig):
    """A client of the trainer running on its own nodes, checked to train this run with this run's settings, and
    initialised (the model loaded once; a trainer already initialised keeps its state)."""
    from areal_pipeline.training.client import TrainerClient

    address, health = wait_for_trainer(cfg, cfg.trainer.setup_timeout)
    if "settings" not in health:  # its bare liveness answer: this run's credential is not the trainer's
        from areal_pipeline.auth import TOKEN_FILE_ENV

        raise TrainerNodeError(f"the trainer at {address} refuses this run's credential: give the run the token its "
                               f"nodes were started with ({TOKEN_FILE_ENV}, as `areal-pipeline cluster` prints it "
                               "for the run), docs/security.md")
    differ = settings_mismatch(training_settings(cfg), health.get("settings") or {})
    if differ:
        raise TrainerNodeError(f"the trainer at {address} was started with other settings than this run's: "
                               f"{'; '.join(differ)}. Start its nodes with this run's config")
    client = TrainerClient(address, cfg.trainer.command_timeout)
    client.call("initialize")
    logger.info("using the trainer at %s (world size %s; started on its own nodes, not stopped by this run)",
                address, health.get("world_size"))
    return client


def trainer_threads(cfg: ExperimentConfig, device: torch.device, cores: Optional[int] = None) -> int:
    """Torch threads per rank: `trainer.num_threads`, or with 0 torch's default (every core), except for
    asynchronous training on CPU with CPU inference servers. There every update runs while the servers generate
    on the same cores, so a rank gets only the cores they leave: a thread more only contends with them (on the
    default run, 2 threads on 2 cores cut an update's wall time by ~15% for ~60% more CPU time)."""
    if cfg.trainer.num_threads > 0:
        return cfg.trainer.num_threads
    if cfg.rollout.max_head_offpolicyness == 0 or device.type != "cpu" or cfg.inference.backend != "cpu":
        return 0
    cores = cores or len(os.sched_getaffinity(0))
    serving = cfg.inference.num_servers * (cfg.inference.num_threads or cores)
    return max(1, (cores - serving) // cfg.trainer.nproc)
