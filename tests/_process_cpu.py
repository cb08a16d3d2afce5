"""Where a test session's CPU goes, by kind of process: every process on the machine sampled every 2 s (psutil),
its CPU seconds since it was first seen kept under its command line, then summed by kind (the test workers
themselves, `areal-pipeline` commands, the forkserver's preload, forked services, Prefect servers, vLLM, ...).
The suite is CPU-bound on 2 cores, so these sums, not the tests' wall times, say what would shorten it.

    python tests/_process_cpu.py record /tmp/cpu.json &     # beside `make test`; SIGINT or SIGTERM ends it
    python tests/_process_cpu.py report /tmp/cpu.json

A process's last 2 s before it ends are not counted, nor is a process that lives less than 2 s."""

from __future__ import annotations

import collections
import json
import signal
import sys
import time

FORKSERVER = "multiprocessing.forkserver"
# (kind, what its command line holds), the first match wins; a process whose command line is the forkserver's is
# the forkserver itself or a fork of it that has not named itself (a reward worker): told apart by its parent
KINDS = [
    ("test worker (in-process runs, warm starts)", "pytest-xdist"),
    ("test worker (in-process runs, warm starts)", "exec(eval(sys.stdin.readline()))"),  # xdist's, as started
    ("package installs (environments)", "pip install"),
    ("multiprocessing resource tracker", "multiprocessing.resource_tracker"),
    ("areal-pipeline command", "-m cli"),
    ("temporary Prefect API of a command", "flows.api_server"),
    ("Prefect server (prefect server start / uvicorn)", "prefect server start"),
    ("Prefect server (prefect server start / uvicorn)", "prefect.server.api.server"),
    ("Prefect deployment run", "prefect.engine"),
    ("Prefect worker / CLI", "bin/prefect"),
    ("vLLM", "vllm"),
    ("vLLM", "VLLM"),
    ("CPU inference server", "areal_pipeline.inference.server"),
    ("trainer", "trainer_server"),
    ("trainer", "training.client"),
    ("PostgreSQL", "postgres"),
    ("MLflow", "mlflow"),
    ("benchmark script", "bench/"),
]


def record(path: str, interval_s: float = 2.0) -> None:
    import psutil

    seen: dict[tuple[int, float], dict] = {}
    first_round = True

    def dump(*_):
        with open(path, "w") as out:
            json.dump(list(seen.values()), out)
        if _:
            sys.exit(0)

    signal.signal(signal.SIGTERM, dump)
    signal.signal(signal.SIGINT, dump)
    rounds = 0
    while True:
        for proc in psutil.process_iter(["pid", "ppid", "create_time", "cmdline", "cpu_times"]):
            info = proc.info
            if info["cpu_times"] is None:
                continue
            cpu = info["cpu_times"].user + info["cpu_times"].system
            entry = seen.setdefault((info["pid"], info["create_time"]), {
                "pid": info["pid"], "ppid": info["ppid"], "cmd": " ".join(info["cmdline"] or [])[:400],
                "cpu_before": cpu if first_round else 0.0})  # what it used before the recording began
            entry["cpu"] = cpu
            if info["cmdline"]:  # the newest: a process may name itself after it starts (xdist's workers do)
                entry["cmd"] = " ".join(info["cmdline"])[:400]
        first_round = False
        rounds += 1
        if rounds % 15 == 0:
            dump()
        time.sleep(interval_s)


def kind_of(entry: dict, by_pid: dict[int, dict]) -> str:
    cmd = entry["cmd"]
    if FORKSERVER in cmd:
        return "forked service" if FORKSERVER in by_pid.get(entry["ppid"], {}).get("cmd", "") else "forkserver preload"
    for kind, marker in KINDS:
        if marker in cmd:
            return kind
    return "other python" if "python" in cmd else "other"


def report(path: str) -> None:
    entries = json.load(open(path))
    by_pid = {e["pid"]: e for e in entries}
    seconds, count = collections.Counter(), collections.Counter()
    for entry in entries:
        kind = kind_of(entry, by_pid)
        seconds[kind] += entry["cpu"] - entry["cpu_before"]
        count[kind] += 1
    total = sum(seconds.values())
    for kind, s in seconds.most_common():
        print(f"{s:8.0f} s {s / total:6.1%}  {count[kind]:5d} processes  {s / count[kind]:6.1f} s each  {kind}")
    print(f"{total:8.0f} s in all")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("record", "report"):
        raise SystemExit(__doc__)
    (record if sys.argv[1] == "record" else report)(sys.argv[2])
