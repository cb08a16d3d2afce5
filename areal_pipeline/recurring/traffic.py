"""A firing's share of the line's recorded traffic (docs/online.md): collected once into the firing's directory,
then placed as the candidate run's rollouts of the iterations after its rows'.

    firings/<n>/traffic/iter_<k>/   the episodes of candidate iteration k (rollout shards, checksummed)
    firings/<n>/traffic.json        every sample the firing takes for good, with why (trained, expired, stale, gate)

A sample is taken by one firing only: the ledger lists the firings whose traffic.json counts (`traffic_taken`,
added as the firing ends, promoted or rejected, like its data files); a firing that failed and is resumed keeps
its collected window (data.json), so nothing is taken twice or lost between two attempts.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from areal_pipeline.data.shards import shards_intact, verify_shards
from areal_pipeline.online.traffic_batch import take_traffic
from areal_pipeline.online.traffic_log import read_records, remove_older_than
from areal_pipeline.run_dir import RunPaths, read_json, write_json
from areal_pipeline.utils import atomic_directory, get_logger

logger = get_logger(__name__)


def traffic_dir(line_dir: Path) -> Path:
    """Where the line's servers record what they serve (`--record-dir`)."""
    return Path(line_dir) / "traffic"


def taken_before(line, ledger) -> set[str]:
    """The samples earlier firings took, of `line` (a recurring.line.Line, passed in: line.py imports this module)
    by its `ledger`."""
    taken: set[str] = set()
    for firing_id in ledger.data.get("traffic_taken", []):
        record = read_json(line.firing_dir(firing_id) / "traffic.json") or {}
        taken.update(record.get("taken", {}))
    return taken


def collect_traffic(line, ledger, firing: dict[str, Any], gate_questions: set[str], *,
                    first: int, row_iterations: int) -> dict[str, Any]:
    """The firing's traffic episodes written as iterations first, first + 1, ... of its candidate; what
    data.json records of them."""
    cfg, r = line.cfg, line.cfg.recurring
    directory = traffic_dir(line.dir)
    if r.serve.retention_days:
        for path in remove_older_than(directory, r.serve.retention_days):
            logger.info("line %s: %s removed (older than recurring.serve.retention_days=%s)", line.name, path,
                        r.serve.retention_days)
    samples, problems = read_records(directory, "requests")
    feedback, feedback_problems = read_records(directory, "feedback")
    for problem in (*problems, *feedback_problems):
        logger.warning("line %s: recorded traffic left out: %s", line.name, problem)
    per_iteration = cfg.rollout.batch_size * cfg.rollout.gconfig.n_samples
    max_episodes = None
    if 0 < r.traffic_fraction < 1 and row_iterations:
        max_episodes = int(r.traffic_fraction / (1 - r.traffic_fraction) * row_iterations * per_iteration)
    _, champion_version = line.champion_model(ledger)
    taken = taken_before(line, ledger)
    scored = None
    if r.traffic_reward:
        from areal_pipeline.online.traffic_batch import score_samples
        from areal_pipeline.user_code import load_attr

        scored = score_samples(samples, load_attr(r.traffic_reward, "recurring.traffic_reward", "function"), taken)
    window = take_traffic(samples, feedback, taken, now=time.time(), scored=scored,
                          champion_version=champion_version, feedback_window=r.feedback_window,
                          max_staleness=r.max_staleness, min_group=r.traffic_min_group,
                          gate_questions=gate_questions, episodes_per_iteration=per_iteration,
                          max_episodes=max_episodes, problems=[*problems, *feedback_problems])
    out = line.firing_dir(firing["id"])
    iterations = []
    for j, episodes in enumerate(window.iterations):
        k = first + j
        write_traffic_rollout(episodes, out / "traffic" / f"iter_{k}", line.candidate_run_id(firing["id"]), k,
                              cfg.rollout.shard_rows, champion_version)
        iterations.append(k)
    write_json(out / "traffic.json", {"taken": window.taken})
    if window.counts["new"]:
        logger.info("line %s, firing %d: traffic: %s", line.name, firing["id"],
                    ", ".join(f"{key} {value}" for key, value in window.counts.items() if value))
    return {"traffic": window.record(), "traffic_iterations": iterations}


def write_traffic_rollout(episodes: list, out: Path, run_id: str, k: int, rows_per_shard: int,
                          champion_version: int) -> None:
    """Recorded episodes as iteration k's rollout shards, with the manifest a rollout writes (its stats, no
    failures, the content digest) and `source: traffic`."""
    from areal_pipeline.data.shards import content_sha256, trajectory_table, with_stored_rewards, write_table
    from areal_pipeline.rollout.executor import rollout_stats

    table = trajectory_table(episodes, run_id, k)
    write_table(table, out, run_id=run_id, iteration=k, rows_per_shard=rows_per_shard, overwrite=True,
                extra_manifest={"stats": rollout_stats(with_stored_rewards(episodes, table), 0.0, []), "failures": [],
                                "content_sha256": content_sha256(table), "source": "traffic",
                                "policy_version": champion_version})


def place_traffic(firing_dir: Path, data: dict[str, Any], cfg) -> None:
    """Iteration k's traffic episodes as the candidate's rollout of k: a copy of the firing's (verified first), not
    hard links, so that damage to the run's copy leaves the firing's intact (the rollout step refuses a damaged one,
    rollout_steps.py, and the firing run again places it anew); a placed one kept while its shards verify."""
    paths = RunPaths(Path(cfg.run_dir))
    for k in data.get("traffic_iterations", []):
        source, target = firing_dir / "traffic" / f"iter_{k}", paths.rollout(k)
        verify_shards(source)
        if shards_intact(target):
            continue
        # the mark the rollout step reads, beside the shards (a damaged manifest cannot hide it)
        write_json(paths.traffic_mark(k), {"source": str(source.resolve())})
        with atomic_directory(target) as tmp:
            shutil.copytree(source, tmp, ignore=shutil.ignore_patterns(".*"), dirs_exist_ok=True)
        verify_shards(target)


NOT_PLAYED = "(recorded traffic: rewarded by feedback, never played again)"


def traffic_rows() -> list[dict[str, Any]]:
    """The train split of a candidate of traffic alone: its run loads one, but plays none of it (a damaged traffic
    rollout is refused, never played again: rollout_steps.py)."""
    return [{"id": "traffic", "question": "(recorded traffic)", "answer": NOT_PLAYED}]
