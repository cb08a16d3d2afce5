"""A recurring line as a team runs it (configs/recurring_cpu.yaml, docs/recurring.md): firings on fresh files of
rows, each a candidate from the champion gated on held-out prompts, promoted to a real server the line serves
(the project's, checked weight by weight), rejected when a harmful override makes it worse, rolled back; manual
approval answered through Prefect's API, and its timeout; a firing killed with SIGKILL and resumed; two firings at
once. A real `prefect server start` (events persisted) and real servers, trainers and Prefect engines."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _learning_helpers import base_model
from areal_pipeline.recurring.incoming import DataChangedError
from areal_pipeline.recurring.publish import PublishError
from _prefect_server import client_env, server  # noqa: F401 (server: a fixture)
from conftest import http, start_cpu_server
from test_flows import REPO, cli, wait_until

CONFIG = REPO / "configs" / "recurring_cpu.yaml"
HARMFUL = "trainer.optimizer.lr=0.05"  # collapses the tiny policy onto one answer
NORM = "model.norm.weight"


@pytest.fixture(scope="module")
def base(model_cache) -> str:
    """The embedded base model of the line's config (the tiny default's warm start), built once a session."""
    return base_model("recurring_cpu.yaml", model_cache)


def line_overrides(tmp_path: Path, base: str, *extra: str) -> list[str]:
    (tmp_path / "data").mkdir(parents=True, exist_ok=True)  # where the files arrive
    return [f"output_dir={tmp_path}", f"dataset.path={tmp_path / 'data'}", f"model.path={base}", *extra]


def line_of(overrides: list[str]):
    from areal_pipeline.recurring.line import Line
    from areal_pipeline.run_spec import load_config

    return Line(load_config(CONFIG, overrides))


def new_data(overrides: list[str]) -> Path:
    from areal_pipeline.recurring.demo import write_demo_file

    line = line_of(overrides)
    return write_demo_file(line.cfg)[0]


def fire(api_url: str, overrides: list[str]) -> dict:
    """One firing in this process, against the Prefect server at `api_url`."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.recurring import recurring

    with temporary_settings(updates={PREFECT_API_URL: api_url}):
        return recurring(config_path=str(CONFIG), overrides=overrides)


def status(overrides: list[str]) -> dict:
    from areal_pipeline.recurring.status import line_status

    return line_status(line_of(overrides).read_ledger())


def served_norm(address: str) -> torch.Tensor:
    code, values = http(address, "/get_weights_by_name", {"name": NORM, "truncate_size": 10 ** 6})
    assert code == 200, values
    return torch.tensor(values)


def checkpoint_norm(model_dir: str) -> torch.Tensor:
    return load_file(str(Path(model_dir) / "model.safetensors"))[NORM]


def assert_serves(address: str, model_dir: str, version: int) -> None:
    """The server computes with `model_dir`'s weights (a tensor compared value for value) under `version`."""
    assert torch.allclose(served_norm(address), checkpoint_norm(model_dir).float(), atol=0, rtol=0)
    code, info = http(address, "/model_info")
    assert code == 200 and str(info["weight_version"]) == str(version), info


class Traffic:
    """Requests a user sends to the served policy the whole time, one after another: none may fail."""

    def __init__(self, address: str):
        self.address, self.replies, self.errors = address, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._send, daemon=True)

    def _send(self) -> None:
        body = {"text": "<|im_start|>user\nWhat is 3+4? Answer with the number.<|im_end|>\n<|im_start|>assistant\n",
                "sampling_params": {"max_new_tokens": 48, "temperature": 1.0, "ignore_eos": True}}
        while not self._stop.is_set():
            code, reply = http(self.address, "/generate", body)
            (self.replies if code == 200 and reply["meta_info"]["finish_reason"]["type"] != "abort"
             else self.errors).append(reply)

    def __enter__(self) -> "Traffic":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)


def _events(server: str, kind: str, line: str) -> list[dict]:
    import httpx

    reply = httpx.post(f"{server}/events/filter", json={
        "filter": {"event": {"name": [f"areal.line.{kind}"]}, "resource": {"id": [f"areal.line.{line}"]},
                   "order": "ASC"}, "limit": 50})
    reply.raise_for_status()
    return reply.json()["events"]


def test_a_line_promotes_rejects_and_promotes_again_serving_each_champion_then_rolls_back(server, base, tmp_path):
    """Three firings on fresh files: promoted (the base's greedy pass@1 rises), rejected (a harmful learning
    rate collapses the candidate: the gate refuses it, the served weights stay), promoted again; a firing with
    nothing new; a used file changed (refused, naming it); rollbacks to the previous champion and to the base.
    After each step the line's server serves exactly the ledger's champion, and no request sent to it meanwhile
    failed."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    production = start_cpu_server(Path(base), tmp_path)  # the line's policy in production: the base model first
    overrides = line_overrides(tmp_path, base, f"recurring.serve.addresses=[{production.address}]")
    try:
        new_data(overrides)
        with Traffic(production.address) as traffic:
            first = fire(server, overrides)
        assert first["decision"] == "promoted" and first["rows"] == 160, first
        gate = first["gate"]
        assert gate["candidate"]["mean_reward"] > gate["champion"]["mean_reward"] and gate["p_value"] <= 0.05
        champion = status(overrides)["champion"]
        assert champion["run_id"] == "arith-line-0001" and champion["iteration"] == 3
        assert_serves(production.address, champion["checkpoint"] + "/model", 3)
        assert not traffic.errors and len(traffic.replies) >= 3, traffic.errors[:2]
        assert {r["meta_info"]["weight_version"] for r in traffic.replies} >= {"0", "3"}  # served before and after

        new_data(overrides)
        harmful = fire(server, [*overrides, HARMFUL])
        assert harmful["decision"] == "rejected" and harmful["approved_by"] == "gate", harmful
        assert harmful["gate"]["candidate"]["mean_reward"] < harmful["gate"]["champion"]["mean_reward"]
        assert status(overrides)["champion"]["run_id"] == "arith-line-0001"
        assert_serves(production.address, champion["checkpoint"] + "/model", 3)  # untouched
        # the rejected candidate stays inspectable: its run and checkpoint are there
        assert (tmp_path / "arith-line-0002" / "checkpoints" / "step_6" / "model" / "config.json").is_file()

        nothing = fire(server, overrides)
        assert nothing["decision"] == "no_data" and nothing["run_id"] is None and "no new data" in nothing["reason"]

        new_data(overrides)
        third = fire(server, overrides)
        assert third["decision"] == "promoted" and third["run_id"] == "arith-line-0004", third
        assert third["gate"]["champion"]["mean_reward"] == gate["candidate"]["mean_reward"]  # against champion 1
        assert third["gate"]["candidate"]["pass_at_1"] > third["gate"]["champion"]["pass_at_1"]
        line = status(overrides)
        assert line["champion"]["run_id"] == "arith-line-0004" and line["champion"]["iteration"] == 6
        assert_serves(production.address, line["champion"]["checkpoint"] + "/model", 6)
        assert [f["decision"] for f in line["firings"]] == ["promoted", "rejected", "no_data", "promoted"]
        assert [f["rows"] for f in line["firings"]] == [160, 160, 0, 160]
        # firing 4 branched from champion 1 (iteration 3), not from the rejected candidate
        branch = json.loads((tmp_path / "arith-line-0004" / "branch.json").read_text())
        assert (branch["parent_run_id"], branch["at"]) == ("arith-line-0001", 3)

        day_1 = tmp_path / "data" / "day-0001.jsonl"
        original = day_1.read_text()
        day_1.write_text(original.replace("What is", "What's", 1))
        with pytest.raises(DataChangedError, match=r"day-0001.jsonl: changed after firing 1"):
            fire(server, overrides)
        assert status(overrides)["firings"][-1]["decision"] == "failed"
        assert status(overrides)["champion"]["run_id"] == "arith-line-0004"  # as it was
        day_1.write_text(original)
        resumed = fire(server, overrides)  # the failed firing, resumed: nothing new
        assert (resumed["firing"], resumed["decision"]) == (5, "no_data")

        from flows.recurring import recurring_rollback

        with temporary_settings(updates={PREFECT_API_URL: server}):
            back = recurring_rollback(config_path=str(CONFIG), overrides=overrides)
            assert back["decision"] == "rollback" and back["run_id"] == "arith-line-0001"
            assert_serves(production.address, champion["checkpoint"] + "/model", 3)
            to_base = recurring_rollback(config_path=str(CONFIG), overrides=overrides, to="base")
        assert to_base["run_id"] is None and status(overrides)["champion"]["run_id"] is None
        assert_serves(production.address, base, 0)
        line = status(overrides)
        assert [f["decision"] for f in line["firings"]] == [
            "promoted", "rejected", "no_data", "promoted", "no_data", "rollback", "rollback"]
        assert line["served"]["addresses"] == [production.address] and line["served"]["version"] == 0
    finally:
        production.stop()
    def events(kind: str, count: int) -> list[dict]:
        return wait_until(lambda: (lambda found: found if len(found) >= count else None)(
            _events(server, kind, "arith-line")), 60, f"{count} areal.line.{kind} event(s)")

    promoted = events("promoted", 2)
    assert [e["payload"]["run_id"] for e in promoted] == ["arith-line-0001", "arith-line-0004"]
    assert all(e["related"][0]["prefect.resource.role"] == "flow-run" for e in promoted)
    assert promoted[0]["payload"]["served"] == [production.address]
    assert [e["payload"]["run_id"] for e in events("rejected", 1)] == ["arith-line-0002"]
    assert [e["payload"]["run_id"] for e in events("rolled-back", 2)] == ["arith-line-0001", None]


def _flow_run(flow_run_id: str):
    from prefect.client.orchestration import get_client

    async def read():
        async with get_client() as client:
            return await client.read_flow_run(flow_run_id)
    return asyncio.run(read())


def test_manual_approval_is_answered_through_prefect_and_no_answer_rejects(server, base, tmp_path):
    """recurring.approval=manual: a candidate that passed the gate waits on a paused child run whose form (the
    gate's figures, both policies' answers) a person answers; answered through Prefect's API (`recurring approve`
    sends what the UI's form sends) it is promoted, with who and why in the ledger. One nobody answers within
    approval_timeout is rejected, the firing still Completed."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    overrides = line_overrides(tmp_path, base, "recurring.approval=manual", "recurring.approval_timeout=600")
    env = client_env(server, tmp_path / "home")
    line = line_of(overrides)
    with temporary_settings(updates={PREFECT_API_URL: server}):
        new_data(overrides)
        run = cli("recurring", "fire", "--config", str(CONFIG), *overrides, env=env)
        path = line.firing_dir(1) / "approval-request.json"
        wait_until(lambda: path.is_file() or run.poll() is not None, 600, "the firing to ask for approval")
        assert run.poll() is None, run.stdout.read()[-3000:]
        request = json.loads(path.read_text())
        approval_run = wait_until(lambda: (lambda r: r if r.state.is_paused() else None)(
            _flow_run(request["flow_run_id"])), 60, "the approval run to pause")
        assert approval_run.name == "arith-line/firing-1/approval"

        async def form():
            async with get_client() as client:
                keyset = approval_run.state.state_details.run_input_keyset
                description = await client.read_flow_run_input(approval_run.id, keyset["description"])
                schema = await client.read_flow_run_input(approval_run.id, keyset["schema"])
                return json.loads(description), json.loads(schema)
        description, schema = asyncio.run(form())  # what the UI's Resume button shows
        assert "promote `arith-line-0001`?" in description and "| pass@1 |" in description
        assert "| champion (reward) | candidate (reward) |" in description  # both policies' answers, side by side
        assert description.count("| What is ") == 6
        assert set(schema["properties"]) >= {"approve", "reason", "approver"}
        answer = subprocess.run([sys.executable, "-m", "cli", "recurring", "approve", "--config", str(CONFIG),
                                 *overrides, "--reason", "better sums", "--by", "alice"], cwd=REPO, env=env,
                                capture_output=True, text=True, timeout=120)
        assert answer.returncode == 0 and "approved by alice" in answer.stdout, answer.stdout + answer.stderr
        out, _ = run.communicate(timeout=600)
        assert run.returncode == 0 and "firing 1: promoted" in out and "approved by alice: better sums" in out, out
        first = status(overrides)["firings"][0]
        assert (first["decision"], first["approved_by"], first["reason"]) == ("promoted", "alice", "better sums")
        assert _flow_run(request["flow_run_id"]).state.is_completed()

        new_data(overrides)
        run = cli("recurring", "fire", "--config", str(CONFIG), *overrides, "recurring.approval_timeout=3", env=env)
        out, _ = run.communicate(timeout=600)
        assert run.returncode == 0 and "firing 2: rejected" in out and "no answer within 3 s" in out, out
        second = status(overrides)["firings"][1]
        assert (second["decision"], second["approved_by"]) == ("rejected", "timeout") and second["gate"]["passed"]
        request = json.loads((line.firing_dir(2) / "approval-request.json").read_text())
        assert _flow_run(request["flow_run_id"]).state.is_failed()  # the approval run: paused, never resumed
        assert _flow_run(second["flow_runs"][0]).state.is_completed()
        assert status(overrides)["champion"]["run_id"] == "arith-line-0001"


def test_two_firings_at_once_train_one_candidate_and_a_killed_one_resumes_to_the_same_weights(server, base,
                                                                                             tmp_path):
    """A `recurring fire` started while another firing of the line runs (held at its approval, so that the two
    overlap for certain): it waits on the line's lock, then finds nothing new; one candidate is trained, both exit
    0. Then, on the same file in another line, kill -9 of `recurring fire` while its candidate trains: that line is
    left as it was (no champion, the firing unfinished, the lock free); the same command resumes the firing (its
    flow runs: two) from the candidate's last finished node, and the candidate ends with the weights of the first
    line's, whose firing was never killed."""
    from areal_pipeline.forkserver import processes_of

    together = line_overrides(tmp_path / "together", base, "recurring.approval=manual")
    victim = line_overrides(tmp_path / "victim", base)
    day = new_data(together)
    (tmp_path / "victim" / "data" / day.name).write_bytes(day.read_bytes())
    env = client_env(server, tmp_path / "home")
    first = cli("recurring", "fire", "--config", str(CONFIG), *together, env=env)
    asked = line_of(together).firing_dir(1) / "approval-request.json"
    wait_until(lambda: asked.is_file() or first.poll() is not None, 600, "the first firing's approval request")
    second = cli("recurring", "fire", "--config", str(CONFIG), *together, env=env)
    log = line_of(together).dir / "logs" / "fire.log"
    wait_until(lambda: "waiting for its firing in progress" in log.read_text() or second.poll() is not None, 300,
               "the second firing to wait for the first")
    assert second.poll() is None, second.stdout.read()[-3000:]
    approve = subprocess.run([sys.executable, "-m", "cli", "recurring", "approve", "--config", str(CONFIG),
                              *together], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert approve.returncode == 0, approve.stdout + approve.stderr
    outs = [run.communicate(timeout=900)[0] for run in (first, second)]
    assert [first.returncode, second.returncode] == [0, 0], outs
    assert "firing 1: promoted" in outs[0] and "firing 2: no_data" in outs[1], outs
    line = status(together)
    assert [f["decision"] for f in line["firings"]] == ["promoted", "no_data"]
    assert sorted(p.name for p in (tmp_path / "together").glob("arith-line-*")) == ["arith-line-0001"]

    run = cli("recurring", "fire", "--config", str(CONFIG), *victim, env=env)
    marker = tmp_path / "victim" / "arith-line-0001" / "iter_2" / "rollout" / "manifest.json"
    wait_until(lambda: marker.is_file() or run.poll() is not None, 600, "the candidate's iteration 2 rollout",
               interval=0.05)
    assert run.poll() is None, run.stdout.read()[-3000:]
    run.kill()
    run.wait()
    wait_until(lambda: processes_of(run.pid) == [], 30, "the killed firing's services to exit")
    shown = subprocess.run([sys.executable, "-m", "cli", "recurring", "status", "--json", "--config", str(CONFIG),
                            *victim], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    killed = json.loads(shown.stdout)  # `recurring status --json`: one object
    assert killed["line"] == "arith-line" and killed["champion"]["run_id"] is None
    (unfinished,) = killed["firings"]
    assert (unfinished["decision"], unfinished["state"], unfinished["run_id"]) == ("failed", "killed",
                                                                                   "arith-line-0001")

    again = cli("recurring", "fire", "--config", str(CONFIG), *victim, env=env)
    out, _ = again.communicate(timeout=600)
    assert again.returncode == 0 and "firing 1: promoted" in out, out
    resumed = status(victim)
    (firing,) = resumed["firings"]
    assert firing["decision"] == "promoted" and len(firing["flow_runs"]) == 2
    records = (tmp_path / "victim" / "arith-line-0001" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(row)["iteration"] for row in records] == [1, 2, 3]
    ours = load_file(str(Path(resumed["champion"]["checkpoint"]) / "model" / "model.safetensors"))
    theirs = load_file(str(Path(line["champion"]["checkpoint"]) / "model" / "model.safetensors"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_serve_recurring_fires_the_line_from_its_deployment_one_at_a_time_and_leaves_no_schedule(server, base,
                                                                                                  tmp_path):
    """`serve --recurring`: the line's deployment with its schedule and a concurrency limit of one, and the
    server the line runs itself (recurring.serve.num_servers) on its champion. Two firings started from the
    deployment at once: the second waits for a slot (AwaitingConcurrencySlot), then finds nothing new; the
    first's champion is what the line's server serves. Stopping `serve` stops that server and deletes the
    schedule (nothing fires the deployment afterwards)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId, FlowRunFilter, FlowRunFilterState
    from prefect.client.schemas.filters import FlowRunFilterStateType
    from prefect.client.schemas.objects import StateType
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from test_flows import serve_cli, stop_serve, wait_for_deployment

    overrides = line_overrides(tmp_path, base, "recurring.serve.num_servers=1")
    new_data(overrides)
    env = client_env(server, tmp_path / "home")
    serve = serve_cli(tmp_path / "serve.log", "--config", str(CONFIG), "--recurring", "--cron", "0 0 1 1 *",
                      *overrides, env=env)
    line = line_of(overrides)
    try:
        announced = wait_until(lambda: line.announced_servers(), 300, "the line's own server")
        assert_serves(announced[0], base, 0)

        async def fire_twice():
            async with get_client() as client:
                deployment = await wait_for_deployment(client, "recurring/arith-line")
                assert deployment.schedules and deployment.schedules[0].active
                assert deployment.global_concurrency_limit.limit == 1
                assert deployment.concurrency_options.collision_strategy.value == "ENQUEUE"
                await wait_for_deployment(client, "recurring-rollback/arith-line")
                runs = [await client.create_flow_run_from_deployment(deployment.id) for _ in range(2)]
                while True:
                    states = [(await client.read_flow_run(r.id)).state for r in runs]
                    if all(s.is_final() for s in states):
                        break
                    await asyncio.sleep(1)
                histories = [[s.name for s in await client.read_flow_run_states(r.id)] for r in runs]
                return deployment, states, histories
        with temporary_settings(updates={PREFECT_API_URL: server}):
            deployment, states, histories = asyncio.run(fire_twice())
        assert all(s.is_completed() for s in states), (states, (tmp_path / "serve.log").read_text()[-3000:])
        assert any("AwaitingConcurrencySlot" in history for history in histories), histories
        assert sorted(f["decision"] for f in status(overrides)["firings"]) == ["no_data", "promoted"]
        champion = status(overrides)["champion"]
        assert_serves(announced[0], champion["checkpoint"] + "/model", champion["iteration"])
        # what clients of the line use: its OpenAI-compatible endpoint, answered by the champion
        code, reply = http(announced[0], "/v1/chat/completions", {
            "model": "default", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "What is 2+3? Answer with the number."}]})
        assert code == 200 and reply["choices"][0]["message"]["content"], reply
    finally:
        stop_serve(serve)
    out = (tmp_path / "serve.log").read_text()
    assert "removed 1 schedule(s) of recurring/arith-line" in out, out[-3000:]
    assert line.announced_servers() == [] and not (line.dir / "servers.json").exists()

    async def after():
        async with get_client() as client:
            fresh = await client.read_deployment(deployment.id)
            scheduled = await client.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id])),
                flow_run_filter=FlowRunFilter(state=FlowRunFilterState(
                    type=FlowRunFilterStateType(any_=[StateType.SCHEDULED]))))
            return fresh, scheduled
    with temporary_settings(updates={PREFECT_API_URL: server}):
        fresh, scheduled = asyncio.run(after())
    assert fresh.schedules == [] and scheduled == []
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://{announced[0]}/health", timeout=5)


def test_a_promotion_a_server_cannot_take_leaves_the_servers_as_they_were_and_resumes_once_it_can(
        server, base, tmp_path):
    """One of the line's two servers is down when the candidate, approved, is published: the one that took the new
    weights is given the previous ones back, the champion stays the base model, the firing is left failed. With
    the server back, the same command resumes that firing from its publication: the candidate is not trained nor
    gated again, and both servers serve it."""
    up = start_cpu_server(Path(base), tmp_path)
    down = start_cpu_server(Path(base), tmp_path)
    port = int(down.address.rsplit(":", 1)[1])
    down.stop()
    overrides = line_overrides(tmp_path, base, f"recurring.serve.addresses=[{up.address},{down.address}]",
                               "inference.request_retries=0")
    restarted = None
    try:
        new_data(overrides)
        with pytest.raises(PublishError, match=rf"did not take version 3 .*{down.address}"):
            fire(server, overrides)
        line = status(overrides)
        assert line["champion"]["run_id"] is None and line["firings"][0]["state"] == "failed"
        assert_serves(up.address, base, 0)  # given the base model back
        gate_file = line_of(overrides).firing_dir(1) / "gate.json"
        gated_at = gate_file.stat().st_mtime_ns

        restarted = start_cpu_server(Path(base), tmp_path, port=port)
        resumed = fire(server, overrides)
        assert (resumed["firing"], resumed["decision"]) == (1, "promoted")
        champion = status(overrides)["champion"]
        for address in (up.address, down.address):
            assert_serves(address, champion["checkpoint"] + "/model", 3)
        assert gate_file.stat().st_mtime_ns == gated_at  # the gate's record was found, not made again
        lines = (tmp_path / "arith-line-0001" / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(row)["iteration"] for row in lines] == [1, 2, 3]
        assert len(status(overrides)["firings"][0]["flow_runs"]) == 2
    finally:
        up.stop()
        if restarted is not None:
            restarted.stop()


def test_a_lora_line_trains_adapters_promotes_the_merged_policy_and_branches_from_it(server, base, tmp_path):
    """trainer.lora on a line: the candidate trains adapters (each push the adapter alone, to the run's own
    servers), the gate compares the champion with the candidate's merged policy on servers that load model
    directories, production is published the merged policy (full weights: its servers know no adapter), and the
    next firing branches from the champion's adapters."""
    production = start_cpu_server(Path(base), tmp_path)
    overrides = line_overrides(tmp_path, base, f"recurring.serve.addresses=[{production.address}]",
                               "trainer.lora.enabled=true", "trainer.optimizer.lr=3e-3")
    try:
        new_data(overrides)
        first = fire(server, overrides)
        assert first["decision"] == "promoted", first
        champion = status(overrides)["champion"]
        checkpoint = Path(champion["checkpoint"])
        assert (checkpoint / "adapter" / "adapter_model.safetensors").is_file()
        assert_serves(production.address, str(checkpoint / "model"), 3)
        pushed = tmp_path / champion["run_id"] / "weights" / "v3"
        assert sorted(p.name for p in pushed.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
        new_data(overrides)
        second = fire(server, overrides)
        assert second["run_id"] == "arith-line-0002" and second["decision"] in ("promoted", "rejected"), second
        branch = json.loads((tmp_path / "arith-line-0002" / "branch.json").read_text())
        assert (branch["parent_run_id"], branch["at"]) == ("arith-line-0001", 3)
        resumed = load_file(str(tmp_path / "arith-line-0002" / "checkpoints" / "step_3" / "adapter"
                                / "adapter_model.safetensors"))
        parents = load_file(str(checkpoint / "adapter" / "adapter_model.safetensors"))
        assert resumed.keys() == parents.keys() and all(torch.equal(resumed[k], parents[k]) for k in parents)
    finally:
        production.stop()
