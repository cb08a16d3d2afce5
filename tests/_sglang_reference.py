"""SGLang's own code, read from its released wheels, for tests that check the project against it.

SGLang itself does not import on a CPU machine beside this project (it pins other torch/transformers versions and
imports triton and a CUDA torchvision), so a test takes the few functions it needs out of the wheel's source with
`ast` and runs them with this environment's torch. The wheels are fetched once (`make sglang-wheels`, which
`make test` runs first) into .cache/sglang-wheels; SGLANG_WHEEL_DIR names another folder. A wheel that cannot be
had skips its tests locally and fails them under CI (CI=true).
"""

from __future__ import annotations

import __future__

import ast
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

# The releases the project supports: AReaL's pin and the newest checked.
VERSIONS = ("0.5.10.post1", "0.5.23")
WHEEL_DIR = Path(os.environ.get("SGLANG_WHEEL_DIR") or Path(__file__).resolve().parents[1] / ".cache" / "sglang-wheels")


def _fetch(requirement: str, pattern: str, *options: str) -> list[Path]:
    """The wheels in WHEEL_DIR matching `pattern`, after pip fetched `requirement` where there are none. pip writes
    into a folder of this process's own, moved in whole: a test worker beside it never sees half a wheel."""
    found = sorted(WHEEL_DIR.glob(pattern))
    if found:
        return found
    staging = WHEEL_DIR / f".fetch-{os.getpid()}"
    fetch = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--disable-pip-version-check",
                            *options, requirement, "-d", str(staging)], capture_output=True, text=True, timeout=600)
    for path in staging.glob("*.whl"):
        path.replace(WHEEL_DIR / path.name)
    if staging.is_dir():
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
    found = sorted(WHEEL_DIR.glob(pattern))
    if not found:
        _unavailable(f"no {requirement} wheel in {WHEEL_DIR} and pip could not fetch it (run `make sglang-wheels`): "
                     f"{fetch.stderr.strip()[-500:]}")
    return found


def wheel(version: str) -> Path:
    """The sglang `version` wheel, fetched with pip where it is not there yet."""
    return _fetch(f"sglang=={version}", f"sglang-{version}-*.whl")[-1]


def msgspec_path() -> str:
    """A folder holding msgspec (0.5.23's SamplingParams is a msgspec Struct; the project does not depend on it):
    its wheel, fetched as sglang's are, unpacked once beside it."""
    try:
        import msgspec  # noqa: F401

        return ""
    except ImportError:
        pass
    found = _fetch("msgspec", "msgspec-*.whl", "--only-binary=:all:")
    unpacked = WHEEL_DIR / found[-1].stem
    if not (unpacked / "msgspec").is_dir():
        staging = WHEEL_DIR / f".{found[-1].stem}.{os.getpid()}"
        with zipfile.ZipFile(found[-1]) as archive:
            archive.extractall(staging)
        try:
            staging.rename(unpacked)  # another worker may have unpacked it meanwhile: either copy does
        except OSError:
            import shutil

            shutil.rmtree(staging, ignore_errors=True)
    return str(unpacked)


def _unavailable(message: str) -> None:
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message)
    pytest.skip(message)


def source(version: str, module_path: str) -> str:
    """The text of `module_path` (e.g. "sglang/srt/utils/common.py") in the `version` wheel."""
    with zipfile.ZipFile(wheel(version)) as archive:
        return archive.read(module_path).decode()


def _bound_names(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return set()


def _free_names(node: ast.AST) -> set[str]:
    """Names `node` reads (a superset of those it does not bind itself: only module-level ones are followed),
    annotations left out: they are never evaluated under postponed annotations."""
    names: set[str] = set()

    def visit(n: ast.AST) -> None:
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
            names.add(n.id)
        for field, value in ast.iter_fields(n):
            if field in ("annotation", "returns"):
                continue
            for child in value if isinstance(value, list) else [value]:
                if isinstance(child, ast.AST):
                    visit(child)

    visit(node)
    return names


def _method(statements: list[ast.stmt], dotted: str) -> ast.stmt:
    class_name, name = dotted.split(".")
    for statement in statements:
        if isinstance(statement, ast.ClassDef) and statement.name == class_name:
            for node in statement.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                    return node
    raise LookupError(f"SGLang's source no longer defines {dotted}")


def definitions(code: str, names: list[str], provided: dict[str, Any]) -> dict[str, Any]:
    """Module-level `names` of `code` ("Class.method": that method, as a plain function taking `self`), executed
    with the module-level statements they need (found by name, followed transitively) in a namespace starting with
    `provided`; a name neither defined in `code` nor provided is an error naming it (a new dependency in a later
    release). Compiled with postponed annotations, so that an annotation names nothing that must exist."""
    statements = ast.parse(code).body
    by_name: dict[str, list[ast.stmt]] = {}
    for statement in statements:
        if not (isinstance(statement, ast.ImportFrom) and statement.module == "__future__"):
            for bound in _bound_names(statement):
                by_name.setdefault(bound, []).append(statement)
    methods = [_method(statements, n) for n in names if "." in n]
    unknown = [n for n in names if "." not in n and n not in by_name]
    if unknown:
        raise LookupError(f"SGLang's source no longer defines {unknown}")
    chosen: list[ast.stmt] = []
    wanted = [n for n in names if "." not in n] + [f for m in methods for f in _free_names(m)]
    seen: set[str] = set()
    while wanted:
        name = wanted.pop()
        if name in seen or name in provided or name not in by_name:
            continue
        seen.add(name)
        for statement in by_name[name]:
            if statement not in chosen:
                chosen.append(statement)
                wanted += [n for n in _free_names(statement) if n not in seen]
    chosen.sort(key=statements.index)  # in the module's order, as it runs
    namespace = dict(provided)
    module = ast.Module(body=chosen + methods, type_ignores=[])
    try:
        exec(compile(module, "<sglang reference>", "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True),
             namespace)
    except (NameError, ImportError) as e:
        raise LookupError(f"SGLang's code needs a name this test does not provide: {e}") from e
    return {name: namespace[name.split(".")[-1]] for name in names}


def import_module(version: str, name: str, extra_paths: tuple[str, ...] = ()):
    """Import SGLang's module `name` (e.g. "sglang.srt.sampling.sampling_params") straight from the `version` wheel,
    its own imports included, without running the `__init__` of `sglang` and `sglang.srt` (they import the whole
    runtime). For a process of its own (a test's subprocess): the modules stay in sys.modules under SGLang's names."""
    import importlib
    import types

    archive = str(wheel(version))
    sys.path[:0] = list(extra_paths)
    with zipfile.ZipFile(archive) as files:
        inits = {n for n in files.namelist() if n.endswith("/__init__.py")}
    parts = name.split(".")
    for depth in range(1, len(parts)):
        package = ".".join(parts[:depth])
        folder = package.replace(".", "/")
        # sglang and sglang.srt run the whole runtime; a folder without __init__ is a namespace package, which
        # zipimport does not find: both get an empty module whose path is the wheel's folder
        if package in ("sglang", "sglang.srt") or f"{folder}/__init__.py" not in inits:
            module = types.ModuleType(package)
            module.__path__ = [f"{archive}/{folder}"]  # zipimport finds the modules in the wheel
            sys.modules[package] = module
    return importlib.import_module(name)


def _check_sampling_params() -> None:
    """Subprocess entry (stdin: {"version", "tokenizer", "vocab_size", "params": [...], "extra_path"}): each dict through
    SGLang's own SamplingParams(**params), normalize(tokenizer) and verify(vocab_size); prints one JSON list, per dict
    null or the error SGLang raised."""
    import json

    job = json.load(sys.stdin)
    module = import_module(job["version"], "sglang.srt.sampling.sampling_params",
                           (job["extra_path"],) if job["extra_path"] else ())
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(job["tokenizer"])
    errors = []
    for params in job["params"]:
        try:
            sampling = module.SamplingParams(**params)
            sampling.normalize(tokenizer)
            sampling.verify(job["vocab_size"])
            errors.append(None)
        except Exception as e:  # what SGLang answers 400 with
            errors.append(f"{type(e).__name__}: {e}")
    print(json.dumps(errors))


if __name__ == "__main__":
    _check_sampling_params()
