"""What `serve` does for the runs it stopped: a run whose process it killed before the run could report its end is
marked Cancelled in the API, which frees the deployment's one-at-a-time slot at once (Prefect's own lease on the
slot would free it minutes later); a run that ended keeps its state; the API gone, it says so within its deadline."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid

import psutil

from areal_pipeline.shutdown import FORCED_EXIT_AFTER_S
from flows.serve import END_RUNS_TIMEOUT_S, RUNS_STOP_GRACE_S, end_stopped_runs, flow_runs_of


def test_a_killed_run_is_cancelled_and_the_next_run_gets_the_deployments_slot(prefect_api):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.responses import SetStateStatus
    from prefect.states import Completed, Pending, Running

    async def deployment_with_two_runs():
        async with get_client() as client:
            flow_id = await client.create_flow_from_name(f"serve-stop-{uuid.uuid4().hex[:8]}")
            deployment_id = await client.create_deployment(flow_id, "one-at-a-time", concurrency_limit=1)
            first, second = [await client.create_flow_run_from_deployment(deployment_id) for _ in range(2)]
            assert (await client.set_flow_run_state(first.id, Pending())).status == SetStateStatus.ACCEPT
            assert (await client.set_flow_run_state(first.id, Running())).status == SetStateStatus.ACCEPT
            waiting = await client.set_flow_run_state(second.id, Pending())
            assert waiting.status != SetStateStatus.ACCEPT and waiting.state.name == "AwaitingConcurrencySlot"
            return first.id, second.id

    async def after():
        async with get_client() as client:
            return (await client.read_flow_run(first)).state, await client.set_flow_run_state(second, Pending())

    first, second = asyncio.run(deployment_with_two_runs())
    assert end_stopped_runs([str(first)]) == 1
    state, next_run = asyncio.run(after())
    assert state.is_cancelled() and "stopped its process" in state.message
    assert next_run.status == SetStateStatus.ACCEPT, next_run  # the slot is free at once

    async def complete_second():
        async with get_client() as client:
            await client.set_flow_run_state(second, Running())
            await client.set_flow_run_state(second, Completed())
            return (await client.read_flow_run(second)).state

    assert asyncio.run(complete_second()).is_completed()
    assert end_stopped_runs([str(second)]) == 0  # a run that reported its end keeps it


def test_with_the_api_gone_it_says_so_within_its_deadline(dead_address, monkeypatch, capsys):
    monkeypatch.setenv("PREFECT_API_URL", f"http://{dead_address}/api")
    started = time.monotonic()
    assert end_stopped_runs([str(uuid.uuid4())], timeout=1.0) == 0
    assert time.monotonic() - started < 1.0 + 1.0 + 5.0  # its deadline, the thread's join margin, imports
    assert "could not mark the end of flow run(s)" in capsys.readouterr().out
    # the runs' stop grace, then the marking and its thread's margin, all before the forced exit
    assert RUNS_STOP_GRACE_S + END_RUNS_TIMEOUT_S + 1.0 <= FORCED_EXIT_AFTER_S


def test_flow_runs_are_read_from_the_runner_given_environment_of_a_process_tree(tmp_path):
    """Prefect's runner starts each run's process with PREFECT__FLOW_RUN_ID; the processes that one starts inherit
    it: one id per run, however many processes it has."""
    flow_run_id = str(uuid.uuid4())
    child = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
                               "'import time; time.sleep(60)']); time.sleep(60)"],
        env={**os.environ, "PREFECT__FLOW_RUN_ID": flow_run_id}, start_new_session=True)
    plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             env={k: v for k, v in os.environ.items() if k != "PREFECT__FLOW_RUN_ID"})
    try:
        deadline = time.monotonic() + 30
        while len(psutil.Process(child.pid).children()) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        tree = [psutil.Process(child.pid), *psutil.Process(child.pid).children(recursive=True),
                psutil.Process(plain.pid)]
        assert len(tree) == 3
        assert flow_runs_of(tree) == [flow_run_id]
    finally:
        for process in psutil.Process(child.pid).children(recursive=True):
            process.kill()
        child.kill()
        plain.kill()
        child.wait(10)
        plain.wait(10)
