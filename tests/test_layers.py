"""The layers of design.md: `areal_pipeline/` (the library, its command line included) imports no Prefect; only
`tasks/` and `flows/` do. Checked in a fresh interpreter, importing every module of the library."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

IMPORT_ALL = """
import importlib, pkgutil, sys
import areal_pipeline
failed = []
for module in pkgutil.walk_packages(areal_pipeline.__path__, "areal_pipeline."):
    try:
        importlib.import_module(module.name)
    except ImportError as error:  # an optional extra that is not installed (sglang)
        failed.append(f"{module.name}: {error}")
prefect = sorted(name for name in sys.modules if name == "prefect" or name.startswith("prefect."))
print("PREFECT", prefect[:5])
print("FAILED", failed)
"""


def test_the_library_and_its_cli_import_no_prefect():
    done = subprocess.run([sys.executable, "-c", IMPORT_ALL], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.startswith(("PREFECT", "FAILED")))
    assert lines["PREFECT"] == "[]", f"imported by the library: {lines['PREFECT']}"
    assert lines["FAILED"] == "[]", lines["FAILED"]
