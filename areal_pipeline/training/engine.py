"""The FSDP2 train engine: a causal LM sharded with `fully_shard` over all ranks, trained on packed sequences.

Every public method is a collective: all ranks call it with the same arguments (the trainer process
broadcasts each command). A batch is a dict of columns, one entry per sequence: `input_ids` (list of token
ids) and per-token float lists (`loss_mask`, `logprobs`, `advantages`, ...) in the trajectory convention
(`x[t]` belongs to token t). A new algorithm is a `loss_fn`, not a change here:

    loss, stats = loss_fn(logprobs, entropy, mb)   # per-token [N] tensors of a packed micro-batch
    weight = loss_weight_fn(mb)                     # e.g. its number of loss tokens

`train_batch` makes the loss a `loss_weight_fn`-weighted mean over the global minibatch across ranks, so
1 rank and N ranks compute the same update.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from areal_pipeline.checksums import verify_checksums, write_checksums
from areal_pipeline.model import DTYPES
from areal_pipeline.training import lora
from areal_pipeline.training.checkpoint_io import (MODEL_SUBDIR, flatten_optimizer_state, read_hf_weights,
                                                   rng_state, set_rng_state, unflatten_optimizer_state,
                                                   write_hf_dir)
from areal_pipeline.training.losses import logprobs_and_entropy, use_compiled_vocab_kernels
from areal_pipeline.training.packing import (MicroBatch, balance, count_micro_batches, pack, shared_prefix_units,
                                                unit_length, unpack)
from areal_pipeline.utils import atomic_directory, atomic_write_text, get_logger

logger = get_logger(__name__)

LossFn = Callable[[torch.Tensor, torch.Tensor, MicroBatch], tuple[torch.Tensor, dict[str, torch.Tensor]]]
WeightFn = Callable[[MicroBatch], float]


def resolve_device(device: str, backend: str = "auto") -> torch.device:
    """The rank's device: on CUDA its own GPU among those it sees (the trainer's, areal_pipeline/placement.py), or
    with gloo a shared one; PlacementError where NCCL would put two ranks on one GPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        import os

        from areal_pipeline.placement import rank_cuda_index

        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        backend = "nccl" if backend == "auto" else backend
        return torch.device("cuda", rank_cuda_index(int(os.environ.get("LOCAL_RANK", 0)), visible, backend))
    return torch.device(device)


def lr_lambda(kind: str, total_steps: int, warmup_steps: int, min_lr_ratio: float) -> Callable[[int], float]:
    """Multiplier of the base LR at optimizer step `step`: linear warm-up, then constant/linear/cosine decay."""
    if kind not in ("constant", "linear", "cosine"):
        raise ValueError(f"unknown lr_scheduler_type '{kind}'; valid: constant, linear, cosine")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        decay = 1.0 - progress if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return min_lr_ratio + (1.0 - min_lr_ratio) * decay

    return factor



def attention_implementation(model) -> str:
    """The attention `model` runs ("sdpa", "eager", ...). transformers sets it publicly (`attn_implementation=`,
    `set_attn_implementation`) but has no public reader: the name it keeps it under is read here only, and
    tests/test_prefect_surface.py fails where a release moves it."""
    return getattr(model.config, "_attn_implementation", None) or "sdpa"

class TrainEngine:
    def __init__(self, model_path: str, trainer_cfg, *, total_steps: int, temperature: float = 1.0,
                 trust_remote_code: bool = False, trainable: bool = True, seed: int = 0):
        self.model_path = model_path
        self.seed = seed  # the adapters' initial values (trainer.lora)
        self.lora = trainer_cfg.lora.enabled
        self.cfg = trainer_cfg
        self.total_steps = total_steps
        self.temperature = temperature
        self.trust_remote_code = trust_remote_code
        self.trainable = trainable
        self.device = resolve_device(trainer_cfg.device, trainer_cfg.backend)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.version = 0
        self.model = self.optimizer = self.scheduler = None

    # ----- set-up ----------------------------------------------------------------------------------
    def initialize(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self._load_dtype(),
                                                     trust_remote_code=self.trust_remote_code)
        model.config.use_cache = False
        if self.cfg.gradient_checkpointing and self.trainable:
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.lora:  # before sharding: FSDP2 then shards the adapters with the frozen layers they sit on
            model = lora.wrap(model, self.cfg.lora, self.seed, self.model_path)
        model.to(self.device)
        param_dtype = self.cfg.param_dtype
        if param_dtype == "auto":
            param_dtype = "bfloat16" if self.device.type == "cuda" else "float32"
        mp = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=torch.float32)
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        compile_layers = self.cfg.compile_layers
        if compile_layers is None:
            compile_layers = self.device.type == "cuda"
        for layer in (model.get_base_model() if self.lora else model).model.layers:
            if compile_layers:  # fuses each block's norms, rotary and SwiGLU; FSDP's hooks stay outside the graph
                layer.compile()
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        self.model = model
        use_compiled_vocab_kernels(self.cfg.compile and self.device.type == "cuda")
        if not self.trainable:
            model.eval().requires_grad_(False)
            return
        model.train()
        o = self.cfg.optimizer
        self.optimizer = torch.optim.AdamW(self.trainable_parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                           weight_decay=o.weight_decay)
        warmup = int(o.warmup_steps_proportion * self.total_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(o.lr_scheduler_type, self.total_steps, warmup, o.min_lr_ratio))

    def _load_dtype(self) -> torch.dtype:
        """float32 (the master weights of what is trained), or with LoRA the frozen base's trainer.lora.base_dtype:
        peft keeps the adapters in float32 over it, and FSDP2 asks a uniform dtype of the trained parameters only."""
        if not self.lora:
            return torch.float32
        chosen = self.cfg.lora.base_dtype
        if chosen == "auto":
            chosen = "bfloat16" if self.device.type == "cuda" else "float32"
        return DTYPES[chosen]

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """What the optimizer updates and the clipping measures: every parameter, or with LoRA the adapters'."""
        return [p for p in self.model.parameters() if p.requires_grad]

    # ----- data layout -----------------------------------------------------------------------------
    @property
    def shares_prefixes(self) -> bool:
        """Whether micro-batches lay out shared prefixes once: needs an attention that takes a dense mask."""
        return self.cfg.share_prefix and attention_implementation(self.model) in ("sdpa", "eager")

    def _units(self, indices: list[int], batch) -> list[tuple[list[int], int]]:
        """`indices` grouped into the units a micro-batch lays out together (see `packing`), each with its
        forward tokens."""
        seqs = batch["input_ids"]
        if not self.shares_prefixes:
            return [([i], len(seqs[i])) for i in indices]
        units = shared_prefix_units([seqs[i] for i in indices], self.cfg.mb_max_tokens)
        return [(unit, unit_length([seqs[i] for i in unit])) for unit in ([indices[j] for j in u] for u in units)]

    def _rank_shares(self, indices: list[int], batch) -> list[list[tuple[list[int], int]]]:
        """Every rank's units of `indices`, balanced by forward tokens (the same split on every rank)."""
        units = self._units(indices, batch)
        return [[units[u] for u in share] for share in balance({u: c for u, (_, c) in enumerate(units)},
                                                                self.world_size)]

    def _micro_batches(self, indices: list[int], batch, token_keys) -> list[MicroBatch]:
        """This rank's share of `indices`, cut by the token budget into as many micro-batches as the rank
        that needs the most (every forward/backward is a collective under FSDP)."""
        units = self._rank_shares(indices, batch)[self.rank]
        cost = {u: c for u, (_, c) in enumerate(units)}
        need = torch.tensor([count_micro_batches(list(cost.values()), self.cfg.mb_max_tokens)], device=self.device)
        dist.all_reduce(need, op=dist.ReduceOp.MAX)
        micro_batches = []
        for group in balance(cost, max(1, int(need))):
            mine = [units[u][0] for u in group]
            micro_batches.append(pack(batch, sorted(i for unit in mine for i in unit), token_keys, self.device,
                                      self.cfg.pack_sequences, units=mine))
        return micro_batches

    def _forward(self, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token logprobs (with grad) and entropies (without) of a micro-batch, in packed [N] layout."""
        extra = {}
        if mb.grid_attention_mask is not None:
            mask = mb.grid_attention_mask
            if attention_implementation(self.model) == "eager":  # eager attention adds its mask to the scores
                mask = torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, torch.finfo(torch.float32).min)
            extra["attention_mask"] = mask
        grid = self.model(input_ids=mb.grid_input_ids, position_ids=mb.grid_position_ids, use_cache=False,
                          **extra).logits
        # the tokens of a shared trunk read the same slot: normalise each slot once, then gather per token
        slots, rows = torch.unique(mb.grid_index, return_inverse=True)
        logits = grid.flatten(0, 1)
        if slots.numel() != logits.shape[0]:  # some slots hold no token; else slots is every slot, in order
            logits = logits[slots]
        labels = torch.roll(mb.input_ids, -1)
        next_logp, next_entropy = logprobs_and_entropy(logits, labels, self.temperature, rows=rows)
        first = mb.position_ids == 0
        # logits at t predict token t + 1: shift by one so that position t holds token t's values
        logp = torch.where(first, 0.0, torch.roll(next_logp, 1))
        entropy = torch.where(first, 0.0, torch.roll(next_entropy, 1))
        return logp, entropy

    # ----- commands --------------------------------------------------------------------------------
    @torch.no_grad()
    def compute_logp(self, batch: dict[str, list]) -> list[list[float]]:
        """Per-token logprobs of every sequence under the current weights (returned on every rank)."""
        n = len(batch["input_ids"])
        mine: dict[int, list[float]] = {}
        self.model.eval()  # no dropout (an adapter's, trainer.lora.dropout): the policy as the servers run it
        try:
            for mb in self._micro_batches(list(range(n)), batch, ()):
                logp, _ = self._forward(mb)
                mine.update(zip(mb.indices, unpack(logp, mb)))
        finally:
            self.model.train(self.trainable)
        if self.world_size == 1:
            return [mine[i] for i in range(n)]
        # Every rank knows every rank's share, so the gathered values can be cut back into sequences.
        shares = [sorted(i for unit, _ in units for i in unit) for units in self._rank_shares(list(range(n)), batch)]
        parts = self._all_gather_ragged(torch.tensor([v for i in sorted(mine) for v in mine[i]],
                                                     dtype=torch.float32, device=self.device))
        out: list[list[float]] = [[] for _ in range(n)]
        for share, part in zip(shares, parts):
            offset = 0
            for i in share:
                length = len(batch["input_ids"][i])
                out[i] = part[offset: offset + length].tolist()
                offset += length
        return out

    def _all_gather_ragged(self, flat: torch.Tensor) -> list[torch.Tensor]:
        sizes = [torch.zeros(1, dtype=torch.long, device=self.device) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([flat.numel()], device=self.device))
        width = max(int(s) for s in sizes)
        padded = torch.zeros(width, dtype=flat.dtype, device=self.device)
        padded[: flat.numel()] = flat
        parts = [torch.zeros_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded)
        return [p[: int(s)].cpu() for p, s in zip(parts, sizes)]

    def train_batch(self, batch: dict[str, list], loss_fn: LossFn, loss_weight_fn: WeightFn,
                    token_keys: tuple[str, ...], n_minibatches: int = 1,
                    forward_logprob_columns: tuple[str, ...] = ()) -> dict[str, float]:
        """One optimizer step per minibatch; returns the token-weighted stats of the whole batch.
        `forward_logprob_columns` (one minibatch only): columns the loss reads that are the forward's own detached
        logprobs, i.e. those of the weights before the step (see loss_registry.Loss.policy_columns)."""
        if forward_logprob_columns and n_minibatches != 1:
            raise ValueError("forward_logprob_columns needs one minibatch: later ones start from updated weights")
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        started = time.perf_counter()
        n = len(batch["input_ids"])
        bounds = [round(m * n / n_minibatches) for m in range(n_minibatches + 1)]
        totals: dict[str, float] = {}
        for m in range(n_minibatches):
            stats = self._train_minibatch(batch, list(range(bounds[m], bounds[m + 1])), loss_fn, loss_weight_fn,
                                          token_keys, forward_logprob_columns)
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + (v if k == "forward_tokens" else v / n_minibatches)
        totals["n_minibatches"] = n_minibatches
        totals["seconds"] = time.perf_counter() - started
        totals["tokens"] = float(sum(len(s) for s in batch["input_ids"]))
        totals["tokens_per_s"] = totals["tokens"] / totals["seconds"]
        if self.device.type == "cuda":
            totals["peak_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return totals

    def _train_minibatch(self, batch, indices, loss_fn, loss_weight_fn, token_keys,
                         forward_logprob_columns: tuple[str, ...] = ()) -> dict[str, float]:
        mbs = self._micro_batches(indices, batch, token_keys)
        weights = [float(loss_weight_fn(mb)) if mb.indices else 0.0 for mb in mbs]
        total = torch.tensor([sum(weights)], dtype=torch.float64, device=self.device)
        dist.all_reduce(total)
        global_weight = max(float(total), 1e-8)
        sums: dict[str, float] = {}
        self.optimizer.zero_grad(set_to_none=True)
        for mb, weight in zip(mbs, weights):
            logp, entropy = self._forward(mb)
            for column in forward_logprob_columns:
                mb.tensors[column] = logp.detach()
            loss, stats = loss_fn(logp, entropy, mb)
            # FSDP averages gradients over ranks; scaling by world_size / global weight turns that average
            # into the weighted mean over every rank's tokens.
            (loss * (weight * self.world_size / global_weight)).backward()
            stats = {"loss": loss.detach(), **stats}
            if "entropy" not in stats and mb.indices:
                mask = mb.tensors.get("loss_mask")
                stats["entropy"] = (entropy * mask).sum() / mask.sum().clamp(min=1) if mask is not None else entropy.mean()
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + float(v) * weight
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable_parameters(), self.cfg.optimizer.gradient_clipping)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        lr = self.scheduler.get_last_lr()[0]
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        else:
            logger.warning("non-finite grad norm %s: optimizer step skipped", grad_norm)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        keys = sorted(sums)
        forward_tokens = sum(mb.forward_tokens for mb in mbs if mb.indices)
        reduced = torch.tensor([sums[k] for k in keys] + [forward_tokens], dtype=torch.float64, device=self.device)
        dist.all_reduce(reduced)
        *reduced_sums, forward_tokens = reduced.tolist()
        out = {k: float(v) / global_weight for k, v in zip(keys, reduced_sums)}
        out.update(grad_norm=float(grad_norm), lr=lr, loss_weight=global_weight, forward_tokens=forward_tokens)
        return out

    # ----- weights and checkpoints -----------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded fp32 weights (a collective; tensors on rank 0 only, on CPU). On one CPU rank they are
        views of the live parameters: write them out before the next step changes them."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from torch.distributed.tensor import DTensor

        if self.world_size == 1:
            # One rank holds every shard whole: its local tensors are the weights, without
            # get_model_state_dict's generic gather (on a small model, a large share of a weight broadcast).
            return {name: (t.to_local() if isinstance(t, DTensor) else t).detach().cpu()
                    for name, t in self.model.state_dict().items()}
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights of the policy as the base model names them (a collective, as `full_state_dict`): with LoRA
        the base with the adapters merged in, what the servers serve."""
        state = self.full_state_dict()
        return lora.merged_state(state, self.cfg.lora) if self.lora and self.rank == 0 else state

    def save_hf(self, out_dir: Path) -> None:
        """Write the policy as an ordinary Hugging Face directory (rank 0 writes; all ranks must call)."""
        state = self.policy_state_dict()
        if self.rank == 0:
            write_hf_dir(Path(out_dir), state, self.model.config, self.model_path)
        dist.barrier()

    def save_adapter(self, out_dir: Path) -> None:
        """Write the adapters as a PEFT adapter directory (trainer.lora; rank 0 writes; all ranks must call). Only
        the adapters are gathered: a push never moves the frozen base."""
        from torch.distributed.tensor import DTensor

        state = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu()
                 for name, p in self.model.named_parameters() if p.requires_grad}  # the same order on every rank
        if self.rank == 0:
            lora.write_adapter_dir(Path(out_dir), lora.peft_state(state), self.cfg.lora, self.model_path)
        dist.barrier()

    def save(self, path: Path, extra: Optional[dict[str, Any]] = None) -> None:
        """Everything needed to continue exactly: weights, optimizer, LR schedule, RNG states, version; and,
        last, checksums.json, which `load` (and whoever serves `model/`) verifies first."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
        from safetensors.torch import save_file

        path = Path(path)
        model_state = self.full_state_dict()
        optim_state = get_optimizer_state_dict(self.model, self.optimizer,
                                               options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        rngs = [json.loads(bytes(part.tolist()).decode()) for part in self._all_gather_ragged(
            torch.tensor(list(json.dumps(rng_state()).encode()), dtype=torch.uint8, device=self.device))]
        if self.rank == 0:
            with atomic_directory(path) as tmp:
                if self.lora:  # the adapters to resume from; model/ holds the policy, for what reads weights
                    lora.write_adapter_dir(tmp / lora.ADAPTER_SUBDIR, lora.peft_state(model_state), self.cfg.lora,
                                           self.model_path)
                    model_state = lora.merged_state(model_state, self.cfg.lora)
                write_hf_dir(tmp / MODEL_SUBDIR, model_state, self.model.config, self.model_path)
                tensors, groups = flatten_optimizer_state(optim_state)
                save_file(tensors, str(tmp / "optimizer.safetensors"))
                atomic_write_text(tmp / "trainer_state.json", json.dumps({
                    "version": self.version,
                    "world_size": self.world_size,
                    "optimizer_param_groups": groups,
                    "scheduler": self.scheduler.state_dict(),
                    "rng": rngs,
                    "lora": lora.settings(self.cfg.lora) if self.lora else None,
                    **(extra or {}),
                }, indent=1))
                write_checksums(tmp)
        dist.barrier()

    def load(self, path: Path) -> dict[str, Any]:
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        path = Path(path)
        # Every rank checks before any of them starts the collectives below, so all of them fail alike.
        verify_checksums(path)
        state = json.loads((path / "trainer_state.json").read_text())
        lora.check_checkpoint(state.get("lora"), self.cfg.lora)
        if self.lora:  # the adapters only: the frozen base is model.path's
            model_state = lora.module_state(lora.read_adapter_dir(path / lora.ADAPTER_SUBDIR),
                                            list(self.model.state_dict()))
            set_model_state_dict(self.model, model_state, options=StateDictOptions(full_state_dict=True,
                                                                                   strict=False))
        else:
            model_state = read_hf_weights(path / MODEL_SUBDIR, self.model)
            set_model_state_dict(self.model, model_state, options=StateDictOptions(full_state_dict=True))
        options = StateDictOptions(full_state_dict=True)
        optim_state = unflatten_optimizer_state(load_file(str(path / "optimizer.safetensors")),
                                                 state["optimizer_param_groups"])
        set_optimizer_state_dict(self.model, self.optimizer, optim_state, options=options)
        self.scheduler.load_state_dict(state["scheduler"])
        self._apply_config_hyperparameters()
        rngs = state["rng"]
        set_rng_state(rngs[self.rank] if self.rank < len(rngs) else rngs[0])
        self.version = int(state["version"])
        return state

    def _apply_config_hyperparameters(self) -> None:
        """After a load: the optimizer's and the schedule's hyperparameters are this config's, their state (moments,
        step counts, the schedule's position) the checkpoint's. A run resumed under its own config is unchanged,
        bit for bit (the same values, the learning rate computed as the scheduler does); a branch of a run
        (areal-pipeline branch) continues the parent's optimizer with its own learning rate, betas, weight decay
        and schedule."""
        o = self.cfg.optimizer
        for group in self.optimizer.param_groups:
            group.update(initial_lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
        # the schedule at the checkpoint's position, made afresh: its base learning rates are the groups'
        # initial_lr, and making it steps once, to `last_epoch`, setting each group's lr (and get_last_lr()) to
        # base * schedule(last_epoch)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.scheduler.lr_lambdas,
                                                           last_epoch=self.scheduler.last_epoch - 1)
