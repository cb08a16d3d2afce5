"""The test session's reaper: a process of its own, started by conftest.py in pytest's main process, that waits for
that process to end and then stops every process still marked as this session's.

A test session killed from outside (SIGTERM to pytest, a CI time-out) runs no fixture teardown, and what its tests
started (servers, trainers, vLLM, Prefect servers, torchrun agents) would keep running. Every such process inherits
the session's mark, an environment variable (`SESSION_MARK`) holding the session's id, whatever process started it
and however it was detached (new sessions, process groups, network namespaces); the reaper finds them by reading
`/proc/<pid>/environ`. A session that ends normally has stopped them already, and the reaper finds none.

    python tests/_reaper.py <pytest pid> <session id>
"""

from __future__ import annotations

import os
import signal
import sys
import time

SESSION_MARK = "AREAL_PIPELINE_TEST_SESSION"
POLL_S = 0.5
GRACE_S = 10.0  # SIGTERM, then SIGKILL to what is left after this long


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is gone for this purpose
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def marked(session: str) -> list[int]:
    """The live processes whose environment carries this session's mark (this reaper aside)."""
    needle = f"{SESSION_MARK}={session}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as environ:
                if needle in environ.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return [pid for pid in found if alive(pid)]


def stop(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def reap(session: str, grace_s: float = GRACE_S) -> list[int]:
    """SIGTERM to every marked process, SIGKILL to those left after `grace_s`; the pids found first."""
    found = marked(session)
    stop(found, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and (left := marked(session)):
        stop([pid for pid in left if pid not in found], signal.SIGTERM)  # started while the others stopped
        found += [pid for pid in left if pid not in found]
        time.sleep(POLL_S)
    stop(marked(session), signal.SIGKILL)
    return found


def main(watched: int, session: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C to the terminal's group is for pytest
    while alive(watched):
        time.sleep(POLL_S)
    reap(session)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
