"""Branching a run: a new run that starts from another run's policy after iteration K, with new hyperparameters.

    branch  (mode "branch"): iterations 1..K are the parent's; K+1.. are trained afresh (new rollouts) under the
            branch's config, from the parent's policy K: its checkpoint at K, or, where it saved none at K, its
            newest one before K plus the updates after it replayed from its batch shards under the parent's own
            config (as a rerun restores a trainer), saved as the branch's checkpoint K.
    replay  (mode "replay"): iterations K+1..N are retrained on the parent's recorded rollout shards under the
            branch's training config: new advantages and updates, no new rollouts, so that two algorithms can be
            compared on identical data. With `rescored` the shards are those `areal-pipeline rescore` wrote beside
            the parent's (rescoring.py): the same episodes under another reward, so two reward designs are
            compared on identical rollouts.

The parent's outputs are referenced, not copied: the branch's `iter_<k>` (k <= K), its checkpoint K when the
parent has one, and in a replay the `rollout/` shards of K+1..N are hard links to the parent's files (the same
bytes on disk, no second copy). Every write in this project replaces a file by renaming a new one over it, so
nothing the branch writes reaches the parent's files, and the parent deleting or pruning its own (old
checkpoints) leaves the branch's intact. Where hard links are impossible (another file system) the files are
copied, and the record says so. The branch records its parent in `branch.json`.

The checkpoint K carries the parent's optimizer state and LR-schedule position; the trainer takes the
hyperparameters themselves (learning rate, betas, weight decay, schedule) from the branch's config when it loads
it (training/engine.py), so the branch continues the parent's optimizer with its own settings.
"""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

from areal_pipeline.checksums import IntegrityError, has_checksums, verify_checksums
from areal_pipeline.config import ExperimentConfig, save_config, to_dict
from areal_pipeline.data.shards import ShardError, verify_shards
from areal_pipeline.run_spec import load_config
from areal_pipeline.utils import atomic_directory, atomic_write_text, get_logger, link_tree

logger = get_logger(__name__)

BRANCH_FILE = "branch.json"
MODES = ("branch", "replay")


class BranchError(ValueError):
    pass


@dataclasses.dataclass
class BranchPlan:
    """What `prepare_branch` builds: checked before anything is written or started."""
    mode: str
    parent_run_id: str
    parent_dir: Path
    at: int
    cfg: ExperimentConfig  # the branch's: the parent's config, the overrides, run_id, total_iterations
    parent_cfg: ExperimentConfig
    overrides: list[str]
    parent_checkpoint: Optional[int]  # the parent's checkpoint at K, referenced; None: restored from an older one
    rescored: Optional[str] = None  # a replay on the parent's shards re-scored under this name (rescoring.py)

    @property
    def run_dir(self) -> Path:
        return self.cfg.run_dir

    @property
    def last(self) -> int:
        return self.cfg.total_iterations

    def record(self) -> dict[str, Any]:
        from areal_pipeline.rescoring import read_lineage

        rescored = None
        if self.rescored is not None:
            lineage = read_lineage(self.parent_dir, self.rescored) or {}
            rescored = {"name": self.rescored, "scorer": lineage.get("scorer"), "reward": lineage.get("reward"),
                        "group_reward": lineage.get("group_reward"), "lineage": lineage}
        return {"mode": self.mode, "parent_run_id": self.parent_run_id,
                "parent_run_dir": str(self.parent_dir.resolve()), "at": self.at, "last_iteration": self.last,
                "overrides": self.overrides, "parent_flow_runs": parent_flow_runs(self.parent_dir, self.at),
                "rescored_from": rescored}

    def source_rollout(self, k: int) -> Path:
        """Where the replay's rollout of iteration k comes from: the parent's, or its re-scored one."""
        from areal_pipeline.rescoring import rescored_rollout
        from areal_pipeline.run_dir import RunPaths

        if self.rescored is not None:
            return rescored_rollout(self.parent_dir, self.rescored, k)
        return RunPaths(self.parent_dir).rollout(k)


def parent_config(parent_dir: Path) -> ExperimentConfig:
    path = parent_dir / "config.yaml"
    if not path.is_file():
        raise BranchError(f"{parent_dir} has no config.yaml: the config its runs saved is what a branch starts from")
    return load_config(path)


def _contiguous(done: list[int]) -> int:
    """The last iteration n such that 1..n are all finished."""
    n = 0
    for k in done:
        if k != n + 1:
            break
        n = k
    return n


def plan_branch(parent_dir: str | Path, at: int, run_id: str, overrides: Optional[list[str]] = None,
                replay: bool = False, iterations: Optional[int] = None, rescored: Optional[str] = None) -> BranchPlan:
    """Check a branch (or replay) of the run in `parent_dir` at iteration `at` as run `run_id`; nothing is written.
    Bad input (no such run, K not finished, a setting a branch cannot change, a run directory in the way) raises
    BranchError or the config's ConfigError, naming it."""
    from areal_pipeline.run_dir import RunPaths

    parent_dir = Path(parent_dir)
    overrides = list(overrides or [])
    if not parent_dir.is_dir():
        raise BranchError(f"no run directory {parent_dir}")
    if at < 1:
        raise BranchError(f"--at {at}: a branch starts after a finished iteration (K >= 1)")
    if iterations is not None and iterations < 1:
        raise BranchError(f"--iterations {iterations}: must be >= 1")
    if rescored is not None and not replay:
        raise BranchError("--rescored trains on re-scored rollouts: it goes with --replay")
    parent_cfg = parent_config(parent_dir)
    if run_id == parent_dir.name:
        raise BranchError(f"the branch needs a run id of its own (not {run_id!r}, the parent's)")
    if any(o.split("=", 1)[0].strip() in ("run_id", "total_iterations") for o in overrides):
        raise BranchError("give the branch's run id with --run-id and its length with --iterations, not as overrides")
    finished = _contiguous(RunPaths(parent_dir).completed_iterations())
    if at > finished:
        raise BranchError(f"run {parent_dir.name} has finished iterations 1..{finished}, so it cannot be branched at "
                          f"{at}")
    cfg = load_config(parent_dir / "config.yaml", [*overrides, f"run_id={run_id}"])
    return plan_branch_of(parent_dir, at, cfg, overrides, replay, iterations, rescored, parent_cfg)


# what makes a LoRA policy what it is; its dropout, push and optimizer may change in a branch
LORA_SHAPE = ("enabled", "rank", "alpha", "target_modules", "use_rslora")


def plan_branch_of(parent_dir: str | Path, at: int, cfg: ExperimentConfig, overrides: Optional[list[str]] = None,
                   replay: bool = False, iterations: Optional[int] = None, rescored: Optional[str] = None,
                   parent_cfg: Optional[ExperimentConfig] = None) -> BranchPlan:
    """`plan_branch` for a branch whose config is given whole (`cfg`, its run id the branch's) rather than as
    overrides of the parent's: a recurring line's candidate, configured by the line (`overrides` are recorded as
    what made it). The same checks; nothing is written."""
    from areal_pipeline.run_dir import RunPaths

    parent_dir = Path(parent_dir)
    overrides = list(overrides or [])
    parent_cfg = parent_cfg or parent_config(parent_dir)
    parent_run_id = parent_dir.name
    if cfg.run_id == parent_run_id:
        raise BranchError(f"the branch needs a run id of its own (not {cfg.run_id!r}, the parent's)")
    paths = RunPaths(parent_dir)
    finished = _contiguous(paths.completed_iterations())
    if at > finished:
        raise BranchError(f"run {parent_run_id} has finished iterations 1..{finished}, so it cannot be branched at "
                          f"{at}")
    if cfg.model != parent_cfg.model:
        raise BranchError("model.* cannot change in a branch: it starts from the parent's policy")
    changed = [key for key in LORA_SHAPE if getattr(cfg.trainer.lora, key) != getattr(parent_cfg.trainer.lora, key)]
    if changed:
        raise BranchError(f"trainer.lora.{changed[0]} cannot change in a branch: it continues the parent's "
                          "adapters (a new base: the parent's checkpoint's model/, the merged policy, as model.path)")
    if replay:
        for section in ("rollout", "dataset", "seed"):
            if getattr(cfg, section) != getattr(parent_cfg, section):
                raise BranchError(f"{section}{'.*' if section != 'seed' else ''} cannot change in a replay: it trains "
                                  "on the parent's recorded rollouts")
        last = finished if iterations is None else at + iterations
        if last > finished:
            raise BranchError(f"run {parent_run_id} recorded iterations up to {finished}: a replay from {at} can "
                              f"retrain at most {finished - at}")
        if last <= at:
            raise BranchError(f"nothing to replay: run {parent_run_id} has no finished iteration after {at}")
    else:
        last = at + iterations if iterations is not None else cfg.total_iterations
        if last <= at:
            raise BranchError(f"nothing to train: the config's total_iterations is {cfg.total_iterations}, at or "
                              f"before {at}; give --iterations N")
    cfg.total_iterations = last
    checkpoint = at if at in paths.saved_checkpoints() else None
    plan = BranchPlan("replay" if replay else "branch", parent_run_id, parent_dir, at, cfg, parent_cfg, overrides,
                      checkpoint, rescored)
    if rescored is not None:
        _check_rescored(plan)
    _check_run_dir(plan)
    return plan


def _check_rescored(plan: BranchPlan) -> None:
    """Every replayed iteration must have been re-scored under the name."""
    from areal_pipeline.data.shards import is_complete
    from areal_pipeline.rescoring import read_lineage, rescored_dir

    if read_lineage(plan.parent_dir, plan.rescored) is None:
        raise BranchError(f"run {plan.parent_run_id} has no re-scoring named {plan.rescored!r} "
                          f"({rescored_dir(plan.parent_dir, plan.rescored)}): areal-pipeline rescore --run-id "
                          f"{plan.parent_run_id} --name {plan.rescored} ... first")
    from areal_pipeline.training.advantage_registry import make_advantage

    if make_advantage(plan.cfg.ppo).greedy_baseline:
        raise BranchError(f"ppo.advantage={plan.cfg.ppo.advantage!r} compares each reward with the prompt's greedy "
                          "episode's, which re-scoring cannot score again (that episode's text is not kept): replay "
                          "re-scored shards with another ppo.advantage (e.g. grpo)")
    missing = [k for k in range(plan.at + 1, plan.last + 1) if not is_complete(plan.source_rollout(k))]
    if missing:
        raise BranchError(f"the re-scoring {plan.rescored!r} of run {plan.parent_run_id} has no iteration(s) "
                          f"{missing}: rescore them (--iterations {missing[0]}:{missing[-1]}) or replay fewer "
                          "(--iterations)")


def _check_run_dir(plan: BranchPlan) -> None:
    """A run directory already there must be this very branch (it is then continued), nothing else."""
    if not plan.run_dir.exists():
        return
    recorded = read_branch(plan.run_dir)
    if recorded is None:
        raise BranchError(f"{plan.run_dir} already exists and is not a branch: choose another --run-id")
    wanted = plan.record()
    keys = ("mode", "parent_run_id", "at", "overrides")
    if (recorded.get("rescored_from") or {}).get("name") != plan.rescored:
        raise BranchError(f"{plan.run_dir} is another branch (re-scored shards: "
                          f"{(recorded.get('rescored_from') or {}).get('name')}): choose another --run-id")
    same_parent = Path(recorded["parent_run_dir"]) == plan.parent_dir.resolve()
    if any(recorded.get(key) != wanted[key] for key in keys) or not same_parent:
        raise BranchError(f"{plan.run_dir} is another branch ({recorded['mode']} of {recorded['parent_run_id']} at "
                          f"{recorded['at']}, overrides {recorded['overrides']}): choose another --run-id")


def read_branch(run_dir: Path) -> Optional[dict[str, Any]]:
    path = Path(run_dir) / BRANCH_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def parent_flow_runs(parent_dir: Path, at: int) -> list[str]:
    """The parent's train flow runs that trained iteration `at` or before (newest first): each one records its
    planned iterations under flow_runs/<flow run id>.json."""
    runs = []
    for plan_file in sorted(Path(parent_dir).glob("flow_runs/*.json"), key=lambda p: p.stat().st_mtime,
                            reverse=True):
        try:
            plan = json.loads(plan_file.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if plan.get("first", at + 1) <= at:
            runs.append(plan_file.stem)
    return runs


def prepare_branch(plan: BranchPlan) -> dict[str, Any]:
    """Build the branch's run directory: references to the parent's iterations 1..K (and in a replay to its rollout
    shards K+1..N), its checkpoint K when the parent saved one, config.yaml, metrics.jsonl of 1..K and
    branch.json; atomically (a temporary directory renamed into place). A branch already prepared is left as it
    is. Returns branch.json's record plus `needs_restore`: whether the checkpoint K must still be made
    (`restore_parent_policy`)."""
    from areal_pipeline.run_dir import RunPaths

    parent = RunPaths(plan.parent_dir)
    if plan.run_dir.exists():  # prepared before (plan_branch checked it is this branch): continue it
        record = read_branch(plan.run_dir)
        saved = RunPaths(plan.run_dir).saved_checkpoints()
        return {**record, "needs_restore": not any(c >= plan.at for c in saved)}
    if plan.mode == "replay":  # the data a replay trains on must be intact before anything is built on it
        for k in range(plan.at + 1, plan.last + 1):
            try:
                verify_shards(plan.source_rollout(k))
            except ShardError as error:
                raise BranchError(f"run {plan.parent_run_id}'s rollout of iteration {k} cannot be replayed: {error}")
    if plan.parent_checkpoint is not None:
        try:
            verify_checksums(parent.checkpoint(plan.at))
        except IntegrityError as error:
            logger.warning("the parent's checkpoint %d is corrupt (%s): restoring its policy from an older one",
                           plan.at, error)
            plan.parent_checkpoint = None
    linked = True
    with atomic_directory(plan.run_dir) as tmp:
        paths = RunPaths(tmp)
        for k in range(1, plan.at + 1):
            linked &= link_tree(parent.iteration(k), paths.iteration(k))
        if parent.evaluation(0).is_file():  # the initial policy is the parent's: its evaluation starts both curves
            linked &= link_tree(parent.iteration(0), paths.iteration(0))
        if plan.mode == "replay":
            for k in range(plan.at + 1, plan.last + 1):
                linked &= link_tree(plan.source_rollout(k), paths.rollout(k))
        if plan.parent_checkpoint is not None:
            linked &= link_tree(parent.checkpoint(plan.at), paths.checkpoint(plan.at))
        lines = [json.dumps(json.loads(paths.metrics(k).read_text()), sort_keys=True) for k in range(1, plan.at + 1)]
        atomic_write_text(paths.metrics_jsonl, "".join(line + "\n" for line in lines))
        save_config(plan.cfg, tmp / "config.yaml")
        record = {**plan.record(), "hard_links": linked,
                  "start_checkpoint": (f"the parent's checkpoint {plan.at}" if plan.parent_checkpoint is not None
                                       else "restored from the parent's checkpoints and batch shards"),
                  "parent_config": to_dict(plan.parent_cfg), "created_at": datetime.now(timezone.utc).isoformat()}
        atomic_write_text(tmp / BRANCH_FILE, json.dumps(record, indent=1) + "\n")
    if not linked:
        logger.warning("%s: the parent's files could not be hard-linked (another file system?): they were copied",
                       plan.run_dir)
    return {**record, "needs_restore": plan.parent_checkpoint is None}


def restore_parent_policy(plan: BranchPlan) -> dict[str, Any]:
    """The parent's policy K as the branch's checkpoint K: a trainer under the parent's config loads the parent's
    newest checkpoint before K (or its initial weights) and replays the updates after it from the parent's batch
    shards, exactly as a rerun restores its trainer; then saves. A no-op once the checkpoint is there."""
    from areal_pipeline.pipeline import Pipeline
    from areal_pipeline.run_dir import RunPaths

    out = RunPaths(plan.run_dir).checkpoint(plan.at)
    if has_checksums(out):
        return {"path": str(out), "cached": True}
    parent = Pipeline(plan.parent_cfg, log_dir=plan.run_dir / "logs" / "restore-parent")
    try:
        parent.services.start_trainer()
        client = parent.ensure_trainer_version(plan.at)
        client.call("save", path=str(out), extra={"iteration": plan.at, "run_id": plan.cfg.run_id,
                                                   "branched_from": plan.parent_run_id})
    finally:
        parent.close()
        parent.services.stop()
    return {"path": str(out), "cached": False}


def regenerated_rollouts(plan: BranchPlan) -> list[int]:
    """A replay's iterations whose rollout shards are no longer the parent's (a referenced shard found corrupt
    during the run is rolled out again by the run): what `replay` then reports instead of hiding."""
    from areal_pipeline.run_dir import RunPaths

    if plan.mode != "replay":
        return []
    own = RunPaths(plan.run_dir)
    changed = []
    for k in range(plan.at + 1, plan.last + 1):
        mine, theirs = own.rollout(k) / "manifest.json", plan.source_rollout(k) / "manifest.json"
        if not (mine.is_file() and theirs.is_file() and mine.read_bytes() == theirs.read_bytes()):
            changed.append(k)
    return changed
