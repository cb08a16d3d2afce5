"""Orchestration overhead: the same RL iterations through the Prefect flows (each node a task run, artifacts) and
through a plain loop calling the same library functions; the flows once per value of `iterations_per_flow_run`.

    python bench/orchestration_overhead.py [--iterations 20] [--per-flow-run 1 10] [overrides ...]

Figures, for each flow variant:
- overhead per iteration: the time from the previous iteration's last node to this one's last node, minus the
  library work of its nodes (each node times its own work), so noise in the work itself does not count;
- `wall_vs_plain`: the whole iterations' wall time against the plain loop's: it also counts the nodes slowed down by
  the Prefect server's and client's work on the same cores;
- `cpu_ms_per_iteration`: CPU seconds of every process of the run (this process, the Prefect API server, inference
  server, trainer, reward workers) per iteration, from iteration 1's end to the last one's (start-up excluded),
  and `prefect_cpu_ms_per_iteration`, that minus the plain loop's: what Prefect costs the machine, a figure other
  processes' load does not change much (wall figures on a busy machine do);
- `api_calls_per_iteration`: HTTP requests of the Prefect client during the iterations, and the events it sent.
Prefect's API is the server at PREFECT_API_URL, else a temporary one as `areal-pipeline train` starts it.
The last line is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import psutil


class ProcessTreeCPU:
    """CPU seconds of this process and all its descendants (sampled, so a process that exits between two samples
    loses at most one period), as a time series."""

    def __init__(self, period: float = 0.2):
        self.period, self.samples, self._seen = period, [], {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _total(self) -> float:
        me = psutil.Process()
        for proc in [me, *me.children(recursive=True)]:
            try:
                times = proc.cpu_times()
                self._seen[proc.pid] = max(self._seen.get(proc.pid, 0.0), times.user + times.system)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        return sum(self._seen.values())

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), self._total()))
            self._stop.wait(self.period)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def between(self, start: float, end: float) -> float:
        """CPU seconds spent from wall time `start` to `end` (nearest samples)."""
        def at(t: float) -> float:
            return min(self.samples, key=lambda sample: abs(sample[0] - t))[1]
        return at(end) - at(start)


class APICalls:
    """Requests of Prefect's HTTP clients and events sent, counted from `start()`."""

    def __init__(self):
        import httpx
        from prefect.events.clients import PrefectEventsClient

        self.requests, self.events, self.counting = collections.Counter(), collections.Counter(), False
        calls = self
        async_send, sync_send, emit = httpx.AsyncClient.send, httpx.Client.send, PrefectEventsClient._emit

        async def counted_async_send(client, request, *args, **kwargs):
            calls._count(request)
            return await async_send(client, request, *args, **kwargs)

        def counted_sync_send(client, request, *args, **kwargs):
            calls._count(request)
            return sync_send(client, request, *args, **kwargs)

        async def counted_emit(client, event):
            if calls.counting:
                calls.events[event.event] += 1
            return await emit(client, event)

        httpx.AsyncClient.send, httpx.Client.send = counted_async_send, counted_sync_send
        PrefectEventsClient._emit = counted_emit

    def _count(self, request) -> None:
        if self.counting:
            self.requests[f"{request.method} {request.url.path.split('/api/', 1)[-1].split('/')[0]}"] += 1


def iteration_ends(run_dir: Path, iterations: int) -> tuple[float, float]:
    """Wall times at which iteration 1 and the last one finished (their metrics.json written)."""
    return ((run_dir / "iter_1" / "metrics.json").stat().st_mtime,
            (run_dir / f"iter_{iterations}" / "metrics.json").stat().st_mtime)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/tiny_cpu.yaml")
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--per-flow-run", type=int, nargs="+", default=[1, 10],
                   help="values of iterations_per_flow_run to measure")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()

    import flows  # noqa: F401  (the project's Prefect defaults, before Prefect is imported)
    from areal_pipeline.pipeline import Pipeline
    from areal_pipeline.run_dir import run_lock
    from areal_pipeline.run_spec import load_config
    from flows.api_server import prefect_api
    from flows.train import train

    work = Path(tempfile.mkdtemp(prefix="bench-orchestration-"))
    base = [f"output_dir={work}", f"total_iterations={args.iterations}", "eval_freq=0", *args.overrides]
    n = args.iterations
    calls = APICalls()

    with ProcessTreeCPU() as cpu:
        plain_cfg = load_config(args.config, base + ["run_id=plain"])
        pipeline = Pipeline(plain_cfg)
        plain_wall, plain_overhead = [], []
        with run_lock(plain_cfg.run_dir):
            try:
                pipeline.start()
                for k in range(1, n + 1):
                    started = time.perf_counter()
                    pipeline.run_iteration(k)
                    wall = time.perf_counter() - started
                    plain_wall.append(wall)
                    plain_overhead.append(wall - sum(pipeline.step_seconds[k].values()))
            finally:
                pipeline.close()
                pipeline.services.stop()
        first_end, last_end = iteration_ends(work / "plain", n)
        plain_cpu = cpu.between(first_end, last_end) / (n - 1)
        print(f"plain loop: median iteration {statistics.median(plain_wall):.3f} s, "
              f"{1000 * plain_cpu:.0f} ms CPU an iteration", flush=True)
        figures: dict = {"iterations": n, "load_before": round(os.getloadavg()[0], 2),
                         "plain_iteration_s": round(statistics.median(plain_wall), 4),
                         "plain_cpu_ms_per_iteration": round(1000 * plain_cpu, 1)}

        with prefect_api():  # as `areal-pipeline train` runs it: PREFECT_API_URL's server, else a temporary one
            for per_run in args.per_flow_run:
                run_id = f"flow-{per_run}"
                calls.requests.clear(), calls.events.clear()
                calls.counting = True
                train(config_path=args.config, overrides=base + [f"run_id={run_id}",
                                                                 f"iterations_per_flow_run={per_run}"])
                calls.counting = False
                run_dir = work / run_id
                timings = [json.loads((run_dir / f"iter_{k}" / "orchestration.json").read_text())
                           for k in range(1, n + 1)]
                flow_wall = [t["wall_seconds"] for t in timings]
                flow_overhead = [t["overhead_seconds"] for t in timings]
                first_end, last_end = iteration_ends(run_dir, n)
                flow_cpu = cpu.between(first_end, last_end) / (n - 1)
                variant = {
                    "iteration_s": round(statistics.median(flow_wall), 4),
                    "overhead_ms_per_iteration": round(1000 * statistics.median(flow_overhead), 1),
                    "overhead_ms_mean": round(1000 * statistics.mean(flow_overhead), 1),
                    "overhead_share": round(statistics.median(o / w for o, w in zip(flow_overhead, flow_wall)), 4),
                    "wall_vs_plain": round(sum(flow_wall) / sum(plain_wall), 3),
                    "cpu_ms_per_iteration": round(1000 * flow_cpu, 1),
                    "prefect_cpu_ms_per_iteration": round(1000 * (flow_cpu - plain_cpu), 1),
                    # the whole run's requests, set-up and end included, per iteration
                    "api_calls_per_iteration": round(sum(calls.requests.values()) / n, 2),
                    "events_per_iteration": round(sum(calls.events.values()) / n, 2),
                }
                print(f"flow, {per_run} iteration(s) per flow run: {json.dumps(variant)}", flush=True)
                print("  requests: " + ", ".join(f"{name} {count / n:.2f}"
                                                 for name, count in calls.requests.most_common()), flush=True)
                figures[f"per_flow_run_{per_run}"] = variant
    figures["load_after"] = round(os.getloadavg()[0], 2)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
