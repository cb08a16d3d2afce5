"""Weight broadcast from the trainer to inference servers over a process group of their own.

The protocol is SGLang's: each server joins a group through `POST /init_weights_update_group` (the trainer is
rank 0, server i takes rank `1 + i`), then for every update `POST /update_weights_from_distributed` announces
the tensors (names, dtypes, shapes) and the trainer broadcasts them in that order while the HTTP calls are
still open. The group is a standalone gloo (CPU) or NCCL (GPU) group, separate from the trainer's own.

Its sockets listen on the master's address only (loopback for a local master): a c10d TCPStore server
otherwise listens on every interface whatever address it is given, and gloo on whatever the host name
resolves to. `bind_stores_to_named_address` does the same for torchrun's own stores.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from areal_pipeline.utils import get_logger

logger = get_logger(__name__)

_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
GROUP_TIMEOUT = timedelta(minutes=10)
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
DTYPES = {v: k for k, v in DTYPE_NAMES.items()}


def _listening_socket(host: str, port: int) -> tuple[int, int]:
    """(file descriptor, port) of a socket listening on `host`'s address only; port 0: a free one."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    bound_port = sock.getsockname()[1]
    return sock.detach(), bound_port  # the store's server owns the socket from here on


class NamedAddressTCPStore(dist.TCPStore):
    """A TCPStore whose server listens on the address it is named by (127.0.0.1: loopback only) rather than on
    every interface; clients are ordinary TCPStores."""

    def __init__(self, host_name: str, port: int, world_size: Optional[int] = None, is_master: bool = False,
                 timeout: timedelta = timedelta(seconds=300), wait_for_workers: bool = True,
                 multi_tenant: bool = False, master_listen_fd: Optional[int] = None, use_libuv: bool = True):
        if is_master and master_listen_fd is None:
            try:
                master_listen_fd, port = _listening_socket(host_name, port)
            except OSError as e:  # e.g. a multi-tenant server of this process already has the port
                logger.warning("TCPStore %s:%s listens on every interface: cannot bind the address alone (%s)",
                               host_name, port, e)
        super().__init__(host_name, port, world_size, is_master, timeout, wait_for_workers, multi_tenant,
                         master_listen_fd, use_libuv)


def bind_stores_to_named_address() -> None:
    """Make every TCPStore server this process starts from now on listen on its named address only, torchrun's
    rendezvous and worker stores included (torch builds them itself, so its name for the class is replaced)."""
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend

    dist.TCPStore = c10d_rendezvous_backend.TCPStore = NamedAddressTCPStore


def loopback_interface() -> str:
    """The name of the network interface holding 127.0.0.1 (for GLOO_SOCKET_IFNAME)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addresses):
            return name
    return "lo"


def _gloo_options_toward(master_address: str, timeout: timedelta):
    """Gloo options whose device listens on the address this host reaches the master from (loopback for a
    local master), rather than on whatever the host name resolves to."""
    family, _, _, _, address = socket.getaddrinfo(master_address, 1, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)  # no packet is sent: this only picks the route
        local_address = probe.getsockname()[0]
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address)]
    options._timeout = timeout
    return options


def weight_group_backend(trainer_gpu: Optional[str], server_devices: Optional[list[str]],
                         server_gpus: Optional[list[Optional[str]]], colocated: bool) -> str:
    """The weight-update group's backend: NCCL where the trainer (`trainer_gpu`: its GPU's UUID, None off CUDA) and
    every server (`server_devices`, None: where the trainer is) are on GPUs and none shares the trainer's GPU
    (`server_gpus`, their UUIDs where known; `colocated`: the run lets them share): NCCL refuses two members on one
    GPU. Otherwise gloo, the trainer sending host copies."""
    if trainer_gpu is None:
        return "gloo"
    if server_devices is not None and not all(str(d).startswith("cuda") for d in server_devices):
        return "gloo"
    if colocated or trainer_gpu in {g for g in server_gpus or () if g}:
        return "gloo"
    return "nccl"


def create_weight_update_group(backend: str, master_address: str, master_port: int, rank: int, world_size: int,
                               group_name: str, timeout: timedelta = GROUP_TIMEOUT):
    """Join (rank 0: host) a standalone process group; blocks until all `world_size` members have joined."""
    store = NamedAddressTCPStore(master_address, master_port, world_size, is_master=(rank == 0), timeout=timeout)
    prefixed = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, _gloo_options_toward(master_address, timeout))
    elif backend == "nccl":
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size)
    else:
        raise ValueError(f"unknown weight-update backend '{backend}'; valid: gloo, nccl")
    return group, store  # the store must outlive the group


def _post_all(servers: list[str], path: str, bodies: list[dict], results: list) -> list[threading.Thread]:
    def post(i: int, server: str) -> None:
        req = urllib.request.Request(f"http://{server}{path}", data=json.dumps(bodies[i]).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        try:
            with _opener.open(req, timeout=GROUP_TIMEOUT.total_seconds()) as resp:
                results[i] = json.loads(resp.read())
        except urllib.error.HTTPError as e:
            results[i] = {"success": False, "message": f"HTTP {e.code}: {e.read().decode(errors='replace')}"}
        except OSError as e:
            results[i] = {"success": False, "message": f"{server} unreachable: {e}"}

    threads = [threading.Thread(target=post, args=(i, s), daemon=True) for i, s in enumerate(servers)]
    for t in threads:
        t.start()
    return threads


def _check(results: list, servers: list[str], what: str) -> None:
    failed = [f"{s}: {(r or {}).get('message', 'no reply')}" for s, r in zip(servers, results)
              if not (r or {}).get("success")]
    if failed:
        raise RuntimeError(f"{what} failed on {len(failed)} server(s): " + "; ".join(failed))


def broadcast_weights(groups: dict[str, Any], state: dict[str, torch.Tensor], servers: list[str], version: int,
                      master_address: str, master_port: int, group_name: str, dtype: str, backend: str,
                      tied_embeddings: bool) -> float:
    """Trainer side (rank 0): join or reuse the group with `servers`, then broadcast `state`. Returns seconds."""
    started = time.perf_counter()
    if group_name not in groups:
        world_size = 1 + len(servers)
        results: list = [None] * len(servers)
        bodies = [{"master_address": master_address, "master_port": master_port, "rank_offset": 1 + i,
                   "world_size": world_size, "group_name": group_name, "backend": backend}
                  for i in range(len(servers))]
        threads = _post_all(servers, "/init_weights_update_group", bodies, results)
        groups[group_name] = create_weight_update_group(backend, master_address, master_port, 0, world_size,
                                                        group_name)
        for t in threads:
            t.join()
        _check(results, servers, "init_weights_update_group")
    group, _store = groups[group_name]
    # A tied lm_head is the embedding: the server updates both when it receives one.
    names = [n for n in state if not (tied_embeddings and n == "lm_head.weight")]
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    body = {"names": names, "dtypes": [dtype] * len(names), "shapes": [list(state[n].shape) for n in names],
            "group_name": group_name, "flush_cache": True, "abort_all_requests": False,
            "weight_version": str(version)}
    results = [None] * len(servers)
    threads = _post_all(servers, "/update_weights_from_distributed", [body] * len(servers), results)
    for name in names:
        group.broadcast(state[name].to(device=device, dtype=DTYPES[dtype]).contiguous(), root=0).wait()
    for t in threads:
        t.join()
    _check(results, servers, "update_weights_from_distributed")
    return time.perf_counter() - started
