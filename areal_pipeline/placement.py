"""Which GPUs each process of a run uses: inference servers and trainer ranks.

    placement = plan(cfg)                        # before any process starts; PlacementError if it cannot fit
    env = gpu_env(placement.servers[i])          # CUDA_VISIBLE_DEVICES of server i
    env = gpu_env(placement.trainer)             # of the trainer (torchrun and its ranks)

GPU indices in the config (`inference.gpus`, `trainer.gpus`) are the ones this process sees, as torch numbers them:
within CUDA_VISIBLE_DEVICES when it is set (a scheduler's allocation), so a child's CUDA_VISIBLE_DEVICES names the
same physical devices. Every process then sees only its own GPUs: SGLang starts at `--base-gpu-id 0` of them, the
project's own server uses `cuda` (its first), trainer rank r uses `cuda:r`.

Automatic placement (both lists empty) is AReaL's disjoint default, `sglang:dN+fsdp:dM`: the servers take the first
num_servers x tp_size x dp_size GPUs, the trainer the next nproc. With `trainer.colocate` both start at GPU 0 and
share it, their memory split by `inference.sglang.mem_fraction_static` and `trainer.memory_fraction`.

No torch import at module level: the config checks use the counting functions below. What the lists must be to
each other and to the processes (a GPU per NCCL rank, tp_size x dp_size per server, shared ones only colocated) is a
rule of the config (run_spec.py), checked at load; `plan` checks them against the GPUs this machine has.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Optional

from areal_pipeline.errors import PermanentError

if TYPE_CHECKING:
    from areal_pipeline.config import ExperimentConfig, InferenceConfig, TrainerConfig

CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"


class PlacementError(PermanentError, ValueError):
    """The run's processes cannot be placed on the GPUs this machine has (a config or machine problem)."""


def gpus_per_server(inf: "InferenceConfig") -> int:
    """GPUs one launched inference server takes (0: it runs on the CPU, or none is launched)."""
    if inf.addresses:
        return 0
    if inf.backend == "sglang":
        return inf.sglang.tp_size * inf.sglang.dp_size
    return 1 if inf.device == "cuda" else 0


def trainer_gpu_count(t: "TrainerConfig", cuda_available: bool) -> int:
    """GPUs the trainer's ranks on one node need: one each (NCCL puts two ranks on one GPU never); with gloo, ranks
    may share the GPUs given (`trainer.gpus`)."""
    if t.device == "cpu" or (t.device == "auto" and not cuda_available):
        return 0
    if t.backend == "gloo" and t.gpus:
        return len(t.gpus)
    return t.nproc


@dataclass(frozen=True)
class Placement:
    servers: tuple[tuple[int, ...], ...]  # per launched inference server, its GPUs (empty: the CPU)
    trainer: tuple[int, ...]  # the trainer's GPUs on this node, rank r on trainer[r] (empty: the CPU)

    @property
    def shared(self) -> tuple[int, ...]:
        """GPUs used by both the trainer and an inference server."""
        return tuple(sorted(set(self.trainer) & {g for s in self.servers for g in s}))


def visible_gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def plan(cfg: "ExperimentConfig", visible: Optional[int] = None, cuda_available: Optional[bool] = None) -> Placement:
    """The GPUs of every launched process; PlacementError when they do not fit the `visible` GPUs.
    `visible`/`cuda_available` default to what torch sees here (asked only when some process may use a GPU)."""
    inf, t = cfg.inference, cfg.trainer
    per_server = gpus_per_server(inf)
    n_inf = per_server * inf.num_servers
    may_use_gpu = n_inf > 0 or t.device != "cpu"
    if not may_use_gpu:
        return Placement(servers=tuple(() for _ in range(0 if inf.addresses else inf.num_servers)), trainer=())
    if visible is None:
        visible = visible_gpu_count()
    if cuda_available is None:
        cuda_available = visible > 0
    n_trainer = trainer_gpu_count(t, cuda_available)
    if n_inf + n_trainer == 0:
        return Placement(servers=tuple(() for _ in range(0 if inf.addresses else inf.num_servers)), trainer=())
    shown = os.environ.get(CUDA_VISIBLE_DEVICES)
    seen = f"{visible} GPU(s) visible" + (f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else "")

    def pick(count: int, given: list[int], other: Optional[list[int]], what: str, key: str) -> list[int]:
        if given or count == 0:
            return list(given)
        taken = set() if t.colocate or other is None else set(other)
        free = [i for i in range(visible) if i not in taken]
        if len(free) < count:
            raise PlacementError(
                f"the {what} {'needs' if what == 'trainer' else 'need'} {count} GPU(s) and {len(free)} of the {seen} are left for them"
                + ("" if t.colocate else f" ({len(taken)} taken by the {'trainer' if what != 'trainer' else 'inference servers'})")
                + f": fewer {'ranks (trainer.nproc)' if what == 'trainer' else 'servers or a smaller tp_size'}, "
                  f"trainer.colocate=true to share GPUs, or {key} to place them")
        return free[:count]

    # explicit lists first, so that an automatic one fills what they leave
    server_ids = list(inf.gpus) if inf.gpus else None
    trainer_ids = list(t.gpus) if t.gpus else None
    if server_ids is None:
        server_ids = pick(n_inf, [], trainer_ids, "inference servers", "inference.gpus")
    if trainer_ids is None:
        trainer_ids = pick(n_trainer, [], server_ids, "trainer", "trainer.gpus")
    if n_trainer == 0:
        trainer_ids = []
    beyond = sorted({i for i in server_ids + trainer_ids if i >= visible})
    if beyond:
        raise PlacementError(f"GPU(s) {beyond} are placed (inference.gpus={server_ids}, trainer.gpus={trainer_ids}) "
                             f"but this machine has {seen}: indices count from 0 within CUDA_VISIBLE_DEVICES")
    servers = tuple(tuple(server_ids[i * per_server:(i + 1) * per_server]) for i in range(inf.num_servers)) \
        if not inf.addresses else ()
    return Placement(servers=servers, trainer=tuple(trainer_ids))


def gpu_env(gpus: tuple[int, ...] | list[int], environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """`environ` (default: this process's) with CUDA_VISIBLE_DEVICES naming `gpus` as this process numbers them."""
    environ = dict(os.environ if environ is None else environ)
    parent = environ.get(CUDA_VISIBLE_DEVICES)
    if parent is not None:
        entries = [e.strip() for e in parent.split(",") if e.strip()]
        if any(g >= len(entries) for g in gpus):
            raise PlacementError(f"GPU(s) {list(gpus)} placed, but CUDA_VISIBLE_DEVICES={parent} names "
                                 f"{len(entries)}")
        environ[CUDA_VISIBLE_DEVICES] = ",".join(entries[g] for g in gpus)
    else:
        environ[CUDA_VISIBLE_DEVICES] = ",".join(str(g) for g in gpus)
    return environ


def rank_cuda_index(local_rank: int, visible: int, backend: str) -> int:
    """The CUDA device (of those this rank sees) for `local_rank`: its own, or with gloo a shared one; an error
    naming the way out where NCCL would put two ranks on one GPU or no GPU is visible at all."""
    shown = os.environ.get(CUDA_VISIBLE_DEVICES, "<unset>")
    if visible == 0:
        raise PlacementError(f"trainer rank {local_rank} is to run on CUDA but sees no GPU "
                             f"(CUDA_VISIBLE_DEVICES={shown}): trainer.device=cpu, or give it GPUs (trainer.gpus)")
    if local_rank < visible:
        return local_rank
    if backend == "nccl":
        raise PlacementError(f"trainer rank {local_rank} has no GPU of its own: {visible} visible "
                             f"(CUDA_VISIBLE_DEVICES={shown}) and NCCL never puts two ranks on one GPU; set "
                             f"trainer.nproc to at most {visible}, or give the trainer more GPUs (trainer.gpus)")
    return local_rank % visible


def gpu_uuid(device) -> Optional[str]:
    """The physical GPU behind a torch device (its UUID; None off CUDA): the same GPU under any
    CUDA_VISIBLE_DEVICES numbering, so two processes can tell whether they share one."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return str(torch.cuda.get_device_properties(index).uuid)
