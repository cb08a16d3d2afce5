"""The weight-update process group: how the trainer (rank 0) and the inference servers' ranks meet.

Both ends must build the group exactly as SGLang does in `init_custom_process_group` (sglang/srt/utils/common.py),
because the members find each other through keys in a TCPStore and each wrapper adds a prefix of its own:

    rendezvous("tcp://addr:port") -> PrefixStore(group_name, store) -> torch's _new_process_group_helper(group_name=)

and the helper prefixes "{group_name}/" then "{device}/". A group built any other way (e.g. ProcessGroupGloo on one
PrefixStore) waits on other keys and times out. The trainer hosts the store (rank 0) on the named address only;
the servers' ranks connect to it through `rendezvous`, as SGLang's do.

Its sockets listen on the master's address only (loopback for a local master): a c10d TCPStore server otherwise
listens on every interface whatever address it is given, and gloo on whatever the host name resolves to.
"""

from __future__ import annotations

import socket
import threading
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

from areal_pipeline.utils import environment, get_logger

logger = get_logger(__name__)

GROUP_TIMEOUT = timedelta(minutes=10)
# GLOO_SOCKET_IFNAME is read when a gloo group is built: one group at a time sets it
_gloo_env_lock = threading.Lock()


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


def interface_of(address: str) -> Optional[str]:
    """The name of the network interface holding the local IP `address` (None: no such interface)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family in (socket.AF_INET, socket.AF_INET6) and a.address.split("%")[0] == address
               for a in addresses):
            return name
    return None


def loopback_interface() -> str:
    """The name of the network interface holding 127.0.0.1 (for GLOO_SOCKET_IFNAME)."""
    return interface_of("127.0.0.1") or "lo"


def _interface_toward(master_address: str) -> Optional[str]:
    """The interface this host reaches `master_address` from (loopback for a local master)."""
    family, _, _, _, address = socket.getaddrinfo(master_address, 1, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)  # no packet is sent: this only picks the route
        return interface_of(probe.getsockname()[0])


def new_process_group(backend: str, store: dist.Store, rank: int, world_size: int, group_name: str,
                      timeout: timedelta) -> dist.ProcessGroup:
    """A standalone process group built as SGLang builds it: torch's private `_new_process_group_helper`, which no
    public API replaces (`new_group` needs a default group that holds every member). The one place this project
    calls it; tests/test_weight_group.py fails when a torch release changes what it relies on."""
    from torch.distributed import distributed_c10d as c10d

    group, _ = c10d._new_process_group_helper(world_size, rank, [], dist.Backend(backend), store,
                                              group_name=group_name, backend_options=None, timeout=timeout,
                                              device_id=None)
    # what dist.broadcast(..., group=) looks ranks up in; SGLang registers it the same way
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def _building(backend: str, master_address: str):
    """The environment a group is built in: gloo listens on the interface toward the master."""
    interface = _interface_toward(master_address) if backend == "gloo" else None
    return environment(GLOO_SOCKET_IFNAME=interface) if interface else environment()


def host_weight_group(backend: str, master_address: str, master_port: int, world_size: int, group_name: str,
                      timeout: timedelta = GROUP_TIMEOUT) -> tuple[dist.ProcessGroup, Any]:
    """Rank 0 (the trainer): host the store on `master_address` alone and join; blocks until all `world_size`
    members have joined. Returns (group, store): the store must outlive the group."""
    _check_backend(backend)
    store = NamedAddressTCPStore(master_address, master_port, world_size, is_master=True, timeout=timeout)
    with _gloo_env_lock, _building(backend, master_address):
        group = new_process_group(backend, dist.PrefixStore(group_name, store), 0, world_size, group_name, timeout)
    return group, store


def join_weight_group(backend: str, master_address: str, master_port: int, rank: int, world_size: int,
                      group_name: str, timeout: timedelta = GROUP_TIMEOUT) -> dist.ProcessGroup:
    """A server's rank (>= 1): join as SGLang's `init_custom_process_group` does, through torch's tcp:// rendezvous."""
    _check_backend(backend)
    if rank < 1:
        raise ValueError(f"rank {rank}: rank 0 of a weight-update group is the trainer")
    host = f"[{master_address}]" if ":" in master_address else master_address
    store, rank, world_size = next(dist.rendezvous(f"tcp://{host}:{master_port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    with _gloo_env_lock, _building(backend, master_address):
        return new_process_group(backend, dist.PrefixStore(group_name, store), rank, world_size, group_name, timeout)


def destroy_weight_group(group: dist.ProcessGroup) -> None:
    """Forget a group (its name can be used again); a group torch no longer knows is ignored."""
    try:
        dist.destroy_process_group(group)
    except (ValueError, RuntimeError) as e:
        logger.warning("could not destroy a weight-update group: %s", e)


def _check_backend(backend: str) -> None:
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"unknown weight-update backend '{backend}'; valid: gloo, nccl")
