"""flows/control.py's RunControl, alone: it follows a real flow run's state in a real Prefect API (pause, resume,
cancel), and an API that stops answering stops the run's nodes only once the grace has passed."""

from __future__ import annotations

import socket
import time

import pytest

from areal_pipeline.pipeline import Pipeline
from areal_pipeline.run_spec import load_config
from flows.control import APIUnavailable, RunControl
from test_flows import wait_until


@pytest.fixture
def pipeline(tmp_path, tiny_model_dir) -> Pipeline:
    return Pipeline(load_config(None, [f"output_dir={tmp_path}", f"model.path={tiny_model_dir}", "run_id=watched"]))


def new_flow_run(prefect_api) -> str:
    """A Running flow run in the API, as the train flow's own is while it trains."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.states import Running

    @flow(name="run-control-test")
    def watched():
        pass

    with get_client(sync_client=True) as client:
        return str(client.create_flow_run(watched, state=Running()).id)


def set_state(flow_run_id: str, state) -> None:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run_id, state, force=True)


def test_a_paused_flow_run_holds_the_run_until_resumed_and_a_cancel_stops_it(prefect_api, pipeline):
    from prefect.states import Cancelling, Paused, Running

    flow_run_id = new_flow_run(prefect_api)
    control = RunControl(pipeline, flow_run_id, poll_s=0.05, grace_s=60)
    control.start()
    try:
        time.sleep(0.3)  # some reads of a Running flow run: nothing changes
        assert not control.paused and control.cancelled is None and control.api_failing_since is None
        set_state(flow_run_id, Paused(message="by hand"))
        wait_until(lambda: control.paused, 30, "the pause to be seen")
        with control.node("rollout"):  # a node in flight goes on; the next iteration waits (hold_while_paused)
            pass
        set_state(flow_run_id, Running())
        wait_until(lambda: not control.paused, 30, "the resume to be seen")
        control.hold_while_paused(1)  # returns at once
        set_state(flow_run_id, Cancelling(message="stop it, please"))
        wait_until(lambda: control.cancelled is not None, 30, "the cancel to be seen")
        assert control.cancelled == "stop it, please"
        control._thread.join(10)
        assert not control._thread.is_alive()  # nothing more to watch
    finally:
        control.stop()


def test_an_api_that_stops_answering_stops_the_nodes_only_after_the_grace(pipeline):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with socket.socket() as closed:  # a port nothing listens on: every read is refused
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with temporary_settings(updates={PREFECT_API_URL: f"http://127.0.0.1:{port}/api"}):
        control = RunControl(pipeline, "00000000-0000-0000-0000-000000000001", poll_s=0.05, grace_s=1.5)
        control.start()
    try:
        wait_until(lambda: control.api_failing_since is not None, 30, "a failed read")
        started = control.api_failing_since
        with control.node("rollout"):  # within the grace: nodes start
            pass
        wait_until(lambda: control.api_gone is not None, 30, "the grace to pass")
        assert time.monotonic() - started >= 1.5
        assert f"the Prefect API at http://127.0.0.1:{port}/api has not answered for" in control.api_gone
        assert "the grace is 1.5 s" in control.api_gone and "ConnectError" in control.api_gone, control.api_gone
        with pytest.raises(APIUnavailable, match="rollout not started: the Prefect API"):
            with control.node("rollout"):
                pass
        assert control.cancelled is None and not control.paused
    finally:
        control.stop()
