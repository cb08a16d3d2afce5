"""Weight broadcast from the trainer to inference servers over a process group of their own.

The protocol is SGLang's: each server joins a group through `POST /init_weights_update_group` (the trainer is
rank 0, server i takes rank `1 + i`), then for every update `POST /update_weights_from_distributed` announces
the tensors (names, dtypes, shapes) and the trainer broadcasts them in that order while the HTTP calls are
still open. The group is a standalone gloo (CPU) or NCCL (GPU) group, separate from the trainer's own.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from areal_pipeline.utils import get_logger

logger = get_logger(__name__)

_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
GROUP_TIMEOUT = timedelta(minutes=10)
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
DTYPES = {v: k for k, v in DTYPE_NAMES.items()}


def create_weight_update_group(backend: str, master_address: str, master_port: int, rank: int, world_size: int,
                               group_name: str, timeout: timedelta = GROUP_TIMEOUT):
    """Join (rank 0: host) a standalone process group; blocks until all `world_size` members have joined."""
    store = dist.TCPStore(master_address, master_port, world_size, is_master=(rank == 0), timeout=timeout)
    prefixed = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
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
