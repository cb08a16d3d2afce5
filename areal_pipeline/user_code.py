"""Code of the user's own named in the config: "module:attr" (a module importable from the working directory, or on
PYTHONPATH) or "path/to/file.py:attr". One loader for every extension point that takes one: `rollout.workflow`,
`ppo.loss`, `rollout.agent.entry`.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any


def reference_form(kind: str = "attr") -> str:
    """How a reference is written, for error messages: `kind` names what the attribute is (function, class...)."""
    return f"'module:{kind}' (importable from the working directory) or 'path/to/file.py:{kind}'"


def is_reference(value: str) -> bool:
    """Whether a config value names code rather than a registered name."""
    module, _, attr = value.rpartition(":")
    return bool(module) and bool(attr)


def load_registered(name: str, registered: dict[str, str], key: str, what: str, kind: str, see: str) -> Any:
    """The object a registered `name` stands for (`registered`: name -> reference), or the user's own reference.
    Every failure is a ValueError led by what went wrong: an unknown name lists the registered ones."""
    target = registered.get(name, name)
    if not is_reference(target):
        raise ValueError(f"unknown {what} '{name}'; valid: {', '.join(registered)}, or {reference_form(kind)} "
                         f"naming a {what} {kind.lower()} of your own ({see})")
    try:
        return load_attr(target, key, kind)
    except (ImportError, AttributeError, FileNotFoundError) as error:
        raise ValueError(f"{error}; the module must be importable where the run starts (its directory, or "
                         "PYTHONPATH)") from None


def load_builder(name: str, registered: dict[str, str], key: str, what: str, see: str, returns: str) -> Any:
    """`load_registered` for a builder (ppo_cfg -> `returns`), which must be callable."""
    builder = load_registered(name, registered, key, what, "builder", see)
    if not callable(builder):
        raise ValueError(f"{key}={name!r}: {builder!r} is not callable (a builder: ppo_cfg -> {returns})")
    return builder


def load_attr(reference: str, key: str, kind: str = "attr") -> Any:
    """The object `reference` names. `key` is the config key that named it, which every error starts with.

    Raises ValueError (not a reference), FileNotFoundError (no such file), ModuleNotFoundError (the module does not
    import) or AttributeError (the module has no such attribute).
    """
    module_name, _, attr = reference.rpartition(":")
    if not module_name or not attr:
        raise ValueError(f"{key}={reference!r}: must be {reference_form(kind)}")
    if module_name.endswith(".py") or "/" in module_name or os.sep in module_name:
        module = _module_from_file(Path(module_name).expanduser().resolve(), reference, key)
    else:
        # As `python -m` and uvicorn do: a module beside the config imports however the command was started.
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            raise ModuleNotFoundError(f"{key}={reference!r}: cannot import {module_name!r} ({e}); give "
                                      f"{reference_form(kind)}") from e
    value = getattr(module, attr, None)
    if value is None:
        raise AttributeError(f"{key}={reference!r}: {module_name} has no {attr!r}")
    return value


def _module_from_file(path: Path, reference: str, key: str) -> ModuleType:
    """The module of a file, executed once per process: a second reference to the same file gets the same module
    (and so the same classes). It is registered in sys.modules, which dataclasses and type hints look it up in."""
    if not path.is_file():
        raise FileNotFoundError(f"{key}={reference!r}: no such file {path}")
    name = f"user_code_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
