"""The Prefect UI pages docs/ shows, taken from a real run in headless Chromium.

    python docs/screenshots.py [--port 4299] [--iterations 20] [--out docs/images]

Starts a standing Prefect server on PostgreSQL (`areal-pipeline prefect-server start`, on a port that is not
Prefect's default, as a user's second server would be), trains the default config against it, then opens the
UI's pages in Chromium and saves each as a PNG: the flow runs, the train run (named after the run id, tagged), an iteration
run's graph, the artifacts, the curves, the table of every iteration and an iteration's card. Stops the server at the end.

Needs Chromium (`apt-get install chromium`) and Playwright's Python package (`pip install playwright`, in any
environment: this script runs the project's commands as subprocesses of `.venv`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CLI = [str(REPO / ".venv" / "bin" / "areal-pipeline")]
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def api(url: str, path: str, body: dict | None = None) -> object:
    request = urllib.request.Request(f"{url}{path}", data=json.dumps(body or {}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=30) as reply:
        return json.loads(reply.read())


def flow_runs(url: str) -> list[dict]:
    return api(url, "/flow_runs/filter", {"sort": "START_TIME_ASC", "limit": 200})


def artifact_id(url: str, key: str) -> str:
    """The newest artifact of `key` (its page shows its content; the key's page, its history)."""
    (found,) = api(url, "/artifacts/filter", {"artifacts": {"key": {"any_": [key]}}, "sort": "UPDATED_DESC",
                                              "limit": 1})
    return found["id"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=4299)
    parser.add_argument("--pg-port", type=int, default=5499)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "images")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="areal-shots-"))
    work.chmod(0o755)  # PostgreSQL runs as its own user when this runs as root
    server = CLI + ["prefect-server", "--dir", str(work / "server"), "--port", str(args.port),
                    "--pg-port", str(args.pg_port)]
    subprocess.run(server + ["start"], check=True, timeout=300)
    url = f"http://127.0.0.1:{args.port}/api"
    ui = f"http://127.0.0.1:{args.port}"
    try:
        env = {**os.environ, "PREFECT_API_URL": url}
        subprocess.run(CLI + ["train", "--config", "configs/tiny_cpu.yaml", "run_id=screenshots",
                              f"total_iterations={args.iterations}", f"output_dir={work / 'runs'}"],
                       cwd=REPO, env=env, check=True, timeout=1800)
        time.sleep(3)  # the server's task-run recorder flushes in batches
        runs = flow_runs(url)
        parent = next(r for r in runs if r["name"] == "screenshots")
        child = next(r for r in runs if r["name"].startswith("screenshots/iter-") and r["state_type"] == "COMPLETED")
        pages = {
            "flow-runs": f"{ui}/runs",
            "train-run": f"{ui}/runs/flow-run/{parent['id']}",
            "iteration-graph": f"{ui}/runs/flow-run/{child['id']}",
            "artifacts": f"{ui}/artifacts",
            "curves": f"{ui}/artifacts/artifact/{artifact_id(url, 'screenshots-reward-curve')}",
            "metrics-table": f"{ui}/artifacts/artifact/{artifact_id(url, 'screenshots-metrics')}",
            "iteration-card": f"{ui}/artifacts/artifact/{artifact_id(url, f'screenshots-iter-{args.iterations:04d}')}",
        }
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            for name, address in pages.items():
                # the UI scrolls inside its own pane: a card's samples show on a taller page
                page.set_viewport_size({"width": 1400, "height": 2400 if name == "iteration-card" else 1000})
                page.goto(address, wait_until="networkidle", timeout=60_000)
                page.wait_for_timeout(2500)  # the UI draws graphs and cards after its data arrives
                page.screenshot(path=str(args.out / f"{name}.png"), full_page=True)
                print(f"{name}: {address} -> {args.out / f'{name}.png'}", flush=True)
            browser.close()
    finally:
        subprocess.run(server + ["stop"], timeout=120)
    print(json.dumps({"pages": sorted(pages), "out": str(args.out)}))


if __name__ == "__main__":
    sys.exit(main())
