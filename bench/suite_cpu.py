"""Where a command's CPU goes, by kind of process: the test suite's profile beyond pytest's --durations (issue 49).

    sudo .venv/bin/python bench/suite_cpu.py [--out DIR] -- .venv/bin/python -m pytest -n 2 --dist loadfile -q

pytest's durations say how long each test took, not what used the cores while it ran: on a 2-core machine that is
busy all through the suite, the test phase is as long as its CPU work, spread over many processes (servers,
trainer ranks, Prefect engines and API servers, CLI commands). This runs the command under the kernel's process
accounting (`accton`, Debian's `acct` package; root), which writes each process's CPU time when it exits, and
reads every process's command line from /proc while the command runs (a process seen at least once, in its
last form: a forked child that execs is counted as what it became). Each exited process is then counted under a
kind by its command line (`KINDS`); one never seen (shorter-lived than the sampling interval, or started before
the command) under its kernel name. The last line is one JSON object: wall and CPU seconds, and CPU by kind.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

SAMPLE_S = 0.25
TICKS_PER_S = 100  # AHZ: the unit of acct_v3's comp_t times on Linux
# the first pattern that matches a command line names its kind; None: the CLI's own subcommand
KINDS: list[tuple[str, str | None]] = [
    (r"pytest-xdist|-m pytest|xdist", "pytest worker"),
    (r"multiprocessing\.forkserver", "forkserver and the services it forked"),
    (r"resource_tracker", "multiprocessing resource tracker"),
    (r"vllm|VLLM", "vLLM"),
    (r"spawn_main", "multiprocessing spawn child"),
    (r"areal_pipeline\.inference\.server", "CPU inference server"),
    (r"areal_pipeline\.training\.trainer_server", "trainer rank"),
    (r"torchrun|torch\.distributed\.run", "torchrun agent"),
    (r"flows\.api_server", "temporary Prefect API server"),
    (r"prefect server start|prefect\.server\.api\.server|uvicorn.*prefect", "Prefect server (standing)"),
    (r"prefect worker", "Prefect worker"),
    (r"prefect\.engine", "Prefect engine (a deployment's flow run)"),
    (r"bin/prefect ", "Prefect CLI"),
    (r"mlflow", "MLflow"),
    (r"postgres", "PostgreSQL"),
    (r"retrieval", "retrieval server"),
    (r"-m cli (\w[\w-]*)|areal-pipeline (\w[\w-]*)", None),
    (r"bench/", "bench script"),
    (r"\bg\+\+|\bcc1plus|\bld\b", "C++ compiler (torch.compile)"),
]
# struct acct_v3 (linux/acct.h): flag, version, tty, exitcode, uid, gid, pid, ppid, btime, etime (float),
# utime, stime, mem, io, rw, minflt, majflt, swaps (comp_t), comm[16]
ACCT_V3 = struct.Struct("<BBHIIIIIIf8H16s")


def comp_t(value: int) -> int:
    """A comp_t (13-bit mantissa, 3-bit base-8 exponent) as an integer."""
    return (value & 0x1FFF) << (3 * (value >> 13))


def read_accounting(path: Path) -> list[dict]:
    data = path.read_bytes()
    records = []
    for offset in range(0, len(data) - ACCT_V3.size + 1, ACCT_V3.size):
        fields = ACCT_V3.unpack_from(data, offset)
        if fields[1] != 3:
            raise ValueError(f"{path}: record {offset // ACCT_V3.size} is acct version {fields[1]}, not 3")
        records.append({"pid": fields[6], "ppid": fields[7], "start": fields[8],
                        "cpu": (comp_t(fields[10]) + comp_t(fields[11])) / TICKS_PER_S,
                        "comm": fields[18].split(b"\0", 1)[0].decode(errors="replace")})
    return records


class CommandLines:
    """The command lines of the machine's processes, read from /proc every SAMPLE_S: (pid, start) -> the last
    non-empty one (a zombie's is empty)."""

    def __init__(self) -> None:
        self.seen: dict[tuple[int, int], str] = {}
        self.boot = next(int(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime"))
        self.ticks = os.sysconf("SC_CLK_TCK")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cmdlines", daemon=True)

    def __enter__(self) -> "CommandLines":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            for entry in os.listdir("/proc"):
                if not entry.isdigit():
                    continue
                try:
                    with open(f"/proc/{entry}/stat", "rb") as f:
                        start_ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
                    with open(f"/proc/{entry}/cmdline", "rb") as f:
                        cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                except (OSError, IndexError, ValueError):
                    continue
                if cmd:
                    self.seen[(int(entry), self.boot + start_ticks // self.ticks)] = cmd
            self._stop.wait(SAMPLE_S)

    def of(self, pid: int, start: int) -> str | None:
        # the kernel writes the start as the exit time less the elapsed time, in whole seconds; /proc's boot time
        # is rounded too: the two can be a few seconds apart
        for delta in (0, -1, 1, -2, 2, -3, 3):
            if (pid, start + delta) in self.seen:
                return self.seen[(pid, start + delta)]
        return None


def kind_of(cmd: str) -> str:
    for pattern, kind in KINDS:
        match = re.search(pattern, cmd)
        if match:
            return kind or "areal-pipeline " + (match.group(1) or match.group(2))
    return "other: " + " ".join(Path(word).name for word in cmd.split()[:2])[:50]


def profile(records: list[dict], command_lines: CommandLines) -> dict[str, list]:
    by_kind: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for record in records:
        cmd = command_lines.of(record["pid"], record["start"])
        kind = kind_of(cmd) if cmd else f"unseen: {record['comm']}"
        by_kind[kind][0] += 1
        by_kind[kind][1] += record["cpu"]
    return by_kind


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="keep the accounting file and the command lines here")
    parser.add_argument("--top", type=int, default=40, help="kinds printed")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the command to profile")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command: pass it after --")
    if os.geteuid() != 0 or shutil.which("accton") is None:
        sys.exit("suite_cpu: process accounting needs root and `accton` (Debian: apt-get install acct)")
    work = Path(args.out or tempfile.mkdtemp(prefix="suite-cpu-"))
    work.mkdir(parents=True, exist_ok=True)
    accounting = work / "acct"
    accounting.write_bytes(b"")
    subprocess.run(["accton", str(accounting)], check=True, capture_output=True)
    started = time.monotonic()
    try:
        with CommandLines() as command_lines:
            code = subprocess.call(command)
            time.sleep(2 * SAMPLE_S)
    finally:
        subprocess.run(["accton", "off"], check=True, capture_output=True)
    wall = time.monotonic() - started
    by_kind = profile(read_accounting(accounting), command_lines)
    (work / "cmdlines.json").write_text(json.dumps([[pid, start, cmd] for (pid, start), cmd
                                                    in command_lines.seen.items()]))
    total = sum(cpu for _, cpu in by_kind.values())
    print(f"\n{wall:.0f} s wall, {total:.0f} s CPU ({total / wall:.2f} cores busy on average); exit {code}")
    ranked = sorted(by_kind.items(), key=lambda item: -item[1][1])
    for kind, (count, cpu) in ranked[:args.top]:
        print(f"{cpu:8.0f} s {100 * cpu / max(total, 1e-9):5.1f}% {count:6d} processes {cpu / count:7.2f} s each  {kind}")
    print(json.dumps({"command": command, "exit": code, "wall_s": round(wall, 1), "cpu_s": round(total, 1),
                      "by_kind": {kind: {"processes": count, "cpu_s": round(cpu, 1)} for kind, (count, cpu) in ranked}}))
    sys.exit(code)


if __name__ == "__main__":
    main()
