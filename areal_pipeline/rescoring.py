"""Re-scoring a run's stored rollouts: new rewards for the same episodes, no generation.

    areal-pipeline rescore --run-id R --reward my_rewards:score [--iterations A:B] [--name N]
    areal-pipeline rescore --run-id R --group-reward judge [key=value ...  (the judge's settings)]

Each iteration's rollout shards are read (checked against their manifest), every trajectory gets a new reward from
`--reward` (a reward function `reward(completion, answer) -> float`, run in the reward pool with the run's time limit,
as the run's own rewards are) or `--group-reward` (rewards/group.py: each prompt's group scored at once, e.g. by an LLM
judge), and the result is written beside the old shards:

    <run_dir>/rescored/<name>/iter_<k>/rollout/    the same rows, columns and format; `reward` the new one, the old
                                                   one kept in each row's metadata["reward_before"]
    <run_dir>/rescored/<name>/rescore.json         the lineage: the run, the reward, the iterations, when, and per
                                                   iteration the mean reward before and after

The old shards are never touched; each iteration's new shard set is written atomically (its manifest last), and a
rerun keeps the iterations already re-scored and intact. Advantages come from rewards under the training config,
so they are recomputed by whatever trains on the new shards: `areal-pipeline branch --replay --rescored <name>`.
Per iteration the re-scoring reports how the GRPO signal changed: the share of trajectories whose group-centred
advantage changed sign.

A score is never made up: a reward function that raises, or times out, fails the iteration (naming the trajectory).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
import statistics
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator, Optional

import pyarrow as pa

from areal_pipeline.data.shards import (ShardError, content_sha256, is_complete, read_manifest, read_table,
                                        table_trajectories, verify_shards, write_table)
from areal_pipeline.data.trajectory import Trajectory
from areal_pipeline.utils import atomic_write_text, get_logger

logger = get_logger(__name__)

RESCORED_DIR = "rescored"
LINEAGE_FILE = "rescore.json"


class RescoreError(ValueError):
    pass


@dataclasses.dataclass
class RescorePlan:
    run_dir: Path
    run_id: str
    name: str
    iterations: list[int]
    reward: Optional[str]  # a reward function, "module:attr"
    group_reward: Optional[str]  # a group reward: a registered name or "module:attr"
    cfg: Any  # the run's config, with the overrides (a group reward's settings)
    overrides: list[str]

    @property
    def out_dir(self) -> Path:
        return rescored_dir(self.run_dir, self.name)

    @property
    def scorer(self) -> str:
        return self.reward or f"group:{self.group_reward}"

    def rollout(self, k: int) -> Path:
        from areal_pipeline.run_dir import RunPaths

        return RunPaths(self.run_dir).rollout(k)

    def rescored(self, k: int) -> Path:
        return rescored_rollout(self.run_dir, self.name, k)

    @contextlib.contextmanager
    def judge_served(self) -> Iterator["RescorePlan"]:
        """This plan, its judge served for the block where the judge is the run's own (judge.serve)."""
        from areal_pipeline.rewards.local_judge import judge_served

        with judge_served(self.cfg, self.out_dir / "logs", needed=self.group_reward == "judge") as cfg:
            yield self if cfg is self.cfg else dataclasses.replace(self, cfg=cfg)


def rescored_dir(run_dir: Path, name: str) -> Path:
    return Path(run_dir) / RESCORED_DIR / name


def rescored_rollout(run_dir: Path, name: str, k: int) -> Path:
    return rescored_dir(run_dir, name) / f"iter_{k}" / "rollout"


def read_lineage(run_dir: Path, name: str) -> Optional[dict[str, Any]]:
    path = rescored_dir(run_dir, name) / LINEAGE_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def default_name(reference: str) -> str:
    """A directory name from a reward reference: "my_rewards:short_answers" -> "short_answers"."""
    attr = reference.rpartition(":")[2] or reference
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", attr).strip("-.") or "rescored"


def parse_iterations(spec: Optional[str], recorded: list[int]) -> list[int]:
    """`A:B` (inclusive; either end may be left out), `K`, or None for every recorded iteration."""
    if not recorded:
        raise RescoreError("the run has recorded no rollout yet")
    if spec is None:
        return recorded
    try:
        if ":" in spec:
            first, last = spec.split(":", 1)
            a = int(first) if first.strip() else recorded[0]
            b = int(last) if last.strip() else recorded[-1]
        else:
            a = b = int(spec)
    except ValueError:
        raise RescoreError(f"--iterations {spec!r}: must be A:B, A:, :B or K (iteration numbers)") from None
    if a < 1 or b < a:
        raise RescoreError(f"--iterations {spec!r}: must be 1 <= A <= B")
    missing = [k for k in range(a, b + 1) if k not in recorded]
    if missing:
        raise RescoreError(f"--iterations {spec!r}: the run recorded no rollout of iteration(s) "
                           f"{_ranges(missing)} (it has {_ranges(recorded)})")
    return list(range(a, b + 1))


def _ranges(ks: list[int]) -> str:
    spans, start = [], None
    for i, k in enumerate(ks):
        if start is None:
            start = k
        if i + 1 == len(ks) or ks[i + 1] != k + 1:
            spans.append(f"{start}" if start == k else f"{start}..{k}")
            start = None
    return ", ".join(spans) or "none"


def recorded_iterations(run_dir: Path) -> list[int]:
    found = []
    for path in Path(run_dir).glob("iter_*/rollout"):
        try:
            k = int(path.parent.name.split("_", 1)[1])
        except ValueError:
            continue
        if is_complete(path):
            found.append(k)
    return sorted(found)


def plan_rescore(run_dir: str | Path, *, reward: Optional[str] = None, group_reward: Optional[str] = None,
                 iterations: Optional[str] = None, name: Optional[str] = None,
                 overrides: Optional[list[str]] = None) -> RescorePlan:
    """Check a re-scoring; nothing is written. Bad input raises RescoreError (or the config's ConfigError)."""
    from areal_pipeline.run_spec import load_config
    from areal_pipeline.user_code import load_attr

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RescoreError(f"no run directory {run_dir}")
    if (reward is None) == (group_reward is None):
        raise RescoreError("give one of --reward module:attr (a reward function) or --group-reward NAME (a group "
                           "reward, e.g. judge)")
    if not (run_dir / "config.yaml").is_file():
        raise RescoreError(f"{run_dir} has no config.yaml: it is not a run directory")
    cfg = load_config(run_dir / "config.yaml", list(overrides or []))
    if reward is not None:
        try:
            fn = load_attr(reward, "--reward", "function")
        except (ValueError, ImportError, AttributeError, FileNotFoundError) as error:
            raise RescoreError(f"{error}") from None
        if not callable(fn):
            raise RescoreError(f"--reward {reward!r} is not a function (reward(completion, answer) -> float)")
    else:
        from areal_pipeline.rewards.group import group_reward_builder

        try:
            group_reward_builder(group_reward)
        except ValueError as error:
            raise RescoreError(str(error).replace("rollout.group_reward", "--group-reward")) from None
    name = name or default_name(reward or group_reward)
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or name in (".", ".."):
        raise RescoreError(f"--name {name!r}: letters, digits, '_', '-' and '.' only")
    ks = parse_iterations(iterations, recorded_iterations(run_dir))
    plan = RescorePlan(run_dir, run_dir.name, name, ks, reward, group_reward, cfg, list(overrides or []))
    earlier = read_lineage(run_dir, name)
    if earlier is not None and earlier.get("scorer") != plan.scorer:
        raise RescoreError(f"{plan.out_dir} holds a re-scoring by {earlier.get('scorer')}: choose another --name")
    return plan


def _answer(trajectory: Trajectory) -> Any:
    return trajectory.metadata.get("answer")


def _check_rescorable(table: pa.Table, k: int, plan: RescorePlan) -> None:
    """Rewards a per-answer reward cannot replace: per-turn returns (multi_turn's token_returns) and per-step rewards
    (GiGPO's step_rewards) are the workflow's own, for each turn or step."""
    for column, what in (("token_returns", "per-turn returns"), ("step_rewards", "per-step rewards")):
        if table.column(column).null_count != table.num_rows:
            raise RescoreError(f"run {plan.run_id}, iteration {k}: the trajectories carry {what} ({column}, workflow "
                               f"{plan.cfg.rollout.workflow!r}), which one reward per trajectory cannot replace: "
                               "re-scoring covers workflows with one reward per trajectory")
    if plan.reward is not None:
        without = [i for i, raw in enumerate(table.column("metadata").to_pylist())
                   if "answer" not in (json.loads(raw) if raw else {})]
        if without:
            raise RescoreError(f"run {plan.run_id}, iteration {k}: {len(without)} trajectory(ies) kept no answer "
                               f"(metadata['answer'], workflow {plan.cfg.rollout.workflow!r}) for --reward "
                               "reward(completion, answer): use --group-reward, which needs none")


def _source(plan: RescorePlan, k: int) -> pa.Table:
    """Iteration k's rollout, checked against its manifest and for rewards that can be replaced."""
    try:
        table = read_table(plan.rollout(k))
    except ShardError as error:
        raise RescoreError(f"run {plan.run_id}'s rollout of iteration {k} cannot be re-scored: {error}") from None
    _check_rescorable(table, k, plan)
    return table


def check_sources(plan: RescorePlan) -> None:
    """Every planned iteration not re-scored yet can be (its shards intact, one reward per trajectory), so that a
    bad one is refused before anything is scored."""
    for k in plan.iterations:
        if not is_complete(plan.rescored(k)):
            _source(plan, k)


async def _score(plan: RescorePlan, trajectories: list[Trajectory]) -> tuple[list[float], dict[str, float]]:
    if plan.reward is not None:
        from areal_pipeline.rewards.pool import RewardPool, RewardReference

        pool = RewardPool(max_workers=plan.cfg.rollout.reward_workers, timeout=plan.cfg.rollout.reward_timeout)
        try:
            return list(await pool.ascore_many(RewardReference(plan.reward, "--reward"),
                                               [(t.text, _answer(t)) for t in trajectories])), {}
        finally:
            pool.close()
    from areal_pipeline.rewards.group import make_group_reward
    from areal_pipeline.rollout.judging import group_scores

    scorer = make_group_reward(plan.group_reward, plan.cfg)
    groups: dict[str, list[int]] = {}
    for i, t in enumerate(trajectories):
        groups.setdefault(t.group_id, []).append(i)
    records = _prompt_records(plan)
    scores = [0.0] * len(trajectories)
    try:
        for rows in groups.values():
            group = [trajectories[i] for i in rows]
            for i, score in zip(rows, await group_scores(scorer, group, records.get(group[0].prompt_id, {}))):
                scores[i] = score
        return scores, scorer.take_usage()
    finally:
        await scorer.aclose()


def _prompt_records(plan: RescorePlan) -> dict[str, dict[str, Any]]:
    """The run's train records by prompt id, so that a group reward sees each prompt as the rollout showed it (the
    same judge request: the judge's cache answers it); {} where the data set cannot be read here any more (the
    trajectories' own prompt and answer then)."""
    from areal_pipeline.data.datasets import load_records

    try:
        records = load_records(plan.cfg.dataset, plan.cfg.dataset.train_split, plan.cfg.seed)
    except Exception as error:  # a data set moved or gone: the stored trajectories still carry prompt and answer
        logger.warning("rescore: the run's data set cannot be read (%s): the group reward sees the stored prompts",
                       error)
        return {}
    return {r["prompt_id"]: r for r in records}


def sign_flips(groups: list[str], before: list[float], after: list[float]) -> float:
    """The share of trajectories whose reward relative to their group's mean (GRPO's advantage, before its
    division by the std) changed sign: a centred reward of 0 counts as its own sign."""
    def centred(rewards: list[float]) -> list[float]:
        means: dict[str, list[float]] = {}
        for g, r in zip(groups, rewards):
            means.setdefault(g, []).append(r)
        return [r - statistics.fmean(means[g]) for g, r in zip(groups, rewards)]

    def sign(x: float) -> int:
        return 0 if abs(x) < 1e-9 else (1 if x > 0 else -1)

    pairs = list(zip(centred(before), centred(after)))
    return sum(sign(a) != sign(b) for a, b in pairs) / max(1, len(pairs))


def with_rewards(table: pa.Table, rewards: list[float]) -> pa.Table:
    """The rollout table with new rewards, every other column as it was but two: each row's metadata keeps the old
    reward ("reward_before"), and `baseline_reward` (ReMax's greedy episode's reward, under the old reward: that
    episode's text is not kept, so it cannot be scored again) moves into the metadata ("baseline_reward_before")."""
    metadata = []
    for raw, old, baseline in zip(table.column("metadata").to_pylist(), table.column("reward").to_pylist(),
                                  table.column("baseline_reward").to_pylist()):
        record = {**(json.loads(raw) if raw else {}), "reward_before": old}
        if baseline is not None:
            record["baseline_reward_before"] = baseline
        metadata.append(json.dumps(record, ensure_ascii=False, sort_keys=True))
    replaced = {"reward": pa.array(rewards, pa.float32()), "metadata": pa.array(metadata, pa.string()),
                "baseline_reward": pa.nulls(table.num_rows, pa.float32())}
    for name, column in replaced.items():
        index = table.schema.get_field_index(name)
        table = table.set_column(index, table.schema.field(index), column)
    return table


def reward_correlation(before: list[float], after: list[float]) -> Optional[float]:
    """Pearson's r of the old and new rewards; None where either is constant (r is undefined)."""
    if len(before) < 2 or len(set(before)) < 2 or len(set(after)) < 2:
        return None
    return statistics.correlation(before, after)


def rescore_iteration(plan: RescorePlan, k: int) -> dict[str, Any]:
    """Iteration k's rollout re-scored into `plan.rescored(k)`; its summary. Kept as it is when already there and
    intact (a rerun)."""
    out = plan.rescored(k)
    if is_complete(out):
        try:
            verify_shards(out)
            return {**read_manifest(out)["rescore"], "cached": True}
        except ShardError as error:
            logger.warning("re-scoring iteration %d again: %s", k, error)
    source = plan.rollout(k)
    table = _source(plan, k)
    trajectories = table_trajectories(table)
    scores, usage = asyncio.run(_score(plan, trajectories))
    new_table = with_rewards(table, scores)
    scores = new_table.column("reward").to_pylist()  # as stored (float32), as the trainer will read them
    before = table.column("reward").to_pylist()
    summary = {"iteration": k, "trajectories": len(trajectories),
               "reward_mean_before": statistics.fmean(before) if before else 0.0,
               "reward_mean_after": statistics.fmean(scores) if scores else 0.0,
               "advantage_sign_flips": sign_flips([t.group_id for t in trajectories], before, scores),
               "reward_correlation": reward_correlation(before, scores),
               "baseline_rewards_dropped": table.column("baseline_reward").null_count != table.num_rows,
               "usage": usage}
    parent = read_manifest(source)
    stats = {**parent.get("stats", {}), "reward_mean": summary["reward_mean_after"],
             "reward_std": statistics.pstdev(scores) if scores else 0.0,
             "accuracy": sum(s > 0 for s in scores) / max(1, len(scores))}
    extra = {key: value for key, value in parent.items()
             if key not in ("schema_version", "run_id", "iteration", "num_rows", "shards", "created_at")}
    write_table(new_table, out, run_id=parent["run_id"], iteration=k,
                rows_per_shard=plan.cfg.rollout.shard_rows, overwrite=True,
                extra_manifest={**extra, "stats": stats, "content_sha256": content_sha256(new_table),
                                "rescore": summary,
                                "rescored_from": {"run_id": plan.run_id, "rollout": str(source.resolve()),
                                                  "content_sha256": parent.get("content_sha256"),
                                                  "scorer": plan.scorer}})
    return {**summary, "cached": False}


def write_lineage(plan: RescorePlan, summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """`rescore.json`: where the re-scored shards come from and what they hold; merged with an earlier record of
    the same re-scoring (other iterations)."""
    earlier = read_lineage(plan.run_dir, plan.name) or {}
    by_iteration = {s["iteration"]: s for s in earlier.get("iterations", [])}
    by_iteration.update({s["iteration"]: {k: v for k, v in s.items() if k != "cached"} for s in summaries})
    record = {"name": plan.name, "parent_run_id": plan.run_id, "parent_run_dir": str(plan.run_dir.resolve()),
              "scorer": plan.scorer, "reward": plan.reward, "group_reward": plan.group_reward,
              "overrides": plan.overrides, "iterations": [by_iteration[k] for k in sorted(by_iteration)],
              "created_at": earlier.get("created_at", datetime.now(timezone.utc).isoformat()),
              "updated_at": datetime.now(timezone.utc).isoformat()}
    plan.out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(plan.out_dir / LINEAGE_FILE, json.dumps(record, indent=1) + "\n")
    return record


def rescore(plan: RescorePlan) -> dict[str, Any]:
    """Every planned iteration, then the lineage record (returned)."""
    with plan.judge_served() as served:
        summaries = [rescore_iteration(served, k) for k in plan.iterations]
    return write_lineage(plan, summaries)
