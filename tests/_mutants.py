"""Mutation testing, small and self-contained: each mutant changes one operator or constant of a module (a
comparison flipped, + for -, `and` for `or`, a `not` dropped, True for False, a number off by one) in a copy of
the checkout, and the tests named for the module run against it; a mutant the tests do not fail "survives" and is
listed with its line. The checkout itself is never touched (a test session may be running from it).

    python tests/_mutants.py areal_pipeline/recurring/gate.py tests/test_recurring_units.py [--limit 40]

The last line is one JSON object: mutants made, killed, survived (file:line: the change)."""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SWAPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
         ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.And: ast.Or, ast.Or: ast.And,
         ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}


def sites(tree: ast.AST) -> list[tuple[ast.AST, int, str]]:
    """(node, which of a comparison's operators or -1, what the mutant does) for every place one mutation applies."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            found += [(node, i, f"compare {i}: {type(op).__name__} -> {SWAPS[type(op)].__name__}")
                      for i, op in enumerate(node.ops) if type(op) in SWAPS]
        elif isinstance(node, (ast.BinOp, ast.BoolOp)) and type(node.op) in SWAPS:
            found.append((node, -1, f"{type(node.op).__name__} -> {SWAPS[type(node.op)].__name__}"))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            found.append((node, -1, "not dropped"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, bool):
            found.append((node, -1, f"{node.value} -> {not node.value}"))
        elif isinstance(node, ast.Constant) and type(node.value) in (int, float):
            found.append((node, -1, f"{node.value!r} -> {node.value + 1!r}"))
    return found


def mutate(source: str, index: int) -> tuple[str, int, str]:
    """The source with mutation `index` applied (ast.unparse: the same program, reformatted), its line, what."""
    tree = ast.parse(source)
    node, op, what = sites(tree)[index]
    if isinstance(node, ast.Compare):
        node.ops[op] = SWAPS[type(node.ops[op])]()
    elif isinstance(node, (ast.BinOp, ast.BoolOp)):
        node.op = SWAPS[type(node.op)]()
    elif isinstance(node, ast.UnaryOp):
        return _replace(tree, node, node.operand), node.lineno, what
    elif isinstance(node.value, bool):
        node.value = not node.value
    else:
        node.value = node.value + 1
    return ast.unparse(tree), node.lineno, what


def _replace(tree: ast.AST, old: ast.AST, new: ast.AST) -> str:
    for parent in ast.walk(tree):
        for field, value in ast.iter_fields(parent):
            if value is old:
                setattr(parent, field, new)
            elif isinstance(value, list):
                for i, item in enumerate(value):
                    if item is old:
                        value[i] = new
    return ast.unparse(tree)


def copy_checkout(into: Path) -> Path:
    work = into / "checkout"
    shutil.copytree(REPO, work, ignore=shutil.ignore_patterns(".git", ".venv*", ".cache", "runs", "__pycache__",
                                                             "*.egg-info"))
    return work


def run_tests(work: Path, tests: list[str], timeout: float) -> bool:
    """True where the tests pass against the copy (the mutant survives)."""
    env = {**os.environ, "PYTHONPATH": str(work), "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PYTEST_XDIST_WORKER", None)
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                              cwd=work, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False  # a mutant that hangs the tests is caught by their deadlines
    return done.returncode == 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("module")
    p.add_argument("tests", nargs="+")
    p.add_argument("--limit", type=int, default=0, help="at most this many mutants, drawn at random (0: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args()
    source = (REPO / args.module).read_text()
    indices = list(range(len(sites(ast.parse(source)))))
    if args.limit and len(indices) > args.limit:
        indices = sorted(random.Random(args.seed).sample(indices, args.limit))
    with tempfile.TemporaryDirectory(prefix="mutants-") as tmp:
        work = copy_checkout(Path(tmp))
        target = work / args.module
        if not run_tests(work, args.tests, args.timeout):
            raise SystemExit(f"the tests fail on the unmutated copy: {' '.join(args.tests)}")
        survived, killed = [], 0
        for index in indices:
            mutated, line, what = mutate(source, index)
            target.write_text(mutated)
            if run_tests(work, args.tests, args.timeout):
                survived.append(f"{args.module}:{line}: {what}")
                print(f"survived: {survived[-1]}", flush=True)
            else:
                killed += 1
        target.write_text(source)
    print(json.dumps({"module": args.module, "tests": args.tests, "mutants": len(indices), "killed": killed,
                      "survived": survived}))


if __name__ == "__main__":
    main()
