"""Weight broadcast from the trainer to inference servers over a process group of their own.

The protocol is SGLang's: each server joins a group through `POST /init_weights_update_group` (the trainer is
rank 0; each tensor-parallel rank of server i joins as `rank_offset + tp_rank`, so server i's offset is 1 plus the
TP ranks of the servers before it), then for every update `POST /update_weights_from_distributed` announces the
tensors (names, dtypes, shapes) and the trainer broadcasts them in that order while the HTTP calls are still open.
The group is a standalone gloo (CPU) or NCCL (GPU) group, separate from the trainer's own, built as SGLang builds
it (weight_group.py).

An update is sent in buckets of about `bucket_bytes`: SGLang allocates every announced tensor before it receives
any, so one call for a whole model would need a second copy of it in GPU memory. The last bucket sets the version
and flushes the prefix cache.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import urllib.error
from datetime import timedelta
from typing import Any, Iterator, Optional

import torch

from areal_pipeline import auth
from areal_pipeline.training.weight_group import (  # noqa: F401  (bind_stores_to_named_address: used by client.py)
    GROUP_TIMEOUT,
    NamedAddressTCPStore,
    bind_stores_to_named_address,
    destroy_weight_group,
    host_weight_group,
    loopback_interface,
)
from areal_pipeline.utils import PeerTimeout, get_logger

logger = get_logger(__name__)

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
DTYPES = {v: k for k, v in DTYPE_NAMES.items()}
# SGLang's --dtype names that are other names of a wire dtype
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
DEFAULT_BUCKET_BYTES = 1 << 30  # AReaL's bucket size
# a group being replaced: servers that no longer answer must not hold up the new one for long
_DESTROY_TIMEOUT_S = 30.0


def wire_dtype(name: str, model_dtype: Any = None) -> str:
    """The dtype tensors travel in for SGLang's `--dtype name` (auto: the model's own, `model_dtype` as a torch dtype
    or its name; float32 where the model names none: the server casts what it receives to what it serves). A name
    SGLang does not take is a ValueError naming the valid ones."""
    name = DTYPE_ALIASES.get(name, name)
    if isinstance(model_dtype, str):
        model_dtype = getattr(torch, model_dtype, None)
    if name == "auto":
        return DTYPE_NAMES.get(model_dtype, "float32") if model_dtype is not None else "float32"
    if name not in DTYPES:
        raise ValueError(f"weight-sync dtype {name!r} is not one of auto, half, float, {', '.join(DTYPES)}")
    return name


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


def rank_offsets(tp_sizes: list[int]) -> tuple[list[int], int]:
    """(each server's rank_offset, the group's world size): rank 0 is the trainer, then every server's TP ranks."""
    if any(type(n) is not int or n < 1 for n in tp_sizes):
        raise ValueError(f"tensor-parallel sizes must be positive integers, got {tp_sizes}")
    offsets, next_rank = [], 1
    for n in tp_sizes:
        offsets.append(next_rank)
        next_rank += n
    return offsets, next_rank


@dataclasses.dataclass
class WeightGroup:
    """The trainer's side of one group, and whom it was built with: a group serves only the same members."""
    group: Any
    store: Any  # must outlive the group
    members: tuple  # (servers, tp sizes, epoch, backend, master address)
    servers: list[str]


def _post_all(servers: list[str], path: str, bodies: list[dict], results: list,
              timeout: float = GROUP_TIMEOUT.total_seconds()) -> list[threading.Thread]:
    def post(i: int, server: str) -> None:
        req = auth.request(server, path, data=json.dumps(bodies[i]).encode(),
                           headers={"Content-Type": "application/json"}, method="POST")
        try:
            with auth.opener().open(req, timeout=timeout) as resp:
                results[i] = json.loads(resp.read())
        except urllib.error.HTTPError as e:
            results[i] = {"success": False, "message": f"HTTP {e.code}: {e.read().decode(errors='replace')}"}
        except (OSError, ValueError) as e:
            results[i] = {"success": False, "message": f"{server} unreachable: {e}"}

    threads = [threading.Thread(target=post, args=(i, s), daemon=True) for i, s in enumerate(servers)]
    for t in threads:
        t.start()
    return threads


def _join_all(threads: list[threading.Thread], timeout: float = GROUP_TIMEOUT.total_seconds()) -> None:
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))


def _check(results: list, servers: list[str], what: str) -> None:
    failed = [f"{s}: {(r or {}).get('message', 'no reply')}" for s, r in zip(servers, results)
              if not (r or {}).get("success")]
    if failed:
        raise RuntimeError(f"{what} failed on {len(failed)} server(s): " + "; ".join(failed))


def forget_group(groups: dict[str, WeightGroup], group_name: str) -> None:
    """Drop the trainer's group `group_name` and ask its servers to drop theirs (a server that is gone, or never had
    it, is passed over): its name can then be joined again."""
    old = groups.pop(group_name, None)
    if old is None:
        return
    results: list = [None] * len(old.servers)
    _join_all(_post_all(old.servers, "/destroy_weights_update_group", [{"group_name": group_name}] * len(old.servers),
                        results, _DESTROY_TIMEOUT_S), _DESTROY_TIMEOUT_S)
    destroy_weight_group(old.group)


def _join(groups: dict[str, WeightGroup], servers: list[str], tp_sizes: list[int], members: tuple,
          master_address: str, master_port: int, group_name: str, backend: str,
          timeout: float = GROUP_TIMEOUT.total_seconds()) -> WeightGroup:
    offsets, world_size = rank_offsets(tp_sizes)
    # A server may still hold a group of this name from a trainer that is gone (SGLang then refuses the name):
    # it is dropped first, as a group of ours would be.
    results: list = [None] * len(servers)
    _join_all(_post_all(servers, "/destroy_weights_update_group", [{"group_name": group_name}] * len(servers),
                        results, _DESTROY_TIMEOUT_S), _DESTROY_TIMEOUT_S)
    bodies = [{"master_address": master_address, "master_port": master_port, "rank_offset": offset,
               "world_size": world_size, "group_name": group_name, "backend": backend} for offset in offsets]
    results = [None] * len(servers)
    threads = _post_all(servers, "/init_weights_update_group", bodies, results, timeout)
    hosted: dict[str, Any] = {}

    def host() -> None:
        try:
            hosted["group"] = host_weight_group(backend, master_address, master_port, world_size, group_name,
                                                timedelta(seconds=timeout))
        except BaseException as e:  # reported by the caller
            hosted["error"] = e

    # Hosting blocks until every rank has joined; a server that refuses to join answers at once, and then the wait
    # is cut short (the hosting thread ends at the group's own timeout).
    hosting = threading.Thread(target=host, daemon=True, name=f"host-{group_name}")
    hosting.start()
    deadline = time.monotonic() + timeout
    while hosting.is_alive() and time.monotonic() < deadline:
        if any(r is not None and not r.get("success") for r in results):
            _check(results, servers, "init_weights_update_group")
        hosting.join(0.05)
    if "group" not in hosted:
        if "error" not in hosted:
            raise PeerTimeout(", ".join(s for s, r in zip(servers, results) if not (r or {}).get("success")),
                              f"join of weight-update group {group_name} on {master_address}:{master_port}", timeout)
        raise RuntimeError(f"could not host weight-update group {group_name} on {master_address}:{master_port}: "
                           f"{hosted['error']}")
    group, store = hosted["group"]
    _join_all(threads, timeout)
    joined = WeightGroup(group, store, members, list(servers))
    try:
        _check(results, servers, "init_weights_update_group")
    except BaseException:
        destroy_weight_group(group)
        raise
    groups[group_name] = joined
    return joined


def wait_for(work: Any, timeout: float, peer: Any, what: str) -> None:
    """`work.wait()` (a collective's), at most `timeout` seconds: past it a PeerTimeout naming `peer` (a name, or a
    function giving one then), since torch reports a collective's timeout as a RuntimeError."""
    try:
        work.wait(timedelta(seconds=timeout))
    except RuntimeError as e:
        if "timed out" not in str(e).lower() and "timeout" not in str(e).lower():
            raise
        raise PeerTimeout(peer() if callable(peer) else peer, what, timeout) from e


def _send(group: Any, tensor: torch.Tensor, timeout: float, absent, what: str) -> None:
    """Broadcast `tensor` from rank 0, within `timeout` seconds. A member that stops receiving (hung, stopped,
    or gone without closing its sockets) otherwise blocks the trainer for good; `absent()` names the servers to
    blame: those that answered their update call while the broadcast was still waiting on them (a server answers
    only once it has received every tensor), or else every member (which one stalled is not known then)."""
    wait_for(group.broadcast(tensor, root=0), timeout, lambda: ", ".join(absent()), f"receive of {what}")


def buckets(names: list[str], sizes: list[int], bucket_bytes: int) -> Iterator[list[str]]:
    """`names` in order, cut where a bucket would pass `bucket_bytes` (a tensor larger than that goes alone)."""
    bucket: list[str] = []
    filled = 0
    for name, size in zip(names, sizes):
        if bucket and filled + size > bucket_bytes:
            yield bucket
            bucket, filled = [], 0
        bucket.append(name)
        filled += size
    if bucket:
        yield bucket


def broadcast_weights(groups: dict[str, WeightGroup], state: dict[str, torch.Tensor], servers: list[str],
                      version: int, master_address: str, master_port: int, group_name: str, dtype: str, backend: str,
                      tied_embeddings: bool, tp_sizes: Optional[list[int]] = None, epoch: int = 0,
                      bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                      timeout: float = GROUP_TIMEOUT.total_seconds()) -> float:
    """Trainer side (rank 0): join the group with `servers` (each with `tp_sizes[i]` ranks; 1 each by default), or
    reuse the one joined with the same servers, sizes and `epoch` (which the caller bumps whenever a server may have
    restarted: a restarted server has no group, and SGLang dies on an update for a group it lacks), then broadcast
    `state` in buckets. Returns seconds. A join or a tensor's broadcast that takes more than `timeout` seconds
    (trainer.collective_timeout) is a PeerTimeout naming the servers that did not take part."""
    started = time.perf_counter()
    tp_sizes = list(tp_sizes) if tp_sizes is not None else [1] * len(servers)
    if len(tp_sizes) != len(servers):
        raise ValueError(f"{len(tp_sizes)} tensor-parallel sizes for {len(servers)} servers")
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    wire = DTYPES[wire_dtype(dtype)]
    members = (tuple(servers), tuple(tp_sizes), epoch, backend, master_address)
    if group_name in groups and groups[group_name].members != members:
        forget_group(groups, group_name)
    joined = groups.get(group_name) or _join(groups, servers, tp_sizes, members, master_address, master_port,
                                             group_name, backend, timeout)
    # A tied lm_head is the embedding: the server updates both when it receives one.
    names = [n for n in state if not (tied_embeddings and n == "lm_head.weight")]
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    sizes = [state[n].numel() * wire.itemsize for n in names]
    parts = list(buckets(names, sizes, bucket_bytes))
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            body = {"names": part, "dtypes": [DTYPE_NAMES[wire]] * len(part),
                    "shapes": [list(state[n].shape) for n in part], "group_name": group_name,
                    "flush_cache": last, "abort_all_requests": False,
                    "weight_version": str(version) if last else None}
            results: list = [None] * len(servers)
            threads = _post_all(servers, "/update_weights_from_distributed", [body] * len(servers), results, timeout)
            try:
                for name in part:
                    _send(joined.group, state[name].to(device=device, dtype=wire).contiguous(), timeout,
                          lambda: [s for s, r in zip(servers, results) if r is not None] or servers,
                          f"{name} of weight version {version}")
            finally:
                _join_all(threads, timeout)
            _check(results, servers, "update_weights_from_distributed")
    except BaseException:
        # the members may be out of step (a server that failed posts fewer receives): the next update joins afresh
        forget_group(groups, group_name)
        raise
    return time.perf_counter() - started
