"""The Prefect UI pages docs/recurring.md shows, taken from a real line in headless Chromium.

    python docs/recurring_screenshots.py [--port 4298] [--out docs/images]

Starts a standing Prefect server on PostgreSQL (`areal-pipeline prefect-server start`), then runs a line of
configs/recurring_cpu.yaml against it as a newcomer would: a firing on the first file of questions (promoted by
the gate), a firing under manual approval (its paused approval run's form opened in the UI, then answered with
`areal-pipeline recurring approve`), a firing with a harmful learning rate (rejected by the gate). Saves the
firing's run page, the approval form, the gate's table and the line's table. Stops the server at the end.

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
from pathlib import Path

from screenshots import CHROMIUM_ARGS, CLI, REPO, api, artifact_id

CONFIG = "configs/recurring_cpu.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=4298)
    parser.add_argument("--pg-port", type=int, default=5498)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "images")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="areal-line-shots-"))
    work.chmod(0o755)  # PostgreSQL runs as its own user when this runs as root
    server = CLI + ["prefect-server", "--dir", str(work / "server"), "--port", str(args.port),
                    "--pg-port", str(args.pg_port)]
    subprocess.run(server + ["start"], check=True, timeout=300)
    url, ui = f"http://127.0.0.1:{args.port}/api", f"http://127.0.0.1:{args.port}"
    env = {**os.environ, "PREFECT_API_URL": url}
    line = [f"output_dir={work / 'runs'}", f"dataset.path={work / 'data'}"]

    def command(*words: str, background: bool = False):
        argv = CLI + ["recurring", words[0], "--config", CONFIG, *line, *words[1:]]
        if background:
            return subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True)
        done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
        print(done.stdout[-1500:], flush=True)
        if done.returncode:
            raise SystemExit(f"recurring {' '.join(words)} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        return done

    try:
        command("demo-data")
        command("fire")
        command("demo-data")
        manual = command("fire", "recurring.approval=manual", background=True)
        request_path = work / "runs" / "lines" / "arith-line" / "firings" / "0002" / "approval-request.json"
        deadline = time.monotonic() + 900
        while not request_path.is_file():
            if manual.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the manual firing never asked for approval:\n{manual.stdout.read()[-3000:]}")
            time.sleep(1)
        approval_run = json.loads(request_path.read_text())["flow_run_id"]
        time.sleep(5)  # paused, its form saved
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1300})
            page.goto(f"{ui}/runs/flow-run/{approval_run}", wait_until="networkidle", timeout=60_000)
            page.wait_for_timeout(2000)
            page.get_by_role("button", name="Resume").first.click()
            page.wait_for_timeout(2500)
            page.screenshot(path=str(args.out / "recurring-approval.png"), full_page=True)
            browser.close()
        command("approve", "--by", "alice", "--reason", "pass@1 up on the gate, answers read fine")
        print(manual.communicate(timeout=900)[0][-1500:], flush=True)
        command("demo-data")
        command("fire", "trainer.optimizer.lr=0.05")
        time.sleep(3)  # the server's task-run recorder flushes in batches
        runs = api(url, "/flow_runs/filter", {"sort": "START_TIME_ASC", "limit": 200})
        firing = next(r for r in runs if r["name"] == "arith-line/firing-2")
        pages = {
            "recurring-firing": f"{ui}/runs/flow-run/{firing['id']}",
            "recurring-gate": f"{ui}/artifacts/artifact/{artifact_id(url, 'arith-line-firing-0003-gate')}",
            "recurring-line": f"{ui}/artifacts/artifact/{artifact_id(url, 'arith-line-line')}",
        }
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            for name, address in pages.items():
                page.goto(address, wait_until="networkidle", timeout=60_000)
                page.wait_for_timeout(2500)  # the UI draws graphs and tables after its data arrives
                page.screenshot(path=str(args.out / f"{name}.png"), full_page=True)
                print(f"{name}: {address} -> {args.out / f'{name}.png'}", flush=True)
            browser.close()
        print(command("status").stdout)
    finally:
        subprocess.run(server + ["stop"], timeout=120)
    print(json.dumps({"pages": ["recurring-approval", *sorted(pages)], "out": str(args.out)}))


if __name__ == "__main__":
    sys.exit(main())
