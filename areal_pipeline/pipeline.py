"""One RL iteration as steps that any orchestrator can call: the Prefect tasks wrap them one to one, and a
plain loop (`run_plain`) calls the same functions.

Every step is idempotent and backed by its output on disk: it first looks for its complete output (a
manifest or record written last, atomically) and returns that instead of redoing the work. State that lives
in processes is restored on demand instead of being assumed:

- the trainer must be at version k-1 for `ppo_update(k)`: a trainer found at another version (it crashed and
  was restarted, or the run was resumed) loads the newest checkpoint at or below k-1 and replays the updates
  after it from their batch shards (bitwise exact on CPU);
- the inference servers must serve version k-1 for `rollout(k)` and version k after `broadcast_weights(k)`:
  a server at another version (restarted, or resumed run) gets the right weights pushed first.

Within one process, what the services last reported (healthy, at version v) is believed until a step fails or
a process exits: then every service is asked again (see `Services`).

Rollouts are seeded per episode (seed, iteration, prompt), so a rerun of a half-finished rollout samples the
same tokens; with `ppo.recompute_logprob` the trainer's "old" logprobs are recomputed from those tokens, so a
rerun after a crash reaches the same final weights bit for bit.
"""

from __future__ import annotations

import fcntl
import gc
import hashlib
import json
import os
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from areal_pipeline import shutdown
from areal_pipeline.checksums import IntegrityError, has_checksums, verify_checksums
from areal_pipeline.config import ExperimentConfig, save_config, to_dict
from areal_pipeline.data.datasets import load_records
from areal_pipeline.data.shards import ShardError, has_manifest, keep_if_intact, read_manifest
from areal_pipeline.inference.client import RemoteSGLangEngine
from areal_pipeline.inference.launcher import ServerProcess, launch_servers
from areal_pipeline.model import load_tokenizer, resolve_model_path
from areal_pipeline.rewards.pool import RewardPool
from areal_pipeline.rollout.executor import episode_seed, rollout_to_shards, select_batch, write_rollout_shards
from areal_pipeline.training.client import TrainerClient, TrainerError, launch_trainer
from areal_pipeline.training.ppo import write_batch
from areal_pipeline.utils import (atomic_write_text, find_free_port, get_logger, raise_if_deadline_passed, run_async,
                                  time_left)

logger = get_logger(__name__)


NODES = ("rollout", "advantages", "ppo_update", "broadcast_weights", "checkpoint", "evaluate")
# Asynchronous mode (eta > 0): iteration k+1's first nodes run while iteration k's ppo_update runs. Its episodes
# come from the background executor, within the staleness bound, and its advantages need no new weights.
AHEAD_NODES = ("rollout", "advantages")


class RunLockedError(RuntimeError):
    pass


@contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    """Refuse a second live run of the same run id (they would overwrite each other's outputs)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / ".lock"
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        owner = handle.read().strip() or "another process"
        handle.close()
        raise RunLockedError(f"run '{run_dir.name}' is already running ({owner}); refusing to start a second "
                             f"run with the same run_id in {run_dir}") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()}")
    handle.flush()
    try:
        yield
    finally:
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


@dataclass(frozen=True)
class RunPaths:
    run_dir: Path

    def iteration(self, k: int) -> Path:
        return self.run_dir / f"iter_{k}"

    def rollout(self, k: int) -> Path:
        return self.iteration(k) / "rollout"

    def batch(self, k: int) -> Path:
        return self.iteration(k) / "batch"

    def update(self, k: int) -> Path:
        return self.iteration(k) / "update.json"

    def evaluation(self, k: int) -> Path:
        return self.iteration(k) / "eval.json"

    def metrics(self, k: int) -> Path:
        return self.iteration(k) / "metrics.json"

    @property
    def checkpoints(self) -> Path:
        return self.run_dir / "checkpoints"

    def checkpoint(self, k: int) -> Path:
        return self.checkpoints / f"step_{k}"

    def weights(self, k: int) -> Path:
        return self.run_dir / "weights" / f"v{k}"

    @property
    def metrics_jsonl(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    def saved_checkpoints(self) -> list[int]:
        """The steps whose checkpoint was saved to the end: its checksums.json is written last, so a save that
        crashed midway never counts (whether the files are still intact is checked where they are used)."""
        if not self.checkpoints.is_dir():
            return []
        return sorted(int(p.name.split("_")[1]) for p in self.checkpoints.glob("step_*") if has_checksums(p))

    def completed_iterations(self) -> list[int]:
        return sorted(int(p.parent.name.split("_")[1]) for p in self.run_dir.glob("iter_*/metrics.json"))


def _read_json(path: Path) -> Optional[dict]:
    return json.loads(path.read_text()) if path.is_file() else None


def _write_json(path: Path, record: dict) -> dict:
    atomic_write_text(path, json.dumps(record, indent=1, sort_keys=True) + "\n")
    return record


class ServicesStoppedError(RuntimeError):
    pass


class Services:
    """The long-lived processes of a run (inference servers, trainer, tool servers), owned by the
    orchestrating process; steps find them here and restart the ones that died.

    A step asks each service over HTTP whether it is healthy only when that is in doubt: at first, and after
    any step failed (`distrust`). While every step succeeds, a running process that answered its last request
    is taken as healthy: on a default iteration those checks were a dozen loopback round trips, ~5% of it."""

    def __init__(self, cfg: ExperimentConfig, model_path: str, log_dir: Path):
        self.cfg = cfg
        self.model_path = model_path
        self.log_dir = log_dir
        self.inference: list[ServerProcess] = []
        self.trainer: Optional[ServerProcess] = None
        self.trainer_client: Optional[TrainerClient] = None
        self.tools: dict[str, ServerProcess] = {}
        self.stopped = False  # after stop(), nothing is started or restarted again
        self._inference_checked = self._trainer_checked = False
        # The policy version each inference server serves, as last read or pushed (None: ask them). Threads
        # read and record it; `_served_epoch` counts what made it unknown (a push, a restart, a failure), so a
        # reading that was overtaken by one of those is never recorded.
        self._served: Optional[list[Optional[int]]] = None
        self._served_epoch = 0
        self._served_lock = threading.Lock()
        # Ctrl-C or SIGTERM stops them at once, wherever the orchestrator's threads are
        self._on_stop_signal = shutdown.register(f"the services of run {cfg.run_id}", self.stop)

    def distrust(self) -> None:
        """A step failed: the next steps ask every service whether it is healthy, and what it serves."""
        self._inference_checked = self._trainer_checked = False
        self.forget_served()
        if self.trainer_client is not None:
            self.trainer_client.forget_version()

    def forget_served(self) -> int:
        with self._served_lock:
            self._served, self._served_epoch = None, self._served_epoch + 1
            return self._served_epoch

    def known_served(self) -> tuple[int, Optional[list[Optional[int]]]]:
        with self._served_lock:
            return self._served_epoch, None if self._served is None else list(self._served)

    def record_served(self, epoch: int, versions: list[Optional[int]]) -> None:
        with self._served_lock:
            if epoch == self._served_epoch:
                self._served = list(versions)

    def _refuse_if_stopped(self) -> None:
        if self.stopped:
            raise ServicesStoppedError("the run's services were stopped (the run is ending)")

    def start_inference(self) -> list[str]:
        self._refuse_if_stopped()
        if not self.inference:
            self.inference = launch_servers(self.model_path, self.cfg.inference, self.cfg.seed, self.log_dir)
        return self.addresses

    def start_trainer(self) -> str:
        self._refuse_if_stopped()
        if self.trainer is None:
            self.trainer, self.trainer_client = launch_trainer(self.cfg, self.model_path, self.log_dir)
        return self.trainer.address

    def start_tools(self) -> dict[str, str]:
        self._refuse_if_stopped()
        address = self.cfg.rollout.agent.retrieval.address
        if self.cfg.rollout.workflow == "search_agent" and address:
            from areal_pipeline.tools.retrieval_client import check_retrieval_server

            check_retrieval_server(address)  # a server already running: the workflow uses it, none is started
        elif self.cfg.rollout.workflow == "search_agent" and "retrieval" not in self.tools:
            from areal_pipeline.tools.retrieval_server import launch_retrieval_server

            self.tools["retrieval"] = launch_retrieval_server(self.cfg, self.log_dir)
        return {name: p.address for name, p in self.tools.items()}

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self.inference]

    def ensure_inference_alive(self) -> None:
        """Restart servers that died (they come back at version 0; the next step pushes the weights)."""
        self._refuse_if_stopped()
        dead = [s for s in self.inference if s.popen is None or s.popen.poll() is not None
                or not (self._inference_checked or s.is_healthy())]
        self._inference_checked = True
        if dead:
            self.forget_served()
            logger.warning("inference server(s) %s died; restarting", ", ".join(s.address for s in dead))
            for s in dead:
                s.stop()
            self.inference = [s for s in self.inference if s not in dead]
            # restart on the same ports, so that addresses recorded elsewhere stay valid
            self.inference += [ServerProcess(s.command, s.address, s.log_path, s.env, s.fork).start() for s in dead]
            for s in self.inference[-len(dead):]:
                s.wait_healthy(self.cfg.inference.setup_timeout)

    def ensure_trainer_alive(self) -> TrainerClient:
        self._refuse_if_stopped()
        if self.trainer is not None and self.trainer.popen.poll() is None and (
                self._trainer_checked or self.trainer.is_healthy()):
            self._trainer_checked = True
            return self.trainer_client
        logger.warning("the trainer is down; restarting it")
        if self.trainer is not None:
            self.trainer.stop()
        self.trainer = self.trainer_client = None
        self.start_trainer()
        return self.trainer_client

    def stop(self) -> None:
        self.stopped = True
        shutdown.unregister(self._on_stop_signal)
        for process in [*self.inference, *([self.trainer] if self.trainer else []), *self.tools.values()]:
            try:
                process.stop()
            except Exception:  # teardown goes on for the others
                logger.exception("could not stop %s", process.address)
        self.inference, self.trainer, self.trainer_client, self.tools = [], None, None, {}


def _timed(step):
    """Record how long the library work of a node took (`Pipeline.step_seconds[k][name]`), apart from any
    orchestration around it."""
    import functools

    @functools.wraps(step)
    def run(self, k: int, *args, **kwargs):
        started = time.perf_counter()
        try:
            return step(self, k, *args, **kwargs)
        except BaseException:
            self.services.distrust()
            raise
        finally:
            self.step_seconds.setdefault(k, {})[step.__name__] = time.perf_counter() - started
    return run


class Pipeline:
    def __init__(self, cfg: ExperimentConfig, log_dir: Optional[Path] = None):
        self.cfg = cfg
        self.paths = RunPaths(cfg.run_dir)
        self.model_path = resolve_model_path(cfg.model, cfg.output_dir, cfg.seed)
        self.services = Services(cfg, self.model_path, log_dir or cfg.run_dir / "logs")
        self._tokenizer = None
        self._reward_pool: Optional[RewardPool] = None
        self._records: dict[str, list[dict]] = {}
        self.step_seconds: dict[int, dict[str, float]] = {}
        self._async_rollout = None
        # the trainer runs one command at a time, and restoring its version is a sequence of commands
        self._trainer_lock = threading.RLock()
        self._metrics_lines: Optional[dict[int, str]] = None  # metrics.jsonl's lines by iteration
        self._metrics_lock = threading.Lock()

    # ----- set-up ----------------------------------------------------------------------------------
    def prepare_dataset(self) -> dict[str, Any]:
        """Both splits as jsonl under `<output_dir>/_datasets/<content digest>/`, made once per content."""
        d = self.cfg.dataset
        source = hashlib.sha256(json.dumps(to_dict(d), sort_keys=True).encode() + str(self.cfg.seed).encode())
        if d.path and Path(d.path).exists():
            for f in sorted(Path(d.path).rglob("*.jsonl")) if Path(d.path).is_dir() else [Path(d.path)]:
                source.update(f.read_bytes())
        out = Path(self.cfg.output_dir) / "_datasets" / f"{d.name}-{source.hexdigest()[:16]}"
        manifest = _read_json(out / "manifest.json")
        if manifest is None:
            counts = {}
            for split in (d.train_split, d.test_split):
                records = load_records(d, split, self.cfg.seed)
                atomic_write_text(out / f"{split}.jsonl",
                                  "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
                counts[split] = len(records)
            manifest = _write_json(out / "manifest.json", {"path": str(out), "counts": counts, "name": d.name})
        self.dataset_dir = Path(manifest["path"])
        return manifest

    def records(self, split: str) -> list[dict]:
        if split not in self._records:
            if not hasattr(self, "dataset_dir"):
                self.prepare_dataset()
            with open(self.dataset_dir / f"{split}.jsonl", encoding="utf-8") as f:
                self._records[split] = [json.loads(line) for line in f]
        return self._records[split]

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.model_path, self.cfg.model.trust_remote_code)
        return self._tokenizer

    @property
    def reward_pool(self) -> RewardPool:
        if self._reward_pool is None:
            self._reward_pool = RewardPool(self.cfg.rollout.reward_workers, self.cfg.rollout.reward_timeout)
        return self._reward_pool

    def close(self) -> None:
        if self._async_rollout is not None:
            self._async_rollout.stop()
            self._async_rollout = None
        if self._reward_pool is not None:
            self._reward_pool.close()
            self._reward_pool = None

    # ----- versions --------------------------------------------------------------------------------
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

    def _update_from_batch(self, client: TrainerClient, k: int) -> dict:
        """The trainer's update k on iteration k's batch shards (its reply). A batch that is missing, or that the
        trainer refuses as corrupt (it checks every shard before training on any), is first computed again from
        the rollout shards: an update never runs on a corrupt batch."""
        batch = self.paths.batch(k)
        if has_manifest(batch):
            try:
                return client.call("train", batch_dir=str(batch), iteration=k)
            except TrainerError as error:
                if error.code != "corrupt_file":
                    raise
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
            self.services.record_served(epoch, [version] * len(self.services.inference))
        self._notify_version(version)
        self._prune_weights(keep=version)
        return {"version": version, "pushed": True, "seconds": time.perf_counter() - started}

    def _push_weights(self, version: int, or_newer: bool) -> int:
        """Push `version` (`or_newer`: the trainer's newest, if newer) to every server; returns what was pushed."""
        if or_newer:
            current = self.services.ensure_trainer_alive().current_version()
            version = max(version, 0 if current is None else current)
        client = self.ensure_trainer_version(version)
        if self.cfg.trainer.weight_sync == "distributed":
            async def push():
                async with self._engine() as engine:
                    await engine.pause()
                    try:
                        client.call("update_weights_distributed", servers=engine.addresses,
                                    master_address="127.0.0.1", master_port=find_free_port(),
                                    dtype=self._wire_dtype())
                        engine.set_version(version)
                    finally:
                        await engine.resume()
        else:
            path = self.paths.weights(version)
            if not (path / "config.json").is_file():
                client.call("save_weights", path=str(path))

            async def push():
                async with self._engine() as engine:
                    await engine.update_weights(str(path), version)
        run_async(push())
        return version

    def _notify_version(self, version: int) -> None:
        if self._async_rollout is not None:
            self._async_rollout.set_version(version)

    def _wire_dtype(self) -> str:
        inf = self.cfg.inference
        return inf.sglang.dtype if inf.backend == "sglang" else self.cfg.model.dtype

    def _prune_weights(self, keep: int) -> None:
        root = self.paths.run_dir / "weights"
        for path in root.glob("v*") if root.is_dir() else []:
            if path.name != f"v{keep}":
                shutil.rmtree(path, ignore_errors=True)

    def _engine(self) -> RemoteSGLangEngine:
        inf = self.cfg.inference
        return RemoteSGLangEngine(self.services.addresses, request_timeout=inf.request_timeout,
                                  request_retries=inf.request_retries)

    # ----- the DAG's nodes -------------------------------------------------------------------------
    @_timed
    def rollout(self, k: int, progress: bool = False) -> dict[str, Any]:
        out = self.paths.rollout(k)
        # A corrupt earlier output is cleared and generated again: episodes are seeded, so the tokens are the same.
        if keep_if_intact(out):
            return {**read_manifest(out)["stats"], "cached": True}
        if self.cfg.rollout.max_head_offpolicyness > 0:
            served = self.sync_servers(k - 1 - self.cfg.rollout.max_head_offpolicyness, or_newer=True)["version"]
            return self._collect_async(k, served)
        self.sync_servers(k - 1)
        batch = self._episodes(k)
        workflow = self._workflow()

        async def run():
            async with self._engine() as engine:
                return await rollout_to_shards(
                    workflow, engine, batch, out, run_id=self.cfg.run_id, iteration=k,
                    max_concurrent_rollouts=self.cfg.rollout.max_concurrent_rollouts,
                    samples_per_episode=self.cfg.rollout.gconfig.n_samples, rows_per_shard=self.cfg.rollout.shard_rows,
                    progress=progress, extra_manifest={"policy_version": k - 1})
        stats = run_async(run())["stats"]
        return {**stats, "cached": False}

    def _episodes(self, k: int) -> list[dict[str, Any]]:
        """Iteration k's episodes: its prompts (a pure function of k), each with its sampling seed."""
        return [{**r, "sampling_seed": episode_seed(self.cfg.seed, k, r["prompt_id"])}
                for r in select_batch(self.records(self.cfg.dataset.train_split), k - 1,
                                      self.cfg.rollout.batch_size, self.cfg.seed)]

    def _workflow(self):
        from areal_pipeline.workflows import build_workflow

        return build_workflow(self.cfg, self.tokenizer, self.reward_pool, **self._tool_kwargs())

    def _collect_async(self, k: int, served_version: int) -> dict[str, Any]:
        """Asynchronous mode: iteration k's episodes from the background executor (started on first use,
        from this iteration on), written as the iteration's shards."""
        from areal_pipeline.rollout.async_executor import AsyncRolloutExecutor

        if self._async_rollout is None:
            self._async_rollout = AsyncRolloutExecutor(
                first_iteration=k, last_iteration=self.cfg.total_iterations,
                eta=self.cfg.rollout.max_head_offpolicyness, version=served_version, batch_for=self._episodes,
                workflow=self._workflow(), engine_factory=self._engine,
                max_concurrent_rollouts=self.cfg.rollout.max_concurrent_rollouts,
                samples_per_episode=self.cfg.rollout.gconfig.n_samples)
            self._async_rollout.start()
        started = time.perf_counter()
        try:
            trajectories = self._async_rollout.collect(k, timeout=time_left())
        except TimeoutError as error:
            raise_if_deadline_passed(error)
            raise
        except Exception:
            # The executor keeps iteration k's failure for good: drop it, so that this node's retry starts a
            # fresh one at iteration k (the later iterations it had admitted are generated again).
            self._async_rollout.stop()
            self._async_rollout = None
            raise
        manifest = write_rollout_shards(trajectories, self.paths.rollout(k), run_id=self.cfg.run_id, iteration=k,
                                        seconds=time.perf_counter() - started,
                                        rows_per_shard=self.cfg.rollout.shard_rows,
                                        extra_manifest={"policy_version": k - 1})
        return {**manifest["stats"], "cached": False}

    def _tool_kwargs(self) -> dict[str, Any]:
        tools = {name: p.address for name, p in self.services.tools.items()}
        return {"tool_addresses": tools} if tools else {}

    @_timed
    def advantages(self, k: int) -> dict[str, Any]:
        out = self.paths.batch(k)
        if keep_if_intact(out):  # a corrupt earlier output is cleared and computed again
            return {**read_manifest(out)["stats"], "cached": True}
        return self._write_batch(k)

    def _write_batch(self, k: int) -> dict[str, Any]:
        """Iteration k's rollout shards -> its batch shards (the rollout's are checked as they are read)."""
        out = self.paths.batch(k)
        started = time.perf_counter()
        extra = None
        if self.cfg.ppo.kl_ctl != 0:
            ref_path = self.paths.iteration(k) / "ref_logprobs.parquet"
            with self._trainer_lock:
                client = self.services.ensure_trainer_alive()
                client.call("compute_logp", shard_dir=str(self.paths.rollout(k)), out_path=str(ref_path), model="ref")
            import pyarrow.parquet as pq

            extra = {"ref_logprobs": pq.read_table(ref_path).column("logprobs").to_pylist()}
        manifest = write_batch(self.paths.rollout(k), out, self.cfg.ppo, run_id=self.cfg.run_id, iteration=k,
                               extra_token_columns=extra, rows_per_shard=self.cfg.rollout.shard_rows)
        return {**manifest["stats"], "seconds": time.perf_counter() - started, "cached": False}

    @_timed
    def ppo_update(self, k: int) -> dict[str, Any]:
        record = _read_json(self.paths.update(k))
        if record is not None:
            return {**record, "cached": True}
        with self._trainer_lock:
            reply = self._update_from_batch(self.ensure_trainer_version(k - 1), k)
        return {**_write_json(self.paths.update(k), {"version": reply["version"], **reply["stats"]}), "cached": False}

    @_timed
    def broadcast_weights(self, k: int) -> dict[str, Any]:
        return self.sync_servers(k)

    @property
    def ahead_nodes(self) -> tuple[str, ...]:
        """The nodes of iteration k+1 that need not wait for iteration k's last node: in asynchronous mode
        AHEAD_NODES, which run during iteration k's ppo_update."""
        return AHEAD_NODES if self.cfg.rollout.max_head_offpolicyness > 0 else ()

    def due_nodes(self, k: int) -> list[str]:
        """The nodes iteration k runs: checkpoint and evaluate only on the iterations that save or evaluate."""
        due = {"checkpoint": self.wants_checkpoint(k), "evaluate": self.wants_evaluation(k)}
        return [name for name in NODES if due.get(name, True)]

    def wants_checkpoint(self, k: int) -> bool:
        return k % self.cfg.save_freq == 0 or k == self.cfg.total_iterations

    def wants_evaluation(self, k: int) -> bool:
        return self.cfg.eval_freq > 0 and (k % self.cfg.eval_freq == 0 or k == self.cfg.total_iterations)

    @_timed
    def checkpoint(self, k: int) -> dict[str, Any]:
        if not self.wants_checkpoint(k):
            return {"saved": False}
        path = self.paths.checkpoint(k)
        if has_checksums(path):
            try:
                verify_checksums(path)
                return {"saved": True, "path": str(path), "cached": True}
            except IntegrityError as error:
                logger.warning("checkpoint %d is corrupt, saving it again: %s", k, error)
        started = time.perf_counter()
        with self._trainer_lock:
            client = self.ensure_trainer_version(k)
            client.call("save", path=str(path), extra={"iteration": k, "run_id": self.cfg.run_id})
        for old in self.paths.saved_checkpoints()[: -self.cfg.keep_checkpoints]:
            shutil.rmtree(self.paths.checkpoint(old), ignore_errors=True)
        return {"saved": True, "path": str(path), "seconds": time.perf_counter() - started, "cached": False}

    @_timed
    def evaluate(self, k: int) -> Optional[dict[str, Any]]:
        if not self.wants_evaluation(k):
            return None
        record = _read_json(self.paths.evaluation(k))
        if record is not None:
            return {**record, "cached": True}
        self.sync_servers(k)
        record = evaluate_policy(self.cfg, self._engine, self.records(self.cfg.dataset.test_split), self.tokenizer,
                                 self.reward_pool, self._tool_kwargs())
        return {**_write_json(self.paths.evaluation(k), {"version": k, **record}), "cached": False}

    def record_metrics(self, k: int, nodes: dict[str, Optional[dict]]) -> dict[str, Any]:
        """The iteration's metrics: one flat record in `iter_<k>/metrics.json` and `metrics.jsonl`."""
        rollout, batch, update = nodes["rollout"], nodes["advantages"], nodes["ppo_update"]  # always present
        evaluation = nodes.get("evaluate")
        record = {
            "iteration": k,
            "reward_mean": rollout["reward_mean"], "reward_std": rollout["reward_std"],
            "accuracy": rollout["accuracy"], "response_length": rollout["response_length"],
            "staleness": _staleness(k, rollout), "rollout_tokens_per_s": rollout["rollout_tokens_per_s"],
            "advantage_std": batch.get("advantage_std"), "kl": batch.get("kl_mean"),
            **{k2: update.get(k2) for k2 in ("loss", "entropy", "clip_fraction", "dual_clip_fraction", "approx_kl",
                                             "importance_weight", "behave_imp_weight", "behave_mask_fraction",
                                             "grad_norm", "lr")},
            "train_tokens_per_s": update.get("tokens_per_s"),
            "eval_pass_at_1": evaluation.get("pass_at_1") if evaluation else None,
            "eval_reward": evaluation.get("reward_mean") if evaluation else None,
            **{f"time_{name}": round(s, 4) for name, s in self.step_seconds.get(k, {}).items()},
            **{key: value for key, value in rollout.items() if key.startswith("agent/")},  # the workflow's facts
        }
        _write_json(self.paths.metrics(k), record)
        with self._metrics_lock:
            if self._metrics_lines is None:  # what earlier runs of this run id recorded
                self._metrics_lines = {i: json.dumps(json.loads(self.paths.metrics(i).read_text()), sort_keys=True)
                                       for i in self.paths.completed_iterations()}
            self._metrics_lines[k] = json.dumps(record, sort_keys=True)
            atomic_write_text(self.paths.metrics_jsonl,
                              "".join(self._metrics_lines[i] + "\n" for i in sorted(self._metrics_lines)))
        return record

    def run_iteration(self, k: int) -> dict[str, Any]:
        """The plain (orchestrator-free) iteration: the same nodes in the same order."""
        return self.record_metrics(k, self._run_nodes(k, NODES))

    def run_iterations(self, first: int, last: int) -> list[dict[str, Any]]:
        """The plain loop over iterations first..last. As in the train flow, iteration k's metrics are recorded
        (in order, in a thread) while the next iteration runs, and in asynchronous mode iteration k+1's
        AHEAD_NODES run (in a thread) while iteration k updates."""
        rest = [name for name in NODES if name not in self.ahead_nodes]
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="next-iteration") as ahead_pool, \
                ThreadPoolExecutor(max_workers=1, thread_name_prefix="report") as report_pool:
            reports: list[Future] = []
            ahead: Optional[Future] = None
            for k in range(first, last + 1):
                nodes = ahead.result() if ahead is not None else self._run_nodes(k, self.ahead_nodes)
                if self.ahead_nodes and k < last:
                    ahead = ahead_pool.submit(self._run_nodes, k + 1, self.ahead_nodes)
                nodes.update(self._run_nodes(k, rest))
                reports.append(report_pool.submit(self.record_metrics, k, nodes))
            return [report.result() for report in reports]

    def _run_nodes(self, k: int, names) -> dict[str, Any]:
        return {name: getattr(self, name)(k) for name in names}

    def start(self) -> None:
        save_config(self.cfg, self.paths.run_dir / "config.yaml")
        self.prepare_dataset()
        run_together([self.services.start_tools, self.services.start_inference, self.services.start_trainer,
                      self.warm_up])

    def warm_up(self) -> None:
        """Load now what the first rollout would otherwise load on its critical path: the tokenizer, and the
        reward workers (spawned in the background; each imports the reward module, ~1-2 s)."""
        from areal_pipeline.workflows import pooled_reward_function

        reward_fn = pooled_reward_function(self.cfg)
        if reward_fn is not None:
            self.reward_pool.warm_up(reward_fn)
        self.tokenizer
        self.records(self.cfg.dataset.train_split)
        # What is loaded by now (modules, tokenizer, data set records) lives as long as the run: exempt it from
        # the collector. Otherwise every full collection walks it all again, ~0.2 s with the orchestrating
        # process stalled, a few times a minute (~5% of an asynchronous run's wall time).
        gc.freeze()


def run_together(steps: list[Callable[[], Any]]) -> list[Any]:
    """Run the set-up steps in threads (each mostly waits for a process to come up) and wait for all of
    them, so that no step is still starting a process when the caller cleans up; re-raise the first failure."""
    with ThreadPoolExecutor(max_workers=len(steps), thread_name_prefix="start") as pool:
        futures = [pool.submit(step) for step in steps]
    return [future.result() for future in futures]


def _staleness(k: int, rollout_stats: dict) -> int:
    """How many versions behind the policy of iteration k (version k - 1) its oldest token is."""
    oldest = rollout_stats.get("min_token_version")
    return 0 if oldest is None else (k - 1) - oldest


def evaluate_policy(cfg: ExperimentConfig, engine_factory, records: list[dict], tokenizer, reward_pool,
                    tool_kwargs: dict) -> dict[str, Any]:
    """pass@1 (greedy, one sample per prompt) and mean reward on `records`."""
    import dataclasses

    from areal_pipeline.rollout.executor import run_episodes
    from areal_pipeline.workflows import build_workflow

    records = records[: cfg.eval_max_prompts] if cfg.eval_max_prompts else records
    greedy = dataclasses.replace(cfg.rollout.gconfig, n_samples=1, greedy=True)
    eval_cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, gconfig=greedy))
    workflow = build_workflow(eval_cfg, tokenizer, reward_pool, **tool_kwargs)
    started = time.perf_counter()

    async def run():
        async with engine_factory() as engine:
            return await run_episodes(workflow, engine, records,
                                      max_concurrent_rollouts=cfg.rollout.max_concurrent_rollouts, progress=False)
    trajectories = run_async(run())
    n = max(1, len(trajectories))
    return {
        "num_prompts": len(records),
        "pass_at_1": sum(t.reward >= 1.0 for t in trajectories) / n,
        "reward_mean": sum(t.reward for t in trajectories) / n,
        "response_length": sum(t.num_generated for t in trajectories) / n,
        "seconds": time.perf_counter() - started,
        "samples": [{"prompt": next((m["content"] for m in t.messages if m["role"] == "user"), ""),
                     "completion": t.text, "reward": t.reward} for t in trajectories[:4]],
    }


def resolve_run_config(config_path, overrides: Optional[list[str]] = None, run_id: Optional[str] = None,
                       iterations: Optional[int] = None) -> ExperimentConfig:
    """The run's config; `iterations` extends an existing run by that many iterations past its newest one."""
    from areal_pipeline.config import load_config

    overrides = list(overrides or []) + ([f"run_id={run_id}"] if run_id else [])
    cfg = load_config(config_path, overrides)
    if iterations is not None:
        cfg.total_iterations = newest_completed_iteration(cfg.run_dir) + iterations
    return cfg


def resolve_checkpoint(cfg: ExperimentConfig, checkpoint: str) -> Path:
    """A servable model directory, checked by `verify_model_dir`: "latest" (the run's newest checkpoint), a
    checkpoint directory, or an HF model directory."""
    if checkpoint == "latest":
        saved = RunPaths(cfg.run_dir).saved_checkpoints()
        if not saved:
            raise FileNotFoundError(f"run '{cfg.run_id}' has no checkpoint yet in {cfg.run_dir / 'checkpoints'}")
        return verify_model_dir(RunPaths(cfg.run_dir).checkpoint(saved[-1]) / "model")
    path = Path(checkpoint)
    if (path / "model" / "config.json").is_file():
        return verify_model_dir(path / "model")
    if (path / "config.json").is_file():
        return verify_model_dir(path)
    raise FileNotFoundError(f"{checkpoint} is neither a checkpoint directory (with model/) nor a model directory")


def verify_model_dir(model_dir: Path) -> Path:
    """`model_dir`, once its files match the checksums.json of the run checkpoint it belongs to (IntegrityError
    names the first file that does not, or the missing manifest). A model directory that is no run checkpoint's
    (a user's own model) has no checksums and is taken as it is."""
    checkpoint = Path(model_dir).parent
    if has_checksums(checkpoint) or (checkpoint / "trainer_state.json").is_file():
        verify_checksums(checkpoint, under=Path(model_dir).name)
    return Path(model_dir)


def evaluate_checkpoint(cfg: ExperimentConfig, checkpoint: str | Path) -> dict[str, Any]:
    """Serve `checkpoint` (as `resolve_checkpoint` takes it, and checked there) on fresh inference servers and
    score it on the test split; the record names the model directory served (`model`)."""
    import dataclasses

    model_dir = resolve_checkpoint(cfg, str(checkpoint))
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(model_dir)))
    pipeline = Pipeline(cfg, log_dir=cfg.run_dir / "logs" / "evaluate")  # apart from a live train run's logs
    try:
        pipeline.services.start_tools()
        pipeline.services.start_inference()
        return {"model": str(model_dir), **evaluate_policy(
            cfg, pipeline._engine, pipeline.records(cfg.dataset.test_split), pipeline.tokenizer, pipeline.reward_pool,
            pipeline._tool_kwargs())}
    finally:
        pipeline.close()
        pipeline.services.stop()


def newest_completed_iteration(run_dir: Path) -> int:
    done = RunPaths(run_dir).completed_iterations()
    return done[-1] if done else 0


def run_plain(cfg: ExperimentConfig, first: int = 1, last: Optional[int] = None) -> list[dict[str, Any]]:
    """The train loop without an orchestrator (the baseline of bench/orchestration_overhead.py)."""
    pipeline = Pipeline(cfg)
    with run_lock(cfg.run_dir):
        try:
            pipeline.start()
            records = pipeline.run_iterations(first, last or cfg.total_iterations)
        finally:
            pipeline.close()
            pipeline.services.stop()
    return records
