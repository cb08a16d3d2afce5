"""One RL iteration as steps that any orchestrator can call: the Prefect tasks wrap them one to one, and a
plain loop (`run_plain`) calls the same functions, in the order and with the inputs of the table in steps.py
(each step takes the records of the steps before it that it needs). Beside it: the run's directory and lock
(run_dir.py), the rollout node and its episode journal (rollout_steps.py), its processes (services.py), the
restoring of policy versions (policy_versions.py), the reference and proximal logprob passes (logprob_steps.py),
evaluation (evaluation.py).

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

Rollouts are seeded per episode (seed, iteration, prompt), and every finished group is journaled, so a rerun of
a half-finished rollout plays only the missing groups and they sample the same tokens; with
`ppo.recompute_logprob` the trainer's "old" logprobs are recomputed from those tokens, so a rerun after a crash
reaches the same final weights bit for bit.
"""

from __future__ import annotations

import gc
import hashlib
import json
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional

from areal_pipeline.checksums import IntegrityError, has_checksums, verify_checksums
from areal_pipeline.config import ExperimentConfig, adapter_push, save_config, to_dict
from areal_pipeline.data.datasets import ROW_FILE_SUFFIXES, load_records
from areal_pipeline.data.shards import keep_if_intact, read_manifest
from areal_pipeline.inference.backend import engine_for
from areal_pipeline.inference.client import RemoteSGLangEngine
from areal_pipeline.inference.adapters import ServedAdapter
from areal_pipeline.logprob_steps import LogprobSteps
from areal_pipeline.model import load_tokenizer, resolve_model_path
from areal_pipeline.policy_eval import evaluate_policy
from areal_pipeline.policy_versions import PolicyVersions
from areal_pipeline.rewards.pool import RewardPool
from areal_pipeline.rollout_steps import RolloutSteps, shards_record
from areal_pipeline.run_dir import RunPaths, read_json, run_lock, write_json
from areal_pipeline.run_spec import RunSpec, assemble
from areal_pipeline.services import Services
from areal_pipeline.steps import STEPS, Step, due_steps, run_steps, timed
from areal_pipeline.training.loss_registry import make_loss
from areal_pipeline.training.batches import write_batch
from areal_pipeline.utils import atomic_write_text, get_logger, import_in_background, run_async

logger = get_logger(__name__)

FAILURE_METRICS = ("failure_rate", "groups_dropped", "groups_refilled", "episodes_masked")


class Pipeline(RolloutSteps, PolicyVersions, LogprobSteps):
    def __init__(self, cfg: ExperimentConfig | RunSpec, log_dir: Optional[Path] = None):
        self.spec = cfg if isinstance(cfg, RunSpec) else assemble(cfg)  # a config is assembled here
        cfg = self.cfg = self.spec.cfg
        self.paths = RunPaths(cfg.run_dir)
        self.model_path = resolve_model_path(cfg.model, cfg.output_dir, cfg.seed)
        self.services = Services(cfg, self.model_path, log_dir or cfg.run_dir / "logs", tools=self.spec.tools)
        self._tokenizer = None
        self._reward_pool: Optional[RewardPool] = None
        self._group_reward: Optional[Any] = None  # rollout.group_reward, built on first use (rollout_steps)
        self._records: dict[str, list[dict]] = {}
        self.step_seconds: dict[int, dict[str, float]] = {}
        self._async_rollout = None
        self._journals: dict = {}  # iteration -> its episode journal (rollout_steps)
        # where pushes send the LoRA adapter alone: the one the servers serve, named by every request
        self.served_adapter = ServedAdapter() if adapter_push(cfg) else None
        # the trainer runs one command at a time, and restoring its version is a sequence of commands
        self._trainer_lock = threading.RLock()
        self._metrics_lines: Optional[dict[int, str]] = None  # metrics.jsonl's lines by iteration
        self._metrics_lock = threading.Lock()
        # the loss's columns of policy k - 1's own logprobs; with one minibatch the update's forward gives them
        self.proximal_columns = make_loss(cfg.ppo).policy_columns if cfg.ppo.ppo_n_minibatches > 1 else ()

    # ----- set-up ----------------------------------------------------------------------------------
    def prepare_dataset(self) -> dict[str, Any]:
        """Both splits as jsonl under `<output_dir>/_datasets/<content digest>/`, made once per content."""
        d = self.cfg.dataset
        source = hashlib.sha256(json.dumps(to_dict(d), sort_keys=True).encode() + str(self.cfg.seed).encode())
        if d.path and Path(d.path).exists():
            files = [f for f in Path(d.path).rglob("*") if f.suffix in ROW_FILE_SUFFIXES] if Path(d.path).is_dir() \
                else [Path(d.path)]
            for f in sorted(files):
                source.update(f.read_bytes())
        out = Path(self.cfg.output_dir) / "_datasets" / f"{d.name}-{source.hexdigest()[:16]}"
        manifest = read_json(out / "manifest.json")
        if manifest is None:
            counts = {}
            for split in (d.train_split, d.test_split):
                records = load_records(d, split, self.cfg.seed)
                atomic_write_text(out / f"{split}.jsonl",
                                  "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
                counts[split] = len(records)
            manifest = write_json(out / "manifest.json", {"path": str(out), "counts": counts, "name": d.name})
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
        self.close_journals()
        if self._reward_pool is not None:
            self._reward_pool.close()
            self._reward_pool = None
        group_reward, self._group_reward = self._group_reward, None
        if group_reward is not None:  # rollout.group_reward: its connections
            try:
                run_async(group_reward.aclose())
            except Exception as error:  # closing: a warning, not a failure of the run
                logger.warning("rollout.group_reward: aclose() failed: %s", error)

    # ----- versions --------------------------------------------------------------------------------
    def _engine(self) -> RemoteSGLangEngine:
        # the backend's protocol; where pushes load the LoRA adapter alone, every request names it
        return engine_for(self.services.addresses, self.cfg.inference, adapter=self.served_adapter)

    # ----- the DAG's nodes -------------------------------------------------------------------------
    @timed
    def advantages(self, k: int, episodes: Optional[dict] = None, ref: Optional[dict] = None) -> dict[str, Any]:
        """`episodes`: the rollout step's record (its shards); `ref`: the ref_logprobs step's, where KL is on."""
        out = self.paths.batch(k)
        if keep_if_intact(out):  # a corrupt earlier output is cleared and computed again
            return shards_record(out, read_manifest(out), cached=True)
        return self._write_batch(k, episodes, ref)

    def _write_batch(self, k: int, episodes: Optional[dict] = None, ref: Optional[dict] = None) -> dict[str, Any]:
        """Iteration k's rollout shards -> its batch shards (the rollout's are checked as they are read)."""
        out = self.paths.batch(k)
        rollout = Path(episodes["shards"]) if episodes else self.paths.rollout(k)
        started = time.perf_counter()
        extra = None
        if self.cfg.ppo.kl_ctl != 0:
            import pyarrow.parquet as pq

            ref = ref or self._reference_logprobs(k, episodes)  # e.g. a batch computed again to replay an update
            extra = {"ref_logprobs": pq.read_table(ref["path"]).column("logprobs").to_pylist()}
        manifest = write_batch(rollout, out, self.cfg.ppo, run_id=self.cfg.run_id, iteration=k,
                               extra_token_columns=extra, rows_per_shard=self.cfg.rollout.shard_rows)
        return {**shards_record(out, manifest, cached=False), "seconds": time.perf_counter() - started}

    @timed
    def ppo_update(self, k: int, batch: Optional[dict] = None, proximal: Optional[dict] = None) -> dict[str, Any]:
        """`batch`: the advantages step's record; `proximal`: the proximal_logprobs step's, where it runs."""
        record = read_json(self.paths.update(k))
        if record is not None:
            return {**record, "cached": True}
        with self._trainer_lock:
            reply = self._update_from_batch(self.ensure_trainer_version(k - 1), k,
                                            proximal["path"] if proximal else None)
        return {**write_json(self.paths.update(k), {"version": reply["version"], **reply["stats"]}), "cached": False}

    @timed
    def broadcast_weights(self, k: int, update: Optional[dict] = None) -> dict[str, Any]:
        """`update`: the ppo_update step's record (the version the servers get)."""
        if update is not None and update.get("version") != k:
            raise ValueError(f"broadcast_weights of iteration {k} was handed the update to version "
                             f"{update.get('version')}")
        return self.sync_servers(k)

    @property
    def ahead_nodes(self) -> tuple[str, ...]:
        """The steps of iteration k+1 that need not wait for iteration k's last step: in asynchronous mode those
        marked `ahead` in steps.py, which run during iteration k's ppo_update."""
        return tuple(s.name for s in STEPS if s.ahead) if self.cfg.rollout.max_head_offpolicyness > 0 else ()

    def due_nodes(self, k: int) -> list[str]:
        """The steps iteration k runs (steps.py): e.g. checkpoint and evaluate only on the iterations that save or
        evaluate."""
        return [step.name for step in due_steps(self, k)]

    def wants_checkpoint(self, k: int) -> bool:
        return k % self.cfg.save_freq == 0 or k == self.cfg.total_iterations

    def wants_evaluation(self, k: int) -> bool:
        return self.cfg.eval_freq > 0 and (k % self.cfg.eval_freq == 0 or k == self.cfg.total_iterations)

    def wants_initial_evaluation(self, first: int) -> bool:
        """Whether the run evaluates policy 0 (`evaluate(0)`, the start of its pass@1 curve) before iteration
        `first`: where it evaluates at all, once, before its first iteration (a run continued from a later one, e.g.
        a branch, does not bring its servers back to policy 0 for it; one it finds made is handed back cached)."""
        return self.cfg.eval_freq > 0 and (first == 1 or self.paths.evaluation(0).is_file())

    @timed
    def checkpoint(self, k: int, served: Optional[dict] = None) -> dict[str, Any]:
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
        for old in prunable_checkpoints(self.paths, self.cfg.keep_checkpoints, self.cfg.keep_best_checkpoint):
            shutil.rmtree(self.paths.checkpoint(old), ignore_errors=True)
        return {"saved": True, "path": str(path), "seconds": time.perf_counter() - started, "cached": False}

    @timed
    def evaluate(self, k: int, served: Optional[dict] = None) -> Optional[dict[str, Any]]:
        if not self.wants_evaluation(k):
            return None
        record = read_json(self.paths.evaluation(k))
        if record is not None:
            return {**record, "cached": True}
        self.sync_servers(k)
        record = evaluate_policy(self.spec, self._engine, self.records(self.cfg.dataset.test_split), self.tokenizer,
                                 self.reward_pool, self._tool_kwargs())
        return {**write_json(self.paths.evaluation(k), {"version": k, **record}), "cached": False}

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
            # the mean reward of the baseline episodes, where the advantage asks for them (ReMax's greedy ones)
            **({"baseline_reward": rollout["baseline_reward"]} if "baseline_reward" in rollout else {}),
            **{key: value for key, value in rollout.items() if key.startswith("agent/")},  # the workflow's facts
            # the failure policy's counts (rollout/failures.py): failed and retried episodes by cause, groups dropped
            **{key: value for key, value in rollout.items() if key.startswith(("failures/", "retries/"))
               or key in FAILURE_METRICS},
            # what the group reward's judge calls cost (rollout.group_reward, rewards/judge.py)
            **{key: value for key, value in rollout.items() if key.startswith("judge/")},
        }
        # None where the config computes no such thing, rather than the 0.0 its step reports
        record.update(dict.fromkeys(self._metrics_not_computed(), None))
        write_json(self.paths.metrics(k), record)
        with self._metrics_lock:
            if self._metrics_lines is None:  # what earlier runs of this run id recorded
                self._metrics_lines = {i: json.dumps(json.loads(self.paths.metrics(i).read_text()), sort_keys=True)
                                       for i in self.paths.completed_iterations()}
            self._metrics_lines[k] = json.dumps(record, sort_keys=True)
            atomic_write_text(self.paths.metrics_jsonl,
                              "".join(self._metrics_lines[i] + "\n" for i in sorted(self._metrics_lines)))
        return record

    def _metrics_not_computed(self) -> list[str]:
        """The metrics the config never computes: KL without a reference model, dual clipping without c_clip."""
        return [name for name, off in (("kl", self.cfg.ppo.kl_ctl == 0),
                                       ("dual_clip_fraction", self.cfg.ppo.c_clip is None)) if off]

    def run_iteration(self, k: int) -> dict[str, Any]:
        """The plain (orchestrator-free) iteration: the same steps in the same order, with the same inputs."""
        return self.record_metrics(k, self._run_steps(k, due_steps(self, k)))

    def run_iterations(self, first: int, last: int) -> list[dict[str, Any]]:
        """The plain loop over iterations first..last, after the initial policy's evaluation where the run makes one
        (`wants_initial_evaluation`). As in the train flow, iteration k's metrics are recorded
        (in order, in a thread) while the next iteration runs, and in asynchronous mode iteration k+1's
        `ahead_nodes` run (in a thread) while iteration k updates."""
        def part(k: int, ahead: bool) -> list[Step]:
            return [step for step in due_steps(self, k) if (step.name in self.ahead_nodes) == ahead]

        if self.wants_initial_evaluation(first):  # as the train flow's set-up node evaluate-0
            self.evaluate(0)

        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="next-iteration") as ahead_pool, \
                ThreadPoolExecutor(max_workers=1, thread_name_prefix="report") as report_pool:
            reports: list[Future] = []
            ahead: Optional[Future] = None
            for k in range(first, last + 1):
                outputs = ahead.result() if ahead is not None else self._run_steps(k, part(k, True))
                if self.ahead_nodes and k < last:
                    ahead = ahead_pool.submit(self._run_steps, k + 1, part(k + 1, True))
                self._run_steps(k, part(k, False), outputs)
                reports.append(report_pool.submit(self.record_metrics, k, outputs))
            return [report.result() for report in reports]

    def _run_steps(self, k: int, steps: list[Step], outputs: Optional[dict] = None) -> dict[str, Any]:
        return run_steps(lambda step, inputs: getattr(self, step.name)(k, *inputs), steps, outputs)

    def start(self) -> None:
        save_config(self.cfg, self.paths.run_dir / "config.yaml")
        self.prepare_dataset()
        run_together([self.services.start_tools, self.services.start_inference, self.services.start_trainer,
                      self.warm_up])

    def warm_up(self) -> None:
        """Load now what the first rollout would otherwise load on its critical path: the tokenizer, the
        reward workers (spawned in the background; each imports the reward module, which takes seconds), and
        pandas, which pyarrow imports at its first conversion of Python lists (the first shard written), in the
        background while the first rollout waits for the servers."""
        reward_fn = self.spec.reward
        if reward_fn is not None:
            self.reward_pool.warm_up(reward_fn)
        self.tokenizer
        self.records(self.cfg.dataset.train_split)
        import_in_background("pandas")
        # What is loaded by now (modules, tokenizer, data set records) lives as long as the run: exempt it from
        # the collector. Otherwise every full collection walks it all again with the orchestrating process stalled,
        # a few times a minute: a visible share of an asynchronous run's wall time.
        gc.freeze()


def prunable_checkpoints(paths: RunPaths, keep: int, keep_best: bool) -> list[int]:
    """The saved checkpoints to delete: all but the newest `keep`, the best one by eval pass@1 (`keep_best`: of
    the checkpoints whose iteration was evaluated, the highest pass@1, the newest of equals) and the pinned ones
    (a recurring line's champions, recurring/line.py)."""
    saved = paths.saved_checkpoints()
    kept = set(saved[-keep:]) | paths.pinned_checkpoints()
    if keep_best:
        scored = [(record["pass_at_1"], k) for k in saved
                  if (record := read_json(paths.evaluation(k))) is not None and record.get("pass_at_1") is not None]
        if scored:
            kept.add(max(scored)[1])
    return [k for k in saved if k not in kept]


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
