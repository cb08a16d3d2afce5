"""Policy versions of a run's processes, restored on demand instead of assumed.

- the trainer must be at version k-1 for `ppo_update(k)`: a trainer found at another version (it crashed and
  was restarted, or the run was resumed) loads the newest checkpoint at or below k-1 and replays the updates
  after it from their batch shards (bitwise exact on CPU);
- the inference servers must serve version k-1 for `rollout(k)` and version k after `broadcast_weights(k)`:
  a server at another version (restarted, or resumed run) gets the right weights pushed first.

`PolicyVersions` is the part of `Pipeline` that does this (a mixin: it reads the pipeline's config, paths,
services and trainer lock).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any, Optional

from areal_pipeline.config import adapter_push
from areal_pipeline.config.addresses import split_address, weight_group_master
from areal_pipeline.data.shards import ShardError, has_manifest
from areal_pipeline.training.client import TrainerClient, TrainerError
from areal_pipeline.utils import get_logger, run_async

logger = get_logger(__name__)


def distributed_tp_sizes(addresses: list[str], infos: list[dict]) -> list[int]:
    """Each server's tensor-parallel ranks (its /server_info `tp_size`; the project's server says none: 1), the
    ranks it joins a weight-update group with. A server with data parallelism inside cannot join one (SGLang asserts
    dp_size == 1): refused here, naming it, rather than a 500 in the middle of an update."""
    sizes = []
    for address, info in zip(addresses, infos):
        if int(info.get("dp_size") or 1) > 1:
            raise ValueError(f"inference server {address} runs with dp_size={info['dp_size']}: SGLang takes weights "
                             "over a process group only with dp_size 1; use trainer.weight_sync=disk, or servers "
                             "without --dp-size")
        sizes.append(int(info.get("tp_size") or 1))
    return sizes


class PolicyVersions:
    def ensure_trainer_version(self, version: int) -> TrainerClient:
        """Bring the trainer to `version`: start from the newest state at or below it (where the trainer is, an
        intact checkpoint, or the initial weights), then replay the updates after it from their batch shards."""
        with self._trainer_lock:
            client = self.services.ensure_trainer_alive()
            current = client.current_version()
            if current == version:
                return client
            start = self._restore_start(client, current, version)
            if start < version:
                logger.info("trainer at version %s: replaying updates %d..%d from their batch shards",
                            start, start + 1, version)
            for k in range(start + 1, version + 1):
                self._update_from_batch(client, k)
            return client

    def _restore_start(self, client: TrainerClient, current: Optional[int], version: int) -> int:
        """Put the trainer at the newest version at or below `version` that it can replay from, and return it:
        where it already is, else the newest checkpoint, else the initial weights. A checkpoint that fails its
        checksums (the trainer checks them before it loads anything) is passed over, with a warning, for the next
        older start, provided the updates after that one can be replayed."""
        here = {current} if current is not None and 0 <= current <= version else set()
        starts = sorted({0, *here, *(c for c in self.paths.saved_checkpoints() if c <= version)}, reverse=True)
        for start, older in zip(starts, starts[1:]):
            if start in here:
                return start
            try:
                client.call("load", path=str(self.paths.checkpoint(start)))
                return start
            except TrainerError as error:
                if error.code != "corrupt_file":
                    raise
                missing = next((k for k in range(older + 1, version + 1) if not self._replayable(k)), None)
                if missing is not None:
                    raise RuntimeError(f"cannot restore the trainer to version {version}: {error}; and no older "
                                       f"start helps: iteration {missing} has neither batch nor rollout shards to "
                                       "replay") from error
                logger.warning("passing over a corrupt checkpoint (%s): restoring version %d from version %d",
                               error, version, older)
        if 0 not in here:
            client.call("reinitialize")
        return 0

    def _replayable(self, k: int) -> bool:
        """Whether update k can be replayed: its batch shards, or the rollout shards they come from, were written."""
        return has_manifest(self.paths.batch(k)) or has_manifest(self.paths.rollout(k))

    def _update_from_batch(self, client: TrainerClient, k: int, proximal: Optional[str] = None) -> dict:
        """The trainer's update k on iteration k's batch shards (its reply), with `proximal` the proximal_logprobs
        step's file where it ran (otherwise the trainer computes them itself: the same numbers). A batch that is
        missing, or that the trainer refuses as corrupt (it checks every shard before training on any), is first
        computed again from the rollout shards: an update never runs on a corrupt batch (nor on a corrupt
        logprobs file: the trainer then computes them)."""
        batch = self.paths.batch(k)
        if has_manifest(batch):
            try:
                return client.call("train", batch_dir=str(batch), iteration=k,
                                   **({"policy_logprobs": proximal} if proximal else {}))
            except TrainerError as error:
                if error.code != "corrupt_file":
                    raise
                if proximal is not None and error.details.get("file") == proximal:
                    logger.warning("not updating on corrupt proximal logprobs (%s): the trainer computes them", error)
                    return client.call("train", batch_dir=str(batch), iteration=k)
                logger.warning("not updating on a corrupt batch (%s): computing iteration %d's batch again from "
                               "its rollout shards", error, k)
        try:
            self._write_batch(k)
        except ShardError as error:
            raise ShardError(f"update {k} cannot run: iteration {k}'s batch shards at {batch} are missing or "
                             f"corrupt, and cannot be computed again from its rollout shards: {error}") from error
        return client.call("train", batch_dir=str(batch), iteration=k)

    def server_versions(self) -> list[Optional[int]]:
        """The policy version each server serves (None: not one of ours, e.g. SGLang's initial "default"),
        as last read or pushed while every step succeeded."""
        epoch, served = self.services.known_served()
        if served is None:
            async def versions():
                async with self._engine() as engine:
                    return [str((await engine.get_model_info(a))["weight_version"]) for a in engine.addresses]
            served = [int(v) if v.lstrip("-").isdigit() else None for v in run_async(versions())]
            if self.served_adapter is not None and self.cfg.inference.backend != "vllm":
                # a label names a version's adapter only where this process loaded it (adapters.py): another
                # process's label, or a restarted server's, is pushed again
                served = [v if v is not None and self.served_adapter.serves(v) else None for v in served]
            self.services.record_served(epoch, served)
        return served

    def sync_servers(self, version: int, or_newer: bool = False) -> dict[str, Any]:
        """Make every inference server serve `version` (pause -> update -> continue); a no-op when it does.
        `or_newer`: servers past `version` are fine too, and stale ones get the trainer's newest version
        (asynchronous mode, where iteration k+1's rollout runs while the trainer moves to version k)."""
        self.services.ensure_inference_alive()
        served = self.server_versions()
        if all(v is not None and (v == version or (or_newer and v > version)) for v in served):
            self._notify_version(min(served))
            return {"version": min(served), "pushed": False, "seconds": 0.0}
        started = time.perf_counter()
        with self._trainer_lock:
            epoch = self.services.forget_served()  # unknown until the push succeeded
            version = self._push_weights(version, or_newer)
            self.services.record_served(epoch, [version] * len(self.services.addresses))
        self._notify_version(version)
        self._prune_weights(keep=version)
        return {"version": version, "pushed": True, "seconds": time.perf_counter() - started}

    def recover_servers(self, version: int, or_newer: bool = False) -> dict[str, Any]:
        """After episodes failed at an inference server: ask every service again (a server that died is restarted,
        at version 0) and bring the servers back to `version` (`or_newer` as in `sync_servers`)."""
        with self._trainer_lock:
            self.services.distrust()
            return self.sync_servers(version, or_newer)

    def _push_weights(self, version: int, or_newer: bool) -> int:
        """Push `version` (`or_newer`: the trainer's newest, if newer) to every server; returns what was pushed."""
        if or_newer:
            current = self.services.ensure_trainer_alive().current_version()
            version = max(version, 0 if current is None else current)
        client = self.ensure_trainer_version(version)
        t = self.cfg.trainer
        if t.weight_sync == "distributed":
            async def push():
                async with self._engine() as engine:
                    # what each server holds its model on and in (SGLang's and this project's servers say): the
                    # group's backend and the wire dtype follow them
                    infos = [await engine.get_server_info(a) for a in engine.addresses]
                    tp_sizes = distributed_tp_sizes(engine.addresses, infos)
                    await engine.pause()
                    try:
                        client.call("update_weights_distributed", servers=engine.addresses,
                                    master_address=(weight_group_master(t.weight_sync_master_address, t.address)
                                                        or split_address(client.address)[0]),
                                    master_port=t.weight_sync_master_port,
                                    dtype=self._wire_dtype(infos[0]),
                                    server_devices=[str(i.get("device") or "cuda") for i in infos],
                                    server_gpus=[i.get("gpu_uuid") for i in infos], tp_sizes=tp_sizes,
                                    epoch=self.services.inference_epoch,
                                    bucket_bytes=t.weight_sync_bucket_mb << 20)
                        engine.set_version(version)
                    finally:
                        await engine.resume()
        else:
            path = self._weights_path(version)
            if adapter_push(self.cfg):  # the adapter alone: a PEFT directory the servers load as the policy
                if not (path / "adapter_config.json").is_file():
                    client.call("save_adapter", path=str(path))
            elif not (path / "config.json").is_file():
                client.call("save_weights", path=str(path))

            async def push():
                async with self._engine() as engine:
                    await engine.update_weights(str(path), version)
        run_async(push())
        if self.cfg.inference.verify_weights:
            self.verify_served_weights(client, version)
        return version

    def verify_served_weights(self, client: TrainerClient, version: int) -> dict[str, float]:
        """Check that every server computes with the trainer's weights (a short probe's logprobs, see
        inference/weight_check.py): WeightMismatchError naming the backend and the server if one does not.
        Returns each server's mean logprob difference."""
        from areal_pipeline.inference.weight_check import probe_ids, tolerance, verify_served

        probe = probe_ids(self.tokenizer)
        expected = client.call("probe_logp", input_ids=probe)["logprobs"]
        tol = tolerance(self.cfg.inference, trainer_fp32=self._trainer_fp32())

        async def check():
            async with self._engine() as engine:
                return await verify_served(engine, probe, expected, version, tol, backend=self.cfg.inference.backend)
        report = run_async(check())
        logger.info("servers verified at version %d: largest mean probe logprob difference %.3g (tolerance %.3g)",
                    version, max(report.values()), tol)
        return report

    def _trainer_fp32(self) -> bool:
        t, on_gpu = self.cfg.trainer, bool(self.services.placement.trainer)
        fp32 = t.param_dtype == "float32" or (t.param_dtype == "auto" and not on_gpu)
        if t.lora.enabled:  # the policy is a frozen base of trainer.lora.base_dtype plus the adapters
            fp32 = fp32 and (t.lora.base_dtype == "float32" or (t.lora.base_dtype == "auto" and not on_gpu))
        return fp32

    def _notify_version(self, version: int) -> None:
        if self._async_rollout is not None:
            self._async_rollout.set_version(version)

    def _wire_dtype(self, server_info: dict) -> str:
        inf = self.cfg.inference
        if server_info.get("dtype") in ("float32", "bfloat16", "float16"):  # SGLang's may say "auto"
            return server_info["dtype"]
        return inf.sglang.dtype if inf.backend == "sglang" or inf.addresses else inf.dtype

    def _weights_root(self) -> Path:
        """Where weight_sync=disk writes the versions: trainer.weights_dir/<run_id> (a path the servers read, given
        whole: a server elsewhere resolves no relative path against this one's directory), or <run_dir>/weights."""
        configured = self.cfg.trainer.weights_dir
        if configured:
            return Path(os.path.abspath(os.path.expanduser(configured))) / self.cfg.run_id
        return Path(os.path.abspath(self.paths.run_dir / "weights"))

    def _weights_path(self, version: int) -> Path:
        return self._weights_root() / f"v{version}"

    def _prune_weights(self, keep: int) -> None:
        root = self._weights_root()
        for path in root.glob("v*") if root.is_dir() else []:
            if path.name != f"v{keep}":
                shutil.rmtree(path, ignore_errors=True)
