"""Training data sets made from a run's rollout shards: rejection-sampled SFT conversations, or chosen/rejected
preference pairs, as Parquet or JSONL files that `datasets.load_dataset` opens.

    sft:        every trajectory with reward >= min_reward, as {"messages": [{"role", "content"}, ...], ...}
                (the whole episode: prompt, each model turn, the environment's turns); a conversation seen
                again later (same prompt, same answer) is kept once unless keep_duplicates.
    preference: per GRPO group (one prompt's samples in one iteration), the accepted samples (reward >=
                min_reward) best first, paired one to one with the rejected ones (reward < min_reward) worst
                first: {"prompt": [...messages before the first model turn], "chosen": [...the rest],
                "rejected": [...the rest], "score_chosen", "score_rejected", ...} (TRL's conversational
                preference format). No sample is used twice, so a group of 5 accepted and 3 rejected gives 3 pairs.

The selection runs as DuckDB queries over the shards' Arrow tables (each shard checked against its manifest as
it is read, so a corrupt shard is named, never exported), and the file is written under a temporary name and
renamed: an interrupted export never leaves a partial file under the requested name.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pyarrow as pa

from areal_pipeline.data.shards import has_manifest, read_table
from areal_pipeline.utils import atomic_path

FORMATS = ("sft", "preference")
FILE_TYPES = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}

# Shard columns the queries use (the token columns stay unread).
_COLUMNS = ["run_id", "iteration", "prompt_id", "group_id", "sample_idx", "reward", "num_turns", "stop_reason",
            "messages"]
_MESSAGES = "from_json(messages, '[{\"role\": \"VARCHAR\", \"content\": \"VARCHAR\"}]')"

_SFT = f"""
with accepted as (
    select run_id, iteration, prompt_id, sample_idx, reward, num_turns, stop_reason, {_MESSAGES} as messages
    from trajectories
    where reward >= $min_reward
)
select messages, run_id, iteration, prompt_id, sample_idx, reward, num_turns, stop_reason
from accepted
{{dedupe}}
order by iteration, prompt_id, sample_idx
"""

_PREFERENCE = f"""
with parsed as (
    select *, list_position(list_transform(conversation, lambda m: m.role), 'assistant') as first_answer
    from (select run_id, iteration, group_id, prompt_id, sample_idx, reward, {_MESSAGES} as conversation
          from trajectories)
),
split as (
    select run_id, iteration, group_id, prompt_id, sample_idx, reward,
           conversation[1:first_answer - 1] as prompt, conversation[first_answer:] as completion
    from parsed
    where first_answer > 0  -- an episode without a model turn has nothing to prefer
),
chosen as (
    select *, row_number() over (partition by iteration, group_id order by reward desc, sample_idx) as rank
    from split where reward >= $min_reward
),
rejected as (
    select *, row_number() over (partition by iteration, group_id order by reward asc, sample_idx) as rank
    from split where reward < $min_reward
)
select c.prompt, c.completion as chosen, r.completion as rejected, c.reward as score_chosen,
       r.reward as score_rejected, c.run_id, c.iteration, c.prompt_id, c.sample_idx as chosen_sample,
       r.sample_idx as rejected_sample
from chosen c join rejected r
  on c.iteration = r.iteration and c.group_id = r.group_id and c.rank = r.rank and c.prompt = r.prompt
where c.completion != r.completion
order by c.iteration, c.prompt_id, c.rank
"""


class ExportError(ValueError):
    pass


@dataclass(frozen=True)
class ExportResult:
    path: Path
    format: str
    rows: int
    trajectories: int
    iterations: tuple[int, int]
    skipped_unfinished: list[int]

    def describe(self) -> str:
        what = "conversations" if self.format == "sft" else "preference pairs"
        first, last = self.iterations
        text = (f"wrote {self.rows} {what} to {self.path} (from {self.trajectories} trajectories of iterations "
                f"{first}..{last})")
        if self.skipped_unfinished:
            text += f"; iterations without finished rollout shards were left out: {self.skipped_unfinished}"
        return text


def rollout_iterations(run_dir: Path) -> dict[int, Path]:
    """Every iteration directory of the run that has a rollout directory, by iteration (finished or not)."""
    found = {}
    for path in Path(run_dir).glob("iter_*/rollout"):
        suffix = path.parent.name.removeprefix("iter_")
        if suffix.isdigit():
            found[int(suffix)] = path
    return dict(sorted(found.items()))


def load_trajectories(run_dir: Path, first: Optional[int] = None,
                      last: Optional[int] = None) -> tuple[pa.Table, tuple[int, int], list[int]]:
    """The run's rollout shards of iterations first..last as one Arrow table (the columns the exports use), the
    iterations read, and those left out because their rollout has not finished (no manifest: a live run's
    current iteration). A corrupt shard raises CorruptShardError naming it."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ExportError(f"no run directory {run_dir}")
    if first is not None and last is not None and first > last:
        raise ExportError(f"first iteration {first} is after last iteration {last}")
    selected = {k: path for k, path in rollout_iterations(run_dir).items()
                if (first is None or k >= first) and (last is None or k <= last)}
    finished = {k: path for k, path in selected.items() if has_manifest(path)}
    if not finished:
        span = f" in iterations {first or 1}..{last if last is not None else 'end'}" if (first or last) else ""
        raise ExportError(f"{run_dir} has no finished rollout shards{span} (iter_<k>/rollout/manifest.json)")
    table = pa.concat_tables(read_table(path).select(_COLUMNS) for path in finished.values())
    unfinished = sorted(set(selected) - set(finished))
    return table, (min(finished), max(finished)), unfinished


def output_type(out: Path) -> str:
    file_type = FILE_TYPES.get(Path(out).suffix.lower())
    if file_type is None:
        raise ExportError(f"{out}: the file name must end in {', '.join(FILE_TYPES)} (Parquet or JSON lines)")
    return file_type


def export_dataset(run_dir: str | Path, out: str | Path, format: str = "sft", min_reward: float = 1.0,
                   first: Optional[int] = None, last: Optional[int] = None,
                   keep_duplicates: bool = False) -> ExportResult:
    """Write run `run_dir`'s trajectories as an SFT or preference data set to `out` (.parquet, .jsonl or .json:
    JSON lines), replacing it atomically; see the module's docstring for what each format selects."""
    import duckdb

    if format not in FORMATS:
        raise ExportError(f"unknown format {format!r}: choose one of {', '.join(FORMATS)}")
    if not isinstance(min_reward, (int, float)) or not math.isfinite(min_reward):
        raise ExportError(f"min_reward must be a finite number, got {min_reward!r}")
    out = Path(out)
    file_type = output_type(out)
    if out.is_dir():
        raise ExportError(f"{out} is a directory; give a file name")
    trajectories, iterations, unfinished = load_trajectories(Path(run_dir), first, last)

    con = duckdb.connect()
    try:
        con.register("trajectories", trajectories)
        if format == "sft":
            keep_first = ("qualify row_number() over (partition by messages "
                          "order by iteration, prompt_id, sample_idx) = 1")
            query = _SFT.replace("{dedupe}", "" if keep_duplicates else keep_first)
        else:
            query = _PREFERENCE
        params = {"min_reward": float(min_reward)}
        with atomic_path(out) as tmp:
            # COPY's own option syntax takes no parameters: the path is quoted by hand (single quotes doubled)
            target = "'" + str(tmp).replace("'", "''") + "'"
            options = "format parquet" if file_type == "parquet" else "format json"
            rows = con.execute(f"copy ({query}) to {target} ({options})", params).fetchone()[0]
            if rows == 0:  # raised inside the block: the empty file is removed, nothing is renamed into place
                best = con.execute("select max(reward) from trajectories").fetchone()[0]
                need = (f"reward >= {min_reward:g}" if format == "sft"
                        else f"a sample with reward >= {min_reward:g} and one below it in the same group")
                raise ExportError(f"nothing to export: no trajectory of iterations {iterations[0]}..{iterations[1]} "
                                  f"has {need} ({trajectories.num_rows} trajectories, best reward {best:g})")
    finally:
        con.close()
    return ExportResult(path=out, format=format, rows=rows, trajectories=trajectories.num_rows,
                        iterations=iterations, skipped_unfinished=unfinished)


def parse_iteration_range(text: Optional[str]) -> tuple[Optional[int], Optional[int]]:
    """'5' -> (5, 5); '5:20' -> (5, 20); ':20', '5:' open-ended; None -> every iteration."""
    if text is None:
        return None, None
    match = re.fullmatch(r"\s*(\d*)\s*(:?)\s*(\d*)\s*", text)
    if not match or not (match.group(1) or match.group(3)):
        raise ExportError(f"iterations {text!r}: expected K, A:B, A: or :B (iteration numbers >= 1)")
    first = int(match.group(1)) if match.group(1) else None
    last = int(match.group(3)) if match.group(3) else (first if not match.group(2) else None)
    if (first is not None and first < 1) or (last is not None and last < 1):
        raise ExportError(f"iterations {text!r}: iteration numbers start at 1")
    return first, last

