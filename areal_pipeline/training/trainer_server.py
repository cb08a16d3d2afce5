"""The trainer process: started once per run under torchrun, model and optimizer resident across iterations.

    torchrun --standalone --nproc-per-node N -m areal_pipeline.training.trainer_server \
        --config runs/<run>/config.yaml --model PATH --port P

Rank 0 serves a small HTTP endpoint on 127.0.0.1 (`POST /command`, `GET /health`) and broadcasts each command
to the other ranks over a gloo control group (as JSON bytes); every command is then run by all ranks as a
collective, and rank 0 answers. Commands:

    {"cmd": "initialize"} / {"cmd": "reinitialize"}         -> {"version"}
    {"cmd": "compute_logp", "shard_dir", "out_path", "model": "actor" | "ref"}
    {"cmd": "train", "batch_dir", "iteration",              -> stats; needs version == iteration - 1
     "policy_logprobs"}                                     (optional: compute_logp's file of the batch at
                                                             version iteration - 1, for the loss's policy columns)
    {"cmd": "probe_logp", "input_ids"}                      -> {"logprobs" of input_ids[1:] at temperature 1}
    {"cmd": "save", "path", "extra"} / {"cmd": "load", "path"}
    {"cmd": "save_weights", "path"}                         -> an HF directory for /update_weights_from_disk
    {"cmd": "save_adapter", "path"}                         -> a PEFT adapter directory (trainer.lora)
    {"cmd": "update_weights_distributed", "servers", "master_address", "master_port", "dtype", "tp_sizes",
     "epoch", "bucket_bytes"}
    {"cmd": "status"} / {"cmd": "shutdown"}

A body that is no command, or arguments that do not fit the handler's signature (command_input.py), are refused
with a 4xx naming what is wrong, before any rank starts: the pipeline retries a 5xx, never a 4xx.
Every file a command reads is checked against its manifest first (a checkpoint's checksums.json, the shards'
manifest.json): one that fails is refused with code "corrupt_file" (409; details: the file and what failed),
before the trainer's state changes. A path argument that resolves (symlinks followed) outside the run's output_dir
and trainer.weights_dir is refused with code "forbidden_path" (403) before anything is read or written.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa
import torch
import torch.distributed as dist

from areal_pipeline.auth import CredentialError, server_ssl_context, service_token
from areal_pipeline.checksums import IntegrityError
from areal_pipeline.confined_paths import OutsideRoots, confine, resolve_roots, run_roots
from areal_pipeline.config import UNCHECKED_AGENT, ExperimentConfig, load
from areal_pipeline.data.shards import read_table
from areal_pipeline.placement import gpu_uuid
from areal_pipeline.training.client import TRAINER_INIT_METHOD_ENV
from areal_pipeline.training.command_input import check_arguments
from areal_pipeline.training.engine import TrainEngine, resolve_device
from areal_pipeline.training.lora import LoRAMismatchError
from areal_pipeline.training.loss_registry import make_loss
from areal_pipeline.training.nodes import trainer_threads, training_settings, write_announcement
from areal_pipeline.training.batches import read_batch, read_logprobs
from areal_pipeline.training.profiling import profile_path, profiled
from areal_pipeline.training.rank_control import Endpoint, broadcast_json, give_up, wait_on_time
from areal_pipeline.utils import (PeerTimeout, atomic_directory, atomic_path, exit_when_parent_dies,
                                  find_free_port, get_logger, import_in_background)

logger = get_logger("areal_pipeline.trainer")

# Between commands the other ranks wait in a broadcast; rollouts can take long, so the control group must
# not time out while idle.
IDLE_TIMEOUT = timedelta(days=7)


class CommandError(Exception):
    def __init__(self, message: str, code: str = "error", status: int = 500, **details):
        super().__init__(message)
        self.code, self.status, self.details = code, status, details


# Each command's path arguments, and whether it writes there (then never a whole root): every one must resolve inside
# the run's output_dir or trainer.weights_dir (confined_paths.py), else the command is refused before it runs.
PATH_ARGUMENTS = {"compute_logp": {"shard_dir": False, "out_path": True},
                  "train": {"batch_dir": False, "policy_logprobs": False},
                  "save": {"path": True}, "load": {"path": False}, "save_weights": {"path": True},
                  "save_adapter": {"path": True}}


class Trainer:
    def __init__(self, cfg: ExperimentConfig, model_path: str):
        self.cfg = cfg
        self.model_path = model_path
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.actor: Optional[TrainEngine] = None
        self.ref: Optional[TrainEngine] = None
        self.loss = make_loss(cfg.ppo)
        self.weight_groups: dict[str, Any] = {}
        self.settings = training_settings(cfg)  # a run driving this trainer checks it trains with these

    def _engine(self, trainable: bool) -> TrainEngine:
        # the schedule's span, fixed when the run was configured (never the iterations this command adds)
        span = self.cfg.trainer.optimizer.schedule_iterations or self.cfg.total_iterations
        steps = span * self.cfg.ppo.ppo_n_minibatches
        engine = TrainEngine(self.model_path, self.cfg.trainer, total_steps=steps,
                             temperature=self.cfg.rollout.gconfig.temperature,
                             trust_remote_code=self.cfg.model.trust_remote_code, trainable=trainable,
                             seed=self.cfg.seed)
        engine.initialize()
        return engine

    def require_actor(self) -> TrainEngine:
        if self.actor is None:
            raise CommandError("the trainer is not initialised: send {'cmd': 'initialize'} first", "not_initialized", 409)
        return self.actor

    # Each handler runs on every rank with the same arguments; rank 0's return value is the reply.
    def initialize(self) -> dict:
        if self.actor is None:
            self.actor = self._engine(trainable=True)
            gc.freeze()  # the model and the modules stay: full collections need not walk them again
            # what the first batch's read imports (pyarrow.parquet.read_table), while the first rollout runs
            import_in_background("pyarrow.dataset")
        return {"version": self.actor.version}

    def reinitialize(self) -> dict:
        """Back to the initial weights and a fresh optimizer (version 0), e.g. to replay from the start."""
        self.actor = None
        return self.initialize()

    def compute_logp(self, shard_dir: str, out_path: str, model: str = "actor") -> dict:
        if model not in ("actor", "ref"):
            raise CommandError(f"unknown model '{model}'; valid: actor, ref", status=400)
        batch = {"input_ids": read_table(Path(shard_dir), schema=None).column("input_ids").to_pylist()}
        if model == "ref" and self.cfg.trainer.lora.enabled:
            # the reference policy is the frozen base: the actor with its adapters off, not a second copy
            if self.actor is None:
                self.initialize()
            with self.actor.model.disable_adapter():
                values = self.actor.compute_logp(batch)
        else:
            if model == "ref" and self.ref is None:
                self.ref = self._engine(trainable=False)
            values = (self.ref if model == "ref" else self.require_actor()).compute_logp(batch)
        if self.rank == 0:
            import pyarrow.parquet as pq

            table = pa.table({"logprobs": pa.array(values, type=pa.list_(pa.float32()))})
            with atomic_path(Path(out_path)) as tmp:
                pq.write_table(table, tmp)
        # the trainer's version is the actor's, whichever model computed these logprobs
        return {"path": out_path, "rows": len(values), "version": self.actor.version if self.actor else None}

    def probe_logp(self, input_ids: list[int]) -> dict:
        """The actor's logprob of each of `input_ids[1:]` at temperature 1: what a server holding the same weights
        gives for them (the pipeline checks every weight update with it)."""
        if not (isinstance(input_ids, list) and len(input_ids) >= 2
                and all(type(t) is int and t >= 0 for t in input_ids)):
            raise CommandError("'input_ids' must be a list of at least 2 token ids >= 0", status=400)
        actor = self.require_actor()
        temperature, actor.temperature = actor.temperature, 1.0
        try:
            values = actor.compute_logp({"input_ids": [input_ids]})[0]
        finally:
            actor.temperature = temperature
        return {"logprobs": [float(v) for v in values[1:]], "version": actor.version}

    def train(self, batch_dir: str, iteration: int, policy_logprobs: Optional[str] = None) -> dict:
        out = profile_path(iteration, self.rank)
        if out is not None:
            return profiled(out, self.require_actor().device, lambda: self._train(batch_dir, iteration, policy_logprobs))
        return self._train(batch_dir, iteration, policy_logprobs)

    def _train(self, batch_dir: str, iteration: int, policy_logprobs: Optional[str] = None) -> dict:
        actor = self.require_actor()
        if actor.version != iteration - 1:
            raise CommandError(
                f"the trainer is at version {actor.version}; the update of iteration {iteration} needs "
                f"version {iteration - 1} (load the right checkpoint first)",
                "version_mismatch", 409, version=actor.version)
        loss, n_minibatches = self.loss, self.cfg.ppo.ppo_n_minibatches
        from_data = tuple(c for c in loss.columns if c not in loss.policy_columns)
        batch = read_batch(Path(batch_dir), ("input_ids",) + from_data)
        if n_minibatches == 1:  # the forward of the one step is the pre-update policy's: no extra pass
            stats = actor.train_batch(batch, loss.fn, loss.weight, from_data, n_minibatches,
                                      forward_logprob_columns=loss.policy_columns)
        else:
            if loss.policy_columns:
                logprobs = (read_logprobs(policy_logprobs, batch["input_ids"]) if policy_logprobs
                            else actor.compute_logp(batch))
                batch.update({column: logprobs for column in loss.policy_columns})
            stats = actor.train_batch(batch, loss.fn, loss.weight, loss.columns, n_minibatches)
        actor.version = iteration
        return {"version": actor.version, "stats": stats}

    def save(self, path: str, extra: Optional[dict] = None) -> dict:
        actor = self.require_actor()
        actor.save(Path(path), extra)
        return {"path": path, "version": actor.version}

    def load(self, path: str) -> dict:
        actor = self.require_actor()
        if not Path(path).is_dir():
            raise CommandError(f"no checkpoint at {path}", "no_checkpoint", 404)
        try:
            actor.load(Path(path))  # verifies the checkpoint's checksums first
        except LoRAMismatchError as e:
            raise CommandError(f"{path}: {e}", "lora_mismatch", 409) from e
        return {"path": path, "version": actor.version}

    def save_weights(self, path: str) -> dict:
        return self._write_dir(path, self.require_actor().save_hf)

    def save_adapter(self, path: str) -> dict:
        """The adapters alone, for a server's runtime LoRA loading (trainer.lora.push)."""
        if not self.cfg.trainer.lora.enabled:
            raise CommandError("save_adapter needs trainer.lora.enabled: this trainer trains the full model",
                               "not_lora", 400)
        return self._write_dir(path, self.require_actor().save_adapter)

    def _write_dir(self, path: str, write) -> dict:
        """`write(directory)` on every rank (a collective; rank 0 writes), into a directory that appears whole."""
        if self.rank == 0:
            with atomic_directory(Path(path)) as tmp:
                write(tmp)
        else:
            write(Path(path))
        return {"path": path, "version": self.actor.version}

    def update_weights_distributed(self, servers: list[str], master_address: str, master_port: int,
                                   dtype: str = "float32", group_name: str = "weight_update_group",
                                   server_devices: Optional[list[str]] = None,
                                   server_gpus: Optional[list[Optional[str]]] = None,
                                   tp_sizes: Optional[list[int]] = None, epoch: int = 0,
                                   bucket_bytes: Optional[int] = None) -> dict:
        """`server_devices`: where each server holds its model (its /get_server_info "device"; None: where this
        trainer is); `server_gpus`: their GPUs' UUIDs where they say (the project's server does, SGLang does not).
        NCCL needs both ends on GPUs, and on different ones (it refuses two members on one GPU: colocated use);
        otherwise the group is gloo, the trainer sending host copies. `tp_sizes`: each server's tensor-parallel
        ranks (1 each by default); `epoch`: changes whenever a server may have restarted, so that the group is
        joined afresh; `bucket_bytes`: the most bytes announced by one update call (weight_sync.py)."""
        from areal_pipeline.training.weight_sync import (DEFAULT_BUCKET_BYTES, broadcast_weights, weight_group_backend,
                                                         wire_dtype)

        actor = self.require_actor()
        # refused here, on every rank, rather than on rank 0 alone once the broadcast has begun (a 500 there)
        if not servers or not 0 <= master_port <= 65535:
            raise CommandError(f"update_weights_distributed needs servers and a master_port in [0, 65535] (0: a free "
                               f"one on the master's address); got {len(servers)} server(s) and port {master_port}",
                               status=400)
        if tp_sizes is not None and (len(tp_sizes) != len(servers) or min(tp_sizes) < 1):
            raise CommandError(f"'tp_sizes' must hold one size >= 1 per server, got {tp_sizes} for {len(servers)} "
                               "server(s)", status=400)
        if bucket_bytes is not None and bucket_bytes < 0:
            raise CommandError(f"'bucket_bytes' must be >= 0 (0: the default), got {bucket_bytes}", status=400)
        try:
            config = actor.model.config
            dtype = wire_dtype(dtype, getattr(config, "dtype", None) or getattr(config, "torch_dtype", None))
        except ValueError as e:
            raise CommandError(str(e), status=400) from e
        backend = weight_group_backend(gpu_uuid(actor.device), server_devices, server_gpus, self.cfg.trainer.colocate)
        state = actor.policy_state_dict()  # a collective: every rank takes part in gathering
        version = actor.version
        seconds, failure = 0.0, None
        if self.rank == 0:
            try:
                # the port is free where the group is hosted, on this node (the run may be on another host)
                master_port = master_port or find_free_port(master_address)
                seconds = broadcast_weights(self.weight_groups, state, servers, version, master_address, master_port,
                                            group_name, dtype, backend,
                                            bool(getattr(actor.model.config, "tie_word_embeddings", False)),
                                            tp_sizes=tp_sizes, epoch=epoch,
                                            bucket_bytes=bucket_bytes or DEFAULT_BUCKET_BYTES,
                                            timeout=self.cfg.trainer.collective_timeout)
            except Exception as e:  # raised after the barrier: the other ranks wait in it
                failure = e
        dist.barrier()
        if failure is not None:
            raise failure
        return {"version": version, "seconds": seconds}

    def status(self) -> dict:
        return {"version": self.actor.version if self.actor else None, "world_size": self.world_size,
                "initialized": self.actor is not None, "settings": self.settings}

    def handlers(self) -> dict[str, Any]:
        return {"initialize": self.initialize, "reinitialize": self.reinitialize, "compute_logp": self.compute_logp,
                "train": self.train, "probe_logp": self.probe_logp,
                "save": self.save, "load": self.load, "save_weights": self.save_weights,
                "save_adapter": self.save_adapter,
                "update_weights_distributed": self.update_weights_distributed, "status": self.status}

    def check_paths(self, name: str, args: dict) -> None:
        """Refuse (403) a command naming a path outside the run's roots. Every rank decides alike: each resolves the
        same paths, and a multi-node trainer needs them to mean the same files on every node anyway (each rank reads
        the shards itself)."""
        roots = resolve_roots(run_roots(self.cfg.output_dir, self.cfg.trainer.weights_dir))
        for key, writes in PATH_ARGUMENTS.get(name, {}).items():
            if args.get(key) is None:
                continue
            try:
                confine(args[key], roots, f"{name}'s '{key}'", allow_root=not writes)
            except OutsideRoots as e:
                raise CommandError(str(e), "forbidden_path", 403, argument=key, path=e.path, resolved=e.resolved,
                                   roots=e.roots) from e

    def run(self, command: dict) -> Any:
        handlers = self.handlers()
        name = command.get("cmd")
        if type(name) is not str or name not in handlers:
            raise CommandError(f"unknown command '{name}'; valid: {', '.join(sorted(handlers))}, shutdown",
                               status=400)
        args = {k: v for k, v in command.items() if k != "cmd"}
        try:
            check_arguments(name, handlers[name], args)
        except ValueError as e:  # on every rank alike: the command is refused everywhere before it starts
            raise CommandError(f"bad arguments for '{name}': {e}", "bad_arguments", 400) from e
        self.check_paths(name, args)  # before the handler: nothing is read or written at a refused path
        try:
            return handlers[name](**args)
        except IntegrityError as e:
            raise CommandError(str(e), "corrupt_file", 409, file=str(e.path), problem=e.problem) from e


def join_process_group(backend: str, init_method: str | None, collective: timedelta, startup: timedelta) -> None:
    """The default process group, whose collectives error out past `collective`. The ranks first meet on the
    rendezvous store, waiting up to `startup` for each other: gloo's connection of the ranks waits only the group's
    timeout, so ranks whose start-ups drifted further apart than a short collective timeout (a loaded machine, a slow
    node) would fail there instead."""
    store, rank, world_size = next(dist.rendezvous(init_method or "env://", timeout=startup))
    store.set_timeout(startup)
    # a store of this start's own: torchrun's agent makes a new one each round, a single rank's file is new a launch
    if store.add("areal/ranks-started", 1) == world_size:
        store.set("areal/all-started", "1")
    store.wait(["areal/all-started"], startup)
    store.set_timeout(collective)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, timeout=collective)


def serve(cfg: ExperimentConfig, model_path: str, host: str, port: int, announce: Optional[str] = None,
          credentials: Optional[tuple] = None) -> None:
    """`credentials`: (token, TLS context) of rank 0's endpoint (auth.py; None: neither)."""
    device = resolve_device(cfg.trainer.device, cfg.trainer.backend)
    backend = cfg.trainer.backend if cfg.trainer.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if cfg.trainer.memory_fraction < 1:  # a GPU shared with the inference servers (trainer.colocate)
            torch.cuda.set_per_process_memory_fraction(cfg.trainer.memory_fraction, device)
    threads = trainer_threads(cfg, device)
    if threads > 0:
        torch.set_num_threads(threads)
    collective = timedelta(seconds=cfg.trainer.collective_timeout)
    if backend == "nccl":
        # without it an NCCL collective whose peer is gone (or stopped) blocks forever, whatever the timeout; the
        # watchdog then ends the process instead, and the command fails naming the trainer
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"
        os.environ["TORCH_NCCL_BLOCKING_WAIT"] = "0"
    # every collective of the default group (barriers, FSDP's gathers) errors out past trainer.collective_timeout
    join_process_group(backend, os.environ.get(TRAINER_INIT_METHOD_ENV), collective,
                       timedelta(seconds=cfg.trainer.setup_timeout))
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    token, ssl_context = credentials if credentials is not None else (None, None)
    torch.manual_seed(cfg.seed)
    trainer = Trainer(cfg, model_path)
    endpoint = None
    if dist.get_rank() == 0:
        endpoint = Endpoint(host, port, trainer, token, ssl_context)
        endpoint.start()
        port = endpoint.server.server_address[1]
        logger.info("trainer (world size %d, %s, %s) listening on %s://%s:%d%s", dist.get_world_size(),
                    backend, device, "https" if ssl_context else "http", host, port,
                    "" if token else ", taking commands without a credential")
        if announce:  # a trainer on nodes of its own: the run finds rank 0 here (trainer.address=auto)
            write_announcement(Path(announce), f"{host}:{port}", cfg.run_id, dist.get_world_size())
    while True:
        slot = done = None
        if endpoint is not None:
            command, slot, done = endpoint.inbox.get()
            endpoint.busy_with = command.get("cmd")
        else:
            command = None
        try:
            command = broadcast_json(command, control, collective if endpoint is not None else None)
        except PeerTimeout as e:
            give_up(endpoint, slot, done, e)
            raise
        if command.get("cmd") == "shutdown":
            if slot is not None:
                slot.update(status=200, body={"status": "shutting down"})
                done.set()
            break
        started = time.perf_counter()
        status, body = 200, None
        try:
            body = trainer.run(command)
        except CommandError as e:
            status, body = e.status, {"error": {"message": str(e), "code": e.code, **e.details}}
        except Exception as e:
            logger.error("command %s failed on rank %d:\n%s", command.get("cmd"), dist.get_rank(),
                         traceback.format_exc())
            status, body = 500, {"error": {"message": f"{type(e).__name__}: {e}", "code": "internal"}}
        # A command that failed on another rank must not look like a success on rank 0.
        failed = torch.tensor([status != 200], dtype=torch.int32)
        try:
            # every rank has run the command by now, or is about to: the collective limit, not the idle one
            wait_on_time(dist.all_reduce(failed, group=control, async_op=True), collective,
                         f"end of command '{command.get('cmd')}'")
        except PeerTimeout as e:
            if endpoint is not None:
                give_up(endpoint, slot, done, e)
            raise
        if slot is not None:
            if status == 200 and int(failed):
                status, body = 500, {"error": {"message": f"{command.get('cmd')} failed on another rank; "
                                                          "see the trainer log", "code": "internal"}}
            if status == 200:
                body = {**(body or {}), "seconds": time.perf_counter() - started}
            slot.update(status=status, body=body)
            endpoint.busy_with = None
            done.set()
    if endpoint is not None:
        endpoint.stop()
    dist.destroy_process_group()


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description="areal-pipeline trainer process (run under torchrun)")
    p.add_argument("--config", required=True, help="the run's resolved config.yaml")
    p.add_argument("--model", required=True, help="initial weights: HF directory or hub id")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True, help="0: a free one (see --announce)")
    p.add_argument("--announce", default=None, help="rank 0 writes its endpoint's address to this JSON file")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s")
    try:  # before any rank joins a group: a trainer that would take anyone's commands never starts
        credentials = (service_token("the trainer's control endpoint"), server_ssl_context()) if rank == 0 else None
    except CredentialError as e:
        raise SystemExit(str(e)) from None
    exit_when_parent_dies()
    # the run's saved config, its workflow's section kept as written: the trainer never reads it, and parsing it
    # would import the workflow's (the user's agent's) module in every rank
    serve(load(args.config, chosen=UNCHECKED_AGENT), args.model, args.host, args.port, args.announce, credentials)


if __name__ == "__main__":
    main()
