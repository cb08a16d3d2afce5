"""Tool servers the agents call (the search agent's retrieval server) and their clients.

A workflow names the servers it needs in its `tools` (workflows/protocol.py); `Services.start_tools` starts each
through `TOOL_SERVERS`: name -> "module:function", `start(cfg, log_dir) -> ServerProcess | None` (None: the config
names a server already running, which the workflow uses; nothing is started).
"""

from __future__ import annotations

from typing import Any, Callable

TOOL_SERVERS: dict[str, str] = {
    "retrieval": "areal_pipeline.tools.retrieval_server:start_for_run",
}


def tool_server_starter(name: str, workflow: str) -> Callable[..., Any]:
    """How the run starts the tool server `name` that `workflow` declares."""
    from areal_pipeline.user_code import load_attr

    if name not in TOOL_SERVERS:
        raise ValueError(f"workflow {workflow} needs the tool server {name!r}; the known ones: "
                         f"{', '.join(TOOL_SERVERS)}")
    return load_attr(TOOL_SERVERS[name], f"tools of {workflow}")
