"""Which paths a request may name: those that resolve, symlinks followed, inside one of a few roots (issue #48).

The trainer's commands and the inference server's disk loads take paths from whoever holds the run's credential;
without this rule such a caller could have the trainer write a checkpoint over any file the trainer may write, or
have a server read any file it may read. The roots are the run's output_dir (its own directory and the runs beside
it, whose checkpoints branches and recurring lines load) and trainer.weights_dir where set.

Imported by the trainer and the inference server alike: standard library only.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Sequence


class OutsideRoots(ValueError):
    """`path` (as given) resolves to `resolved`, which lies under none of `roots`."""

    def __init__(self, what: str, path: str, resolved: str, roots: Sequence[Path], allow_root: bool = True):
        self.what, self.path, self.resolved, self.roots = what, path, resolved, [str(r) for r in roots]
        where = f" (it resolves to {resolved})" if resolved != path else ""
        inside = "inside" if allow_root else "below"
        allowed = (f"it must lie {inside} {', '.join(self.roots)}" if self.roots
                   else "no directory is allowed (none was configured)")
        super().__init__(f"{what} {path!r} is outside the allowed directories{where}: {allowed}")


def run_roots(output_dir: str, weights_dir: str = "", *more: str) -> list[str]:
    """The allowed roots of a run, absolute against this process's directory: output_dir, then trainer.weights_dir
    and `more` where set (empty strings are skipped)."""
    return [os.path.abspath(os.path.expanduser(d)) for d in (output_dir, weights_dir, *more) if d]


def resolve_roots(roots: Iterable[str | Path]) -> list[Path]:
    """`roots` resolved (a root that is itself a symlink, such as a /tmp that is one, counts where it points)."""
    resolved: list[Path] = []
    for root in roots:
        if not root:
            continue
        path = _resolved(Path(os.path.expanduser(str(root))))
        if path is not None and path not in resolved:
            resolved.append(path)
    return resolved


def confine(path: str | Path, roots: Sequence[Path], what: str = "path", allow_root: bool = True) -> Path:
    """`path` resolved, if it lies inside one of `roots` (already resolved: `resolve_roots`); else OutsideRoots.

    Symlinks are followed as far as the path exists, so a link inside a root that points out of it is outside; a
    path not there yet counts where its existing parents resolve. `allow_root=False`: the root itself is refused
    too (for writes: a command that replaces its target must never replace a whole root)."""
    resolved = _resolved(Path(path))
    if resolved is not None:
        for root in roots:
            if resolved.is_relative_to(root) and (allow_root or resolved != root):
                return resolved
    raise OutsideRoots(what, str(path), str(resolved) if resolved is not None else str(path), roots, allow_root)


def _resolved(path: Path) -> Path | None:
    try:
        return path.resolve()
    except (OSError, RuntimeError, ValueError):  # a symlink loop, a NUL byte: nowhere, hence inside no root
        return None
