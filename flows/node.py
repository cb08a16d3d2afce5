"""The `cluster-node` flow: one part of a run across hosts (an inference server, a trainer node) as a Prefect flow
run, run by a Prefect worker on its host.

    prefect worker start --pool areal-process --work-queue <this host's name>     # on every host, once
    areal-pipeline cluster --config run.yaml --submit                            # on the head: a flow run per part

`--submit` creates a flow run of the `cluster-node` deployment (prefect.yaml) per part, on the work queue named
after the part's host, so that host's worker runs it. The flow runs the part's command (the one `areal-pipeline
cluster` prints), its output in the flow run's logs; the flow run lasts as long as the process, fails when it
fails, and cancelling it (the UI, `prefect flow-run cancel`) stops the process.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Optional

from prefect import flow, get_run_logger

from areal_pipeline.training.nodes import is_local_address
from areal_pipeline.utils import PARENT_PID_ENV

STOP_GRACE_S = 30.0  # seconds the part has to exit after SIGTERM before it is killed


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM to the part's process group, SIGKILL past the grace (its servers and ranks go with it)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(STOP_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            continue


@flow(name="cluster-node", flow_run_name="{role}@{host}")
def cluster_node(role: str, host: str, argv: list[str], env: Optional[dict[str, str]] = None) -> int:
    """Run `argv` (an `areal-pipeline` command for this host) until it ends; its exit status, or a failure."""
    logger = get_run_logger()
    if host and not is_local_address(host):
        raise RuntimeError(f"the {role} belongs on {host}, but this worker runs on {socket.gethostname()}: start "
                           "each host's worker with --work-queue set to that host's name")
    if argv and argv[0] == "areal-pipeline":  # this interpreter's, whatever the worker's PATH holds
        argv = [sys.executable, "-m", "cli", *argv[1:]]
    started = time.monotonic()
    # the part ends with this flow run's process, also when that one is killed outright (exit_when_parent_dies)
    process = subprocess.Popen(argv, env={**os.environ, **(env or {}), PARENT_PID_ENV: str(os.getpid())},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                               start_new_session=True)
    logger.info("%s on %s: pid %d: %s", role, socket.gethostname(), process.pid, " ".join(argv))
    try:
        for line in process.stdout:
            logger.info("%s", line.rstrip())
        status = process.wait()
    finally:
        _stop(process)
    if status != 0:
        raise RuntimeError(f"{role} on {socket.gethostname()} exited with status {status} after "
                           f"{time.monotonic() - started:.0f}s (its output is in this flow run's logs)")
    return status


DEPLOYMENT = "cluster-node/cluster-node"


async def submit(parts: list[dict], pool: Optional[str] = None) -> list[str]:
    """A flow run of the `cluster-node` deployment per part ({role, host, argv, env}), each on the work queue of
    its host (created in the deployment's work pool where missing); their ids."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    async with get_client() as client:
        try:
            deployment = await client.read_deployment_by_name(DEPLOYMENT)
        except ObjectNotFound:
            raise RuntimeError(f"no deployment {DEPLOYMENT} on {client.api_url}: deploy it first (`prefect --no-prompt "
                               "deploy --name cluster-node`, from the project's directory)") from None
        pool = pool or deployment.work_pool_name
        ids = []
        for part in parts:
            try:
                await client.read_work_queue_by_name(part["host"], work_pool_name=pool)
            except ObjectNotFound:
                await client.create_work_queue(part["host"], work_pool_name=pool)
            run = await client.create_flow_run_from_deployment(
                deployment.id, parameters=part, work_queue_name=part["host"],
                tags=[f"host:{part['host']}", f"role:{part['role']}"])
            ids.append(str(run.id))
        return ids
