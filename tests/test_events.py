"""Run events and `areal-pipeline guard`, against a real `prefect server start` on loopback: a run whose reward
really collapses (learning rate 0.3 on the warm-started default model: the batch reward goes from ~0.36 to ~0 in
two iterations) is cancelled, or paused and then resumed, by the automation the guard created."""

from __future__ import annotations

import datetime
import http.server
import json
import random
import re
import subprocess
import threading
from typing import Optional

import httpx
import pytest

from _learning_helpers import base_model
from _prefect_server import client_env, stop_group, server  # noqa: F401 (server: a fixture)
from flows.events import TOP_LEVEL, above_patterns, at_least_patterns, level
from areal_pipeline.forkserver import processes_of
from test_flows import cli, wait_until

# 8 prompts x 8 samples a batch, no evaluation; the learning rate makes the policy diverge
COLLAPSE = ["rollout.batch_size=8", "eval_freq=0", "trainer.optimizer.lr=0.3"]


def test_levels_match_thresholds_as_numbers():
    """What Prefect's own matcher makes of the guard's patterns is the numeric comparison."""
    from prefect.events.schemas.events import Resource, ResourceSpecification

    def matches(value, patterns) -> bool:
        spec = ResourceSpecification({"prefect.resource.id": "r", "v": patterns})
        return spec.matches(Resource({"prefect.resource.id": "r", "v": level(value)}))

    assert level(0.3) == "0000.300000" and level(-2) == "0000.000000" and level(None) == "none"
    assert level(float("nan")) == level(float("inf")) == level(1e9) == TOP_LEVEL
    rng = random.Random(0)
    for _ in range(2000):
        threshold = rng.choice([0.0, 1e-6, 0.05, 0.3, 1.0, 12.5, 9999.0, rng.random() * rng.choice([1e-3, 1, 100])])
        value = rng.choice([None, float("nan"), -1.0, threshold, threshold + 1e-6, threshold - 1e-6,
                            rng.random() * rng.choice([1e-3, 1, 100, 1e5])])
        floor = lambda x: float(level(x)) if x is not None else None  # noqa: E731  (the 1e-6 grid)
        at_least = value is not None and floor(value) >= floor(threshold)
        above = value is not None and floor(value) > floor(threshold)
        assert matches(value, at_least_patterns(threshold)) == at_least, (threshold, value)
        assert matches(value, above_patterns(threshold)) == above, (threshold, value)
    assert len(at_least_patterns(0.3)) < 50  # a short list in the automation


@pytest.fixture(scope="module")
def warm_model(model_cache) -> str:
    """The default config's warm-started base model (right ~30% of the time), built once for the module."""
    return base_model("tiny_cpu.yaml", model_cache)


class Webhook:
    """A local HTTP endpoint that records what is POSTed to it (the notification block's target)."""

    def __init__(self):
        received = self.received = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                received.append(self.rfile.read(int(self.headers.get("Content-Length", 0))).decode())
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _events(server: str, run_id: str) -> list[dict]:
    reply = httpx.post(f"{server}/events/filter", json={
        "filter": {"resource": {"id": [f"areal.run.{run_id}"]}, "order": "ASC"}, "limit": 50})  # at most 50 a page
    reply.raise_for_status()
    return reply.json()["events"]


def _train_flow_run(server: str, run_id: str) -> Optional[dict]:
    """The train flow run of `run_id` (None until it was created)."""
    reply = httpx.post(f"{server}/flow_runs/filter", json={"flows": {"name": {"any_": ["train"]}}})
    reply.raise_for_status()
    runs = [r for r in reply.json() if r["parameters"].get("run_id") == run_id]
    assert len(runs) <= 1, runs
    return runs[0] if runs else None


def _artifact(server: str, key: str) -> dict:
    """The one artifact of key `key` (the run's table and curves are updated in place: one version a run)."""
    reply = httpx.post(f"{server}/artifacts/filter", json={"artifacts": {"key": {"any_": [key]}}})
    reply.raise_for_status()
    (artifact,) = reply.json()
    return artifact


def _paused(server: str, run_id: str) -> Optional[dict]:
    run = _train_flow_run(server, run_id)
    return run if run is not None and run["state_type"] == "PAUSED" else None


def _iterations(run_dir) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line)["iteration"] for line in path.read_text().splitlines()] if path.is_file() else []


def _guard(env: dict, *args: str) -> str:
    done = cli("guard", *args, env=env)
    out, _ = done.communicate(timeout=120)
    assert done.returncode == 0, out
    return out


def test_a_collapsing_run_is_cancelled_by_its_guard_and_notified(server, warm_model, tmp_path):
    from prefect.blocks.notifications import CustomWebhookNotificationBlock
    from prefect.settings import PREFECT_API_URL, temporary_settings

    env = client_env(server, tmp_path / "prefect-home")
    webhook = Webhook()
    try:
        with temporary_settings(updates={PREFECT_API_URL: server}):
            CustomWebhookNotificationBlock(name="areal", url=webhook.url, method="POST",
                                           json_data={"text": "{{subject}}\n{{body}}"}).save("areal-alerts")
        out = _guard(env, "--run-id", "collapse", "--reward-drop", "0.2", "--notify", "custom-webhook/areal-alerts")
        assert "automation areal-guard/collapse/reward-drop" in out and "cancel the train flow run of collapse" in out

        run = cli("train", "--config", "configs/tiny_cpu.yaml", "--run-id", "collapse", f"output_dir={tmp_path}",
                  f"model.path={warm_model}", "total_iterations=12", *COLLAPSE, env=env)
        out, _ = run.communicate(timeout=600)
        assert run.returncode == 1, out[-3000:]
        last_line = out.strip().splitlines()[-1]
        assert last_line.startswith("train failed: CancelledRun: run collapse was cancelled in Prefect (Cancelled by "
                                    "Automation"), out[-3000:]
        finished = _iterations(tmp_path / "collapse")
        assert 3 <= len(finished) < 12, finished  # stopped soon after the reward fell
        assert processes_of(run.pid, forkserver=False) == []
        assert _train_flow_run(server, "collapse")["state_type"] == "CANCELLED"
        # the cancelled run's table has every finished iteration, and its curves are there
        assert [row["iteration"] for row in json.loads(_artifact(server, "collapse-metrics")["data"])] == finished
        assert "data:image/png;base64," in _artifact(server, "collapse-reward-curve")["data"]

        # the events: started, one per finished iteration with its figures, then failed (cancelled)
        def complete_events():
            found = _events(server, "collapse")
            return found if any(e["event"] == "areal.run.failed" for e in found) else None
        found = wait_until(complete_events, 30, "the run's events in the server", interval=1)
        names = [e["event"] for e in found]
        assert names[0] == "areal.run.started" and names[-1] == "areal.run.failed"
        iterations = [e for e in found if e["event"] == "areal.iteration.completed"]
        assert [int(e["resource"]["areal.iteration"]) for e in iterations] == finished
        payload = iterations[-1]["payload"]
        for key in ("reward_mean", "eval_pass_at_1", "kl", "entropy", "staleness", "clip_fraction", "time_rollout",
                    "time_ppo_update", "reward_drop"):
            assert key in payload, key
        # each event carries its iteration's own metrics record, figure for figure
        records = {r["iteration"]: r for r in map(json.loads, (tmp_path / "collapse" / "metrics.jsonl").read_text()
                                                  .splitlines())}
        for event in iterations:
            record = records[int(event["resource"]["areal.iteration"])]
            for key in ("reward_mean", "eval_pass_at_1", "kl", "entropy", "clip_fraction", "grad_norm"):
                assert event["payload"][key] == record[key], (key, event["payload"][key], record[key])
        assert payload["reward_drop"] >= 0.2 and iterations[0]["payload"]["reward_drop"] == 0
        assert iterations[-1]["related"][0]["prefect.resource.role"] == "flow-run"
        assert found[-1]["payload"]["cancelled"] is True

        # the notification went out with the numbers
        wait_until(lambda: webhook.received, 30, "the guard's notification")
        text = json.loads(webhook.received[0])["text"]
        assert "areal-guard/collapse/reward-drop" in text and "Run collapse, iteration" in text, text
        assert "reward_mean 0." in text, text
    finally:
        webhook.close()


# Iterations of a few tenths of a second, ten to a flow run (tiny_cpu.yaml): the pause reaches the run (the
# automation, then the run's poll of its state) some seconds after the drop, so the run must last longer than that.
HELD_RUN = 24


def _unless_busy(reply):
    return None if reply.status_code == 503 else reply


def test_a_paused_run_holds_and_goes_on_when_resumed(server, warm_model, tmp_path):
    env = client_env(server, tmp_path / "prefect-home")
    _guard(env, "--run-id", "held", "--reward-drop", "0.2", "--action", "pause")
    run = cli("train", "--config", "configs/tiny_cpu.yaml", "--run-id", "held", f"output_dir={tmp_path}",
              f"model.path={warm_model}", f"total_iterations={HELD_RUN}", *COLLAPSE, env=env, start_new_session=True)
    try:
        paused = wait_until(lambda: _paused(server, "held") if run.poll() is None else pytest.fail(
            run.stdout.read()[-3000:]), 300, "the guard to pause the run", interval=0.5)
        assert "areal-guard/held/reward-drop" in paused["state"]["message"]
        # the iterations in flight finish; the next one waits, which the run says when it starts waiting
        log = tmp_path / "held" / "logs" / "train.log"
        waiting = re.compile(r"run held: iteration (\d+) waits for the flow run to be resumed")
        held = int(wait_until(lambda: waiting.search(log.read_text()) if run.poll() is None else pytest.fail(
            run.stdout.read()[-3000:]), 300, "the next iteration to wait", interval=0.5).group(1))
        assert held < HELD_RUN
        assert run.poll() is None and processes_of(run.pid, forkserver=False)  # servers and trainer kept

        # the person looks, decides to go on: removes the guard and presses Resume
        assert "removed 1 guard automation(s) of run held" in _guard(env, "--run-id", "held", "--remove")
        resumed_at = datetime.datetime.now(datetime.timezone.utc)
        # a 503 is Prefect's server too busy to take it (nothing changed): ask again, as Prefect's own client does
        reply = wait_until(lambda: _unless_busy(httpx.post(f"{server}/flow_runs/{paused['id']}/resume", json={})), 60,
                           "the server to take the resume", interval=1)
        assert reply.status_code in (200, 201) and reply.json()["status"] == "ACCEPT", reply.text
        out, _ = run.communicate(timeout=600)
    finally:
        stop_group(run)
    assert run.returncode == 0, out[-3000:]
    assert _iterations(tmp_path / "held") == list(range(1, HELD_RUN + 1))
    assert _train_flow_run(server, "held")["state_type"] == "COMPLETED"
    # the waiting iteration's first node started only once resumed (Prefect's clock: the server is on this machine)
    reply = httpx.post(f"{server}/task_runs/filter", json={"task_runs": {"name": {"any_": [f"rollout-{held}"]}},
                                                           "flow_runs": {"name": {"like_": "held/iter-"}}})
    reply.raise_for_status()
    (rollout,) = reply.json()
    assert datetime.datetime.fromisoformat(rollout["start_time"]) >= resumed_at, (rollout["start_time"], resumed_at)
    # with the default interval between its updates, the run's table has every iteration
    assert [row["iteration"] for row in json.loads(_artifact(server, "held-metrics")["data"])] == list(
        range(1, HELD_RUN + 1))
    found = wait_until(lambda: (lambda f: f if f and f[-1]["event"] == "areal.run.finished" else None)(
        _events(server, "held")), 30, "the run's finished event", interval=1)
    assert found[-1]["payload"]["iterations"] == HELD_RUN
