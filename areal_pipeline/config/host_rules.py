"""The configuration's rules of a run across hosts (config/rules.py holds them in CROSS_RULES): weight updates reach
every server, the trainer's nodes meet at a rendezvous every node reaches, and every path another host opens
names the same file there; and the servers a line records its traffic on are the project's."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

from areal_pipeline.config.addresses import is_loopback, split_address, weight_group_master
from areal_pipeline.config.schema import ExperimentConfig

Key = Callable[[str], str]  # as config/rules.py's


def _on_other_hosts(addresses: list[str]) -> list[str]:
    return [a for a in addresses if not is_loopback(split_address(a)[0])]


def weights_reach_the_servers(cfg: ExperimentConfig, key: Key) -> Iterator[str]:
    """Weight updates must be able to reach every server: SGLang takes them over NCCL only from a trainer on a
    GPU, and servers on other hosts neither read this host's run directory nor reach its loopback."""
    inf, t = cfg.inference, cfg.trainer
    if t.weight_sync == "distributed" and t.device == "cpu" and inf.backend == "sglang" and not inf.addresses:
        yield (f"{key('trainer.weight_sync')}='distributed': SGLang servers receive weights over NCCL, which a "
               f"trainer on the CPU ({key('trainer.device')}=cpu) cannot take part in; use "
               f"{key('trainer.weight_sync')}=disk")
    if t.weight_sync == "distributed" and inf.backend == "vllm":
        yield (f"{key('trainer.weight_sync')}='distributed': not supported with {key('inference.backend')}=vllm "
               "(vLLM's weight transfer engine needs GPUs on both sides and is not wired to this trainer); use "
               f"{key('trainer.weight_sync')}=disk (each version is loaded with vLLM's reload_weights)")
    if t.weight_sync == "distributed" and inf.backend == "sglang" and inf.sglang.dp_size > 1:
        yield (f"{key('inference.sglang.dp_size')}={inf.sglang.dp_size}: must be 1 with "
               f"{key('trainer.weight_sync')}='distributed' (SGLang updates weights from a process group only "
               f"without data parallelism inside a server); run more servers ({key('inference.num_servers')}) or "
               f"use {key('trainer.weight_sync')}=disk")
    remote = _on_other_hosts(inf.addresses)
    master = weight_group_master(t.weight_sync_master_address, t.address)
    if remote and t.weight_sync == "distributed" and master and is_loopback(master):
        where = ("" if t.weight_sync_master_address else " (the launched trainer's address, 127.0.0.1)"
                 if not t.address else f" (the host of {key('trainer.address')}={t.address!r})")
        yield (f"{key('trainer.weight_sync_master_address')}={t.weight_sync_master_address!r}{where}: servers on "
               f"other hosts ({', '.join(remote)}) cannot reach it; set it to this host's address they reach")


def hosts_reach_each_other(cfg: ExperimentConfig, key: Key) -> Iterator[str]:
    """A run across hosts: a trainer of several nodes runs on its own nodes and meets at a rendezvous every node
    reaches; every address another host uses is one it can reach; every path another host opens names the same
    file there (a shared file system, so absolute)."""
    inf, t = cfg.inference, cfg.trainer
    if t.nnodes > 1 and not t.address:
        yield (f"{key('trainer.nnodes')}={t.nnodes}: a trainer of several nodes runs on them, each node started by "
               f"`areal-pipeline trainer-node` (`areal-pipeline cluster` prints the commands); set "
               f"{key('trainer.address')}=auto (or rank 0's host:port) for this run to use it")
    if t.nnodes > 1 and (not t.rdzv_endpoint or is_loopback(split_address(t.rdzv_endpoint)[0])):
        yield (f"{key('trainer.rdzv_endpoint')}={t.rdzv_endpoint!r}: {t.nnodes} trainer nodes meet at a rendezvous "
               "every node reaches: host:port of the first node's address")
    endpoint = split_address(t.address) if t.address not in ("", "auto") else None
    if endpoint is not None and t.port != endpoint[1]:
        yield (f"{key('trainer.port')}={t.port}: the trainer's nodes serve rank 0's endpoint on it, and the run looks "
               f"for it at {key('trainer.address')}={t.address!r}: set it to {endpoint[1]} (or "
               f"{key('trainer.address')}=auto, which finds any port)")
    remote_trainer = t.address == "auto" or (endpoint is not None and not is_loopback(endpoint[0]))
    remote_servers = _on_other_hosts(inf.addresses)
    if remote_trainer and t.weight_sync_master_address and is_loopback(t.weight_sync_master_address):
        yield (f"{key('trainer.weight_sync_master_address')}={t.weight_sync_master_address!r}: the trainer runs on "
               "other hosts, where loopback is their own; leave it empty (the trainer's own address) or name an "
               "address of rank 0's node")
    if remote_trainer and t.weight_sync == "distributed" and not inf.addresses and is_loopback(inf.host):
        yield (f"{key('inference.host')}={inf.host!r}: the trainer on other hosts sends weights to the servers this "
               "run launches; set it to an address of this host the trainer's nodes reach")
    if remote_trainer and not Path(cfg.output_dir).is_absolute():
        yield (f"{key('output_dir')}={cfg.output_dir!r}: the trainer's nodes read the run's shards and write its "
               "checkpoints by path: set it to an absolute path that every host reads at the same name (a shared "
               "file system)")
    weights = t.weights_dir or cfg.output_dir  # empty: <output_dir>/<run_id>/weights
    if (remote_trainer or remote_servers) and t.weight_sync == "disk" and not Path(weights).is_absolute():
        hosts = ", ".join(remote_servers) or "the trainer's"
        yield (f"{key('trainer.weights_dir')}={t.weights_dir!r}: servers on other hosts ({hosts}) load each version "
               f"from a directory: set it (or {key('output_dir')}) to an absolute path they read at the same name "
               "(a shared file system)")


def only_the_projects_server_records(cfg: ExperimentConfig, key: Key) -> Iterator[str]:
    serve = cfg.recurring.serve
    backend = serve.backend or cfg.inference.backend
    if serve.record and backend != "cpu":
        yield (f"{key('recurring.serve.record')}=true: only the project's server records the traffic it serves; "
               f"the line's servers speak {backend} ({key('recurring.serve.backend')} / {key('inference.backend')})")
