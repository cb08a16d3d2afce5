"""Datasets -> chat records, the unit a rollout starts from.

    records = load_records(cfg.dataset, split="train", seed=cfg.seed)

Each record is a plain dict:
    prompt_id  stable id ("gsm8k-train-00042"), the same on every call and in every process
    messages   [{"role": "system", ...} when cfg.system_prompt is set, {"role": "user", "content": ...}]
    answer     reference answer: str for math, list[str] (accepted answers) for search QA
    question   the bare question, for workflows that build their own prompt

Sources, by `cfg.name`:
    arithmetic  generated from `seed`; the train and test splits never share a question; with a path, rows
                {"question": "What is 3+4?", "answer": "7"} of a file or a directory of `<split>.jsonl`
    grid        generated grid-navigation puzzles (a start and a goal on a `grid_size` square, `grid_pits` pits
                that leave a way between them) for the grid_world workflow; the splits never share a puzzle
    gsm8k       a jsonl file, a directory of `<split>.jsonl`, or a hub id (default "openai/gsm8k")
    search_qa   a jsonl file or a directory of `<split>.jsonl`; rows {"question", "answer", "id"?};
                empty path: questions over the generated knowledge base (`data/knowledge_base.py`)

A file given directly is used whatever the split; a directory is looked up per split (`<split>.jsonl`, or
`<split>.parquet`: the same rows as a Parquet table). A row's optional "id" is its prompt id (unique in its file);
without one the prompt id is `<dataset>-<split>-<row index>`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Callable, Iterator

from areal_pipeline.config import DatasetConfig, looks_like_local_path
from areal_pipeline.errors import PermanentError


class DatasetError(PermanentError, ValueError):
    pass


GSM8K_HUB_ID = "openai/gsm8k"
GSM8K_INSTRUCTION = 'Solve the problem step by step, then give the final answer as "The answer is <number>."'
ARITHMETIC_OPERATORS: dict[str, Callable[[int, int], int]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
}
# With few distinct questions (small operands) the test split keeps this share of them.
_ARITHMETIC_MIN_TEST_SHARE = 5


def load_records(cfg: DatasetConfig, split: str, seed: int) -> list[dict[str, Any]]:
    loader = _LOADERS.get(cfg.name)
    if loader is None:
        raise DatasetError(f"unknown dataset '{cfg.name}'; valid names: {', '.join(_LOADERS)}")
    limit = {cfg.train_split: cfg.max_train_size, cfg.test_split: cfg.max_test_size}.get(split)
    if limit is not None and limit < 0:
        raise DatasetError(f"dataset size limit for split '{split}' must be >= 0, got {limit}")
    records = loader(cfg, split, seed)
    return records if limit is None else records[:limit]


def check_local_rows(cfg: DatasetConfig, seed: int) -> None:
    """Read a local data set's splits now, so that a malformed row is named (file, line) before a run starts
    anything; generated data sets and hub ones are read when the run prepares them."""
    if cfg.path and Path(cfg.path).expanduser().exists():
        for split in (cfg.train_split, cfg.test_split):
            load_records(cfg, split, seed)


def _record(cfg: DatasetConfig, prompt_id: str, question: str, prompt: str, answer: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    messages.append({"role": "user", "content": prompt})
    return {"prompt_id": prompt_id, "messages": messages, "answer": answer, "question": question}


# ---------------------------------------------------------------------------------------------- arithmetic


ARITHMETIC_INSTRUCTION = "Answer with the number."


def _arithmetic(cfg: DatasetConfig, split: str, seed: int) -> list[dict[str, Any]]:
    if cfg.path:
        return _arithmetic_rows(cfg, split)
    if split not in (cfg.train_split, cfg.test_split):
        raise DatasetError(f"arithmetic has splits '{cfg.train_split}' and '{cfg.test_split}', not '{split}'")
    bad = [op for op in cfg.arithmetic_operators if op not in ARITHMETIC_OPERATORS]
    if bad or not cfg.arithmetic_operators:
        raise DatasetError(
            f"arithmetic_operators must be a non-empty subset of {list(ARITHMETIC_OPERATORS)}, "
            f"got {cfg.arithmetic_operators}"
        )
    if cfg.arithmetic_max_operand < 0:
        raise DatasetError(f"arithmetic_max_operand must be >= 0, got {cfg.arithmetic_max_operand}")

    train, test = _arithmetic_splits(cfg, random.Random(seed))
    is_train = split == cfg.train_split
    records = []
    for i, (a, op, b) in enumerate(train if is_train else test):
        question = f"What is {a}{op}{b}?"
        answer = str(ARITHMETIC_OPERATORS[op](a, b))
        records.append(
            _record(cfg, f"arithmetic-{split}-{i:05d}", question, f"{question} {ARITHMETIC_INSTRUCTION}", answer)
        )
    return records


def _arithmetic_rows(cfg: DatasetConfig, split: str) -> list[dict[str, Any]]:
    """Arithmetic questions read from rows (a recurring line's files, docs/recurring.md): the question as the
    generator words it, the answer a number or its text."""
    records, ids = [], PromptIds()
    for i, (where, row) in enumerate(read_rows(data_file(cfg.path, split, "arithmetic"))):
        question = _text_field(row, "question", where)
        answer = row.get("answer")
        if isinstance(answer, int) and not isinstance(answer, bool):
            answer = str(answer)
        answer = _text_field({**row, "answer": answer}, "answer", where)
        records.append(_record(cfg, ids.take(row, f"arithmetic-{split}-{i:05d}", where), question,
                               f"{question} {ARITHMETIC_INSTRUCTION}", answer.strip()))
    return records


def _arithmetic_splits(cfg: DatasetConfig, rng: random.Random) -> tuple[list[tuple], list[tuple]]:
    """Both splits, from one seeded draw, so separate calls agree and never share a question."""
    n = cfg.arithmetic_max_operand + 1
    ops = sorted(set(cfg.arithmetic_operators))
    n_train, n_test = cfg.arithmetic_train_size, cfg.arithmetic_test_size
    pool_size = _arithmetic_pool_size(ops, n)
    wanted = n_train + n_test
    if wanted <= pool_size // 2:
        # Large space: rejection sampling needs few redraws and never materialises the space.
        seen: dict[tuple, None] = {}
        while len(seen) < wanted:
            seen.setdefault(_arithmetic_canonical(rng.randrange(n), rng.choice(ops), rng.randrange(n)))
        questions = list(seen)
    else:
        questions = sorted({_arithmetic_canonical(a, op, b) for op in ops for a in range(n) for b in range(n)})
        rng.shuffle(questions)
    if len(questions) < wanted:
        n_test = min(n_test, max(1, len(questions) // _ARITHMETIC_MIN_TEST_SHARE))
    test, held_in = questions[:n_test], questions[n_test:]
    if n_train and not held_in:
        raise DatasetError(
            f"arithmetic: only {len(questions)} distinct question(s) with operands 0..{n - 1} and {ops}; "
            "raise arithmetic_max_operand or add operators"
        )
    # Too few distinct questions for the training size: repeat them, reshuffled each pass.
    train: list[tuple] = []
    while held_in and len(train) < n_train:
        train.extend(rng.sample(held_in, len(held_in)))
    return train[:n_train], test


def _arithmetic_canonical(a: int, op: str, b: int) -> tuple[int, str, int]:
    # Subtraction keeps the larger operand first: non-negative answers are easier for a tiny model.
    return (max(a, b), op, min(a, b)) if op == "-" else (a, op, b)


def _arithmetic_pool_size(ops: list[str], n: int) -> int:
    return sum(n * (n + 1) // 2 if op == "-" else n * n for op in ops)


# ---------------------------------------------------------------------------------------------- grid puzzles

GRID_INSTRUCTION = "Reach the goal. Reply U, D, L or R."
GRID_MIN_DISTANCE = 2  # nearer goals are reached by chance too often to teach anything


GRID_MOVES: dict[str, tuple[int, int]] = {"U": (0, 1), "D": (0, -1), "L": (-1, 0), "R": (1, 0)}


def grid_observation(dx: int, dy: int, pits_next: tuple[str, ...] = ()) -> str:
    """What the agent sees: where the goal lies from it (x grows to the right, y upwards), and the moves that would
    step into a pit next to it."""
    return f"goal {dx:+d},{dy:+d}" + (f" pit {','.join(pits_next)}" if pits_next else "")


def grid_pits_next(cell: tuple[int, int], pits) -> tuple[str, ...]:
    """The moves from `cell` into one of `pits`, in U, D, L, R order."""
    return tuple(m for m, (dx, dy) in GRID_MOVES.items() if (cell[0] + dx, cell[1] + dy) in pits)


def _grid_connected(n: int, start, goal, pits) -> bool:
    """Whether `goal` can be walked to from `start` around `pits` on the n x n square."""
    seen, frontier = {start}, [start]
    while frontier:
        x, y = frontier.pop()
        for dx, dy in GRID_MOVES.values():
            cell = (x + dx, y + dy)
            if 0 <= cell[0] < n and 0 <= cell[1] < n and cell not in pits and cell not in seen:
                seen.add(cell)
                frontier.append(cell)
    return goal in seen


def _grid_pits(rng: random.Random, n: int, start, goal, count: int) -> list[tuple[int, int]]:
    """`count` pits off the start and the goal that leave a way between them."""
    free = [(x, y) for x in range(n) for y in range(n) if (x, y) not in (start, goal)]
    for _ in range(1000):
        pits = sorted(rng.sample(free, count))
        if _grid_connected(n, start, goal, set(pits)):
            return pits
    raise DatasetError(f"grid_pits={count} leaves no way from {start} to {goal} on a {n}x{n} grid; use fewer pits")


def _grid(cfg: DatasetConfig, split: str, seed: int) -> list[dict[str, Any]]:
    if split not in (cfg.train_split, cfg.test_split):
        raise DatasetError(f"grid has splits '{cfg.train_split}' and '{cfg.test_split}', not '{split}'")
    n = cfg.grid_size
    if n < 2:
        raise DatasetError(f"grid_size must be >= 2, got {n}")
    if not 0 <= cfg.grid_pits <= n * n - 2:
        raise DatasetError(f"grid_pits must be 0..{n * n - 2} on a {n}x{n} grid, got {cfg.grid_pits}")
    cells = [(x, y) for x in range(n) for y in range(n)]
    puzzles = [(s, g) for s in cells for g in cells if abs(s[0] - g[0]) + abs(s[1] - g[1]) >= GRID_MIN_DISTANCE]
    random.Random(seed).shuffle(puzzles)
    n_test = max(1, len(puzzles) // 5)
    chosen = puzzles[:n_test] if split == cfg.test_split else puzzles[n_test:]
    records = []
    pit_rng = random.Random(f"{seed}/{split}/pits")
    for i, ((sx, sy), (gx, gy)) in enumerate(chosen):
        pits = _grid_pits(pit_rng, n, (sx, sy), (gx, gy), cfg.grid_pits) if cfg.grid_pits else []
        puzzle = f"{sx},{sy}>{gx},{gy}" + ("|" + ";".join(f"{x},{y}" for x, y in pits) if pits else "")
        prompt = f"{GRID_INSTRUCTION} {grid_observation(gx - sx, gy - sy, grid_pits_next((sx, sy), set(pits)))}"
        records.append(_record(cfg, f"grid-{split}-{i:05d}", puzzle, prompt, puzzle))
    return records


# ---------------------------------------------------------------------------------------------- jsonl sources


ROW_FILE_SUFFIXES = (".jsonl", ".parquet")


def data_file(path_str: str, split: str, dataset: str) -> Path:
    """The file of `split` at `path_str`: the file itself, or `<split>.jsonl` / `<split>.parquet` in a directory."""
    path = Path(path_str).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        for suffix in ROW_FILE_SUFFIXES:
            if (path / f"{split}{suffix}").is_file():
                return path / f"{split}{suffix}"
        found = ", ".join(sorted(p.name for p in path.iterdir() if p.suffix in ROW_FILE_SUFFIXES)) or "none"
        raise DatasetError(f"{dataset}: {path} has no {split}.jsonl (or .parquet) for split '{split}' (data files: "
                           f"{found})")
    raise DatasetError(f"{dataset}: dataset path not found: {path}")


def read_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(location, row) of a JSON lines or Parquet file, location naming the file and line (row) for messages."""
    if Path(path).suffix == ".parquet":
        return _read_parquet(Path(path))
    return _read_jsonl(Path(path))


def _read_parquet(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow's errors name no file: this one does
        raise DatasetError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None
    if not rows:
        raise DatasetError(f"{path}: no rows (the table is empty)")
    for i, row in enumerate(rows, start=1):
        yield f"{path}, row {i}", row


class PromptIds:
    """Prompt ids of one file's rows: a row's own "id" (unique within the file), else the default given."""

    def __init__(self):
        self._seen: dict[str, str] = {}

    def take(self, row: dict[str, Any], default: str, where: str) -> str:
        if row.get("id") is None:
            return default
        prompt_id = str(row["id"])
        if prompt_id in self._seen:
            raise DatasetError(f"{where}: duplicate id '{prompt_id}' (first at {self._seen[prompt_id]})")
        self._seen[prompt_id] = where
        return prompt_id


def _read_jsonl(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield (location, row) with location "file, line N" for error messages; a file without rows is an error."""
    rows = 0
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}")
            rows += 1
            yield where, row
    if not rows:
        raise DatasetError(f"{path}: no rows (the file is empty)")


def _text_field(row: dict[str, Any], key: str, where: str) -> str:
    if key not in row:
        raise DatasetError(f"{where}: missing field '{key}' (fields: {', '.join(row) or 'none'})")
    value = row[key]
    if not isinstance(value, str):
        raise DatasetError(f"{where}: field '{key}' must be a string, got {type(value).__name__}")
    if not value.strip():
        raise DatasetError(f"{where}: field '{key}' is empty")
    return value


# ---------------------------------------------------------------------------------------------- gsm8k


def _gsm8k(cfg: DatasetConfig, split: str, seed: int) -> list[dict[str, Any]]:
    path = cfg.path or GSM8K_HUB_ID
    if Path(path).expanduser().exists() or looks_like_local_path(path):
        rows: Iterator[tuple[str, dict]] = read_rows(data_file(path, split, "gsm8k"))
    else:
        rows = _hub_rows(path, split)
    records, ids = [], PromptIds()
    for i, (where, row) in enumerate(rows):
        question = _text_field(row, "question", where)
        solution = _text_field(row, "answer", where)
        # The full solution is the reference: the reward function extracts the "#### x" answer itself.
        records.append(_record(cfg, ids.take(row, f"gsm8k-{split}-{i:05d}", where), question,
                               f"{question}\n{GSM8K_INSTRUCTION}", solution))
    return records


def _hub_rows(hub_id: str, split: str) -> Iterator[tuple[str, dict[str, Any]]]:
    import datasets

    try:
        ds = datasets.load_dataset(hub_id, "main", split=split)
    except Exception as e:  # no network, unknown repo or split: keep the cause, name what was asked
        raise DatasetError(f"gsm8k: cannot load '{hub_id}' (config 'main', split '{split}') from the hub: {e}") from e
    for i, row in enumerate(ds, start=1):
        yield f"{hub_id} [{split}], row {i}", row


# ---------------------------------------------------------------------------------------------- search QA


def _search_qa(cfg: DatasetConfig, split: str, seed: int) -> list[dict[str, Any]]:
    if not cfg.path:
        return _generated_search_qa(cfg, split)
    records, ids = [], PromptIds()
    for i, (where, row) in enumerate(read_rows(data_file(cfg.path, split, "search_qa"))):
        question = _text_field(row, "question", where)
        answers = _answer_list(row, where)
        records.append(_record(cfg, ids.take(row, f"search_qa-{split}-{i:05d}", where), question, question, answers))
    return records


def _generated_search_qa(cfg: DatasetConfig, split: str) -> list[dict[str, Any]]:
    """Questions over the generated knowledge base (the corpus the retrieval server then serves)."""
    from areal_pipeline.data.knowledge_base import knowledge_base

    splits = {cfg.train_split: "train", cfg.test_split: "test"}
    if split not in splits:
        raise DatasetError(f"the generated search_qa set has splits '{cfg.train_split}' and '{cfg.test_split}', "
                           f"not '{split}'")
    rows = knowledge_base().questions[splits[split]]
    return [_record(cfg, f"search_qa-kb-{split}-{i:05d}", row["question"], row["question"], list(row["answer"]))
            for i, row in enumerate(rows)]


def _answer_list(row: dict[str, Any], where: str) -> list[str]:
    if isinstance(row.get("answer"), list):
        answers = row["answer"]
        if not answers or not all(isinstance(a, str) and a.strip() for a in answers):
            raise DatasetError(f"{where}: field 'answer' must be a non-empty list of non-empty strings")
        return answers
    return [_text_field(row, "answer", where)]


_LOADERS: dict[str, Callable[[DatasetConfig, str, int], list[dict[str, Any]]]] = {
    "arithmetic": _arithmetic,
    "gsm8k": _gsm8k,
    "search_qa": _search_qa,
    "grid": _grid,
}
