"""What the Prefect API behind a run costs: `train`'s temporary API, a `prefect server start` on its default SQLite
database, and one on PostgreSQL (`areal-pipeline prefect-server`, where initdb/pg_ctl/postgres are on PATH).

    python bench/prefect_backends.py [--iterations 15] [--concurrent 3] [--concurrent-iterations 8]
                                     [--backends temporary,sqlite,postgres] [--config C] [overrides ...]

For each API, as a user runs them: one `areal-pipeline train` of `--iterations` iterations, then one
`areal-pipeline sweep --max-parallel N` of N runs of `--concurrent-iterations` iterations (learning rates
1e-3, 9.5e-4, ...: the same model, so nothing is built in between). Per-iteration overhead is each iteration's
`iter_<k>/orchestration.json` (time from the previous iteration's last node to this one's, less the nodes' own
work); the concurrent figure is the sweep command's wall time, start-up included. The servers run Prefect's
default settings, as a server a user starts does; the temporary API runs the project's (flows/__init__.py), and
the backend `postgres-events-off` (not in the defaults) runs PostgreSQL with the temporary API's server settings
(event persister, automation triggers and event streaming off), which measures what those services cost. The
embedded model is built once, before anything is timed. A backend named twice (`--backends
temporary,postgres,postgres,temporary`) is measured twice, each a fresh run: ABBA order cancels the drift of a busy
machine. The last line is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from areal_pipeline.prefect_server import (LocalPrefectServer, PrefectServerError, postgres_binaries,  # noqa: E402
                                           prefect_executable)
from areal_pipeline.utils import find_free_port  # noqa: E402

AREAL = str(Path(sys.executable).parent / "areal-pipeline")
# what the project sets for the servers it starts itself (flows/__init__.py); a user's server has Prefect's defaults
PROJECT_SERVER_SETTINGS = ("PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED",
                           "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED",
                           "PREFECT_SERVER_EVENTS_STREAM_OUT_ENABLED",
                           "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE",
                           "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL")
QUIET = {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1", "PREFECT_UI_ENABLED": "false"}
# the server-side services the temporary API turns off (flows/__init__.py): what a standing server's Events page and
# automations (`areal-pipeline guard`) cost; the backend postgres-events-off measures that cost
EVENTS_OFF = {"PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED": "false", "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED": "false",
              "PREFECT_SERVER_EVENTS_STREAM_OUT_ENABLED": "false"}


def _base_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in PROJECT_SERVER_SETTINGS and k != "PREFECT_API_URL"}
    return {**env, **QUIET, "PREFECT_HOME": str(home)}


class SQLiteServer:
    """`prefect server start` on its default database, `$PREFECT_HOME/prefect.db`, in a fresh PREFECT_HOME."""

    def __init__(self, home: Path):
        self.home = home
        self.home.mkdir(parents=True)
        self.port = find_free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        self.log = home / "server.log"
        with open(self.log, "wb") as log:
            self.popen = subprocess.Popen([prefect_executable(), "server", "start", "--host", "127.0.0.1", "--port",
                                           str(self.port)], env=_base_env(home), stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 180
        while not _healthy(self.url):
            if self.popen.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"prefect server start did not come up: {self.log.read_text()[-2000:]}")
            time.sleep(0.3)

    def stop(self) -> None:
        import signal

        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGINT)
            try:
                self.popen.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()

    def locked_errors(self) -> int:
        return self.log.read_text(errors="replace").count("database is locked")


def _healthy(url: str) -> bool:
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(f"{url}/health", timeout=5) as reply:
            return reply.status == 200
    except OSError:
        return False


def _command(args: list[str], env: dict[str, str], log: Path) -> float:
    """Run `areal-pipeline ARGS`; its wall time. Its output goes to `log`."""
    started = time.perf_counter()
    with open(log, "wb") as out:
        done = subprocess.run([AREAL, *args], env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"areal-pipeline {' '.join(args[:3])} ... failed ({done.returncode}): "
                           f"{log.read_text(errors='replace')[-3000:]}")
    return wall


def _orchestration(run_dir: Path, iterations: int) -> list[dict[str, float]]:
    found = []
    for k in range(1, iterations + 1):
        path = run_dir / f"iter_{k}" / "orchestration.json"
        if path.is_file():
            found.append(json.loads(path.read_text()))
    return found


def _figures(records: list[dict[str, float]]) -> dict[str, Optional[float]]:
    if not records:
        return {"overhead_ms_mean": None, "overhead_ms_median": None, "overhead_ms_max": None, "wall_s_mean": None,
                "spikes_over_1s": None}
    overhead = [1000 * r["overhead_seconds"] for r in records]
    return {"overhead_ms_mean": round(statistics.fmean(overhead), 1),
            "overhead_ms_median": round(statistics.median(overhead), 1),
            "overhead_ms_max": round(max(overhead), 1),
            "wall_s_mean": round(statistics.fmean(r["wall_seconds"] for r in records), 3),
            "spikes_over_1s": sum(o > 1000 for o in overhead)}


def measure(name: str, api_url: Optional[str], args, work: Path, repeat: int = 0) -> dict[str, Any]:
    """One train run (and sweep) against `name`; `repeat` > 0 for a backend named again (a fresh run of its own)."""
    tag = f"{name}-{repeat}" if repeat else name
    env = _base_env(work / f"home-{tag}")
    if api_url:
        env["PREFECT_API_URL"] = api_url
    overrides = [f"output_dir={work}", *args.overrides]
    run_id = f"bench-{tag}"
    print(f"[{name}] train, {args.iterations} iterations", flush=True)
    train_wall = _command(["train", "--config", args.config, "--run-id", run_id, *overrides,
                           f"total_iterations={args.iterations}"], env,
                          work / f"{run_id}.out")
    result: dict[str, Any] = {"api": name, "train_wall_s": round(train_wall, 1),
                              **_figures(_orchestration(work / run_id, args.iterations))}
    if args.concurrent > 0:
        lrs = ",".join(f"{1e-3 * (1 - 0.05 * i):.3g}" for i in range(args.concurrent))
        print(f"[{name}] sweep: {args.concurrent} runs of {args.concurrent_iterations} iterations at once", flush=True)
        sweep_wall = _command(["sweep", "--config", args.config, "--run-id", f"{run_id}-c", "--max-parallel",
                               str(args.concurrent), *overrides, f"total_iterations={args.concurrent_iterations}",
                               f"trainer.optimizer.lr={lrs}"], env,
                              work / f"{run_id}-c.out")
        concurrent = [r for d in sorted(work.glob(f"{run_id}-c-*"))
                      for r in _orchestration(d, args.concurrent_iterations)]
        figures = _figures(concurrent)
        result.update({"concurrent_wall_s": round(sweep_wall, 1),
                       "concurrent_overhead_ms_median": figures["overhead_ms_median"],
                       "concurrent_wall_s_mean": figures["wall_s_mean"]})
    return result


def _cell(value: Any, unit: str = "") -> str:
    return "-" if value is None else f"{value:g}{unit}" if isinstance(value, (int, float)) else str(value)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/tiny_cpu.yaml")
    p.add_argument("--iterations", type=int, default=15)
    p.add_argument("--concurrent", type=int, default=3, help="runs at once in the sweep (0: no sweep)")
    p.add_argument("--concurrent-iterations", type=int, default=8)
    p.add_argument("--backends", default="temporary,sqlite,postgres")
    p.add_argument("--keep", action="store_true", help="keep the work directory (runs, server logs)")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    args.config = str((REPO / args.config) if not Path(args.config).is_absolute() else args.config)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]

    from areal_pipeline.model import resolve_model_path
    from areal_pipeline.run_spec import load_config

    # /tmp: the PostgreSQL directory must be one the postgres user can enter where this runs as root
    work = Path(tempfile.mkdtemp(prefix="bench-prefect-", dir="/tmp"))
    work.chmod(0o755)
    cfg = load_config(args.config, [f"output_dir={work}", *args.overrides])
    resolve_model_path(cfg.model, cfg.output_dir, cfg.seed)
    print(f"work directory {work}; load {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} at the start", flush=True)

    results = []
    try:
        for position, name in enumerate(backends):
            repeat = backends[:position].count(name)
            if name == "temporary":
                results.append(measure(name, None, args, work, repeat))
            elif name == "sqlite":
                server = SQLiteServer(work / "sqlite-server")
                try:
                    row = measure(name, server.url, args, work, repeat)
                finally:
                    server.stop()
                row["database_locked_errors"] = server.locked_errors()
                results.append(row)
            elif name in ("postgres", "postgres-events-off"):
                try:
                    postgres_binaries()
                except PrefectServerError as e:
                    print(f"[postgres] skipped: {e}", flush=True)
                    results.append({"api": name, "skipped": str(e)})
                    continue
                server = LocalPrefectServer(work / "pg")
                url = server.start(find_free_port(), find_free_port(),
                                   extra_env={**QUIET, **(EVENTS_OFF if name == "postgres-events-off" else {})})
                try:
                    results.append(measure(name, url, args, work, repeat))
                finally:
                    server.stop()
            else:
                raise SystemExit(f"unknown backend {name!r}: temporary, sqlite, postgres, postgres-events-off")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    labels = {"temporary": "train's temporary API", "sqlite": "prefect server start, SQLite (default settings)",
              "postgres": "prefect server start, PostgreSQL (areal-pipeline prefect-server)",
              "postgres-events-off": "the same, event persister and automation triggers off (as the temporary API)"}
    print(f"\n| Prefect API | overhead per iteration (mean / median / max) | wall per iteration | "
          f"{args.concurrent} runs of {args.concurrent_iterations} iterations at once |")
    print("|---|---|---|---|")
    for row in results:
        if "skipped" in row:
            print(f"| {labels[row['api']]} | skipped: {row['skipped'][:60]} | | |")
            continue
        locked = row.get("database_locked_errors")
        print(f"| {labels[row['api']]} | {_cell(row['overhead_ms_mean'], ' ms')} / "
              f"{_cell(row['overhead_ms_median'], ' ms')} / {_cell(row['overhead_ms_max'], ' ms')} | "
              f"{_cell(row['wall_s_mean'], ' s')} | {_cell(row.get('concurrent_wall_s'), ' s')}"
              + (f"; 'database is locked' {locked}x in the server log" if locked else "") + " |")
    print(json.dumps({"iterations": args.iterations, "concurrent": args.concurrent,
                      "concurrent_iterations": args.concurrent_iterations, "config": Path(args.config).name,
                      "load_end": round(os.getloadavg()[0], 2), "results": results}))


if __name__ == "__main__":
    main()
