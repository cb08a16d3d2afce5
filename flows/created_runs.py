"""Running, in a process of its own, a flow run that the API already holds, as Prefect's workers do.

Prefect has no public call for it: a worker starts `python -m prefect.engine` with the run's id in an environment
variable of Prefect's own, and that entry point reads the run and hands it to `prefect.flow_engine.run_flow` (in
Prefect's API reference, but in no module's `__all__`). A sweep's run needs the project's own set-up around it in
that process (stop handlers, the forkserver, the console), so it does the same itself: it reads the run through
the public client and calls `run_flow` in `run_created_flow_run`, and nowhere else; the run's id travels in the
project's own variable (`FLOW_RUN_ID_ENV`), not Prefect's. tests/test_prefect_surface.py runs
`run_created_flow_run` against the installed Prefect, so an upgrade that changes `run_flow` fails there first.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, ContextManager
from uuid import UUID

FLOW_RUN_ID_ENV = "AREAL_CREATED_FLOW_RUN_ID"  # the flow run a new process runs (environment_for)


def environment_for(flow_run_id: Any) -> dict[str, str]:
    """The environment entries that make a new process's `run_created_flow_run` run `flow_run_id`."""
    return {FLOW_RUN_ID_ENV: str(flow_run_id)}


def _nothing_around(parameters: dict[str, Any]) -> ContextManager:
    return contextlib.nullcontext()


def run_created_flow_run(flow: Any, around: Callable[[dict[str, Any]], ContextManager] = _nothing_around) -> Any:
    """Run `flow` as the flow run `FLOW_RUN_ID_ENV` names (its parameters are those the run was created with),
    inside `around(parameters)`; the flow's return value. Its state is reported to the API as any run's."""
    from prefect import get_client
    from prefect.flow_engine import run_flow

    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(UUID(os.environ[FLOW_RUN_ID_ENV]))
    with around(dict(flow_run.parameters)):
        return run_flow(flow, flow_run=flow_run)
