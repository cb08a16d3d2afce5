"""The servers a recurring line runs itself while `areal-pipeline serve --recurring` serves it
(`recurring.serve.num_servers`): inference servers of the line's backend on `recurring.serve.host`, started on the
line's champion (the base model before the first promotion), announced in the line's `servers.json` so that every
firing (a process of its own) publishes to them, and stopped with `serve`. Clients reach the champion there,
OpenAI-compatible at `http://<address>/v1` on the project's server; with `recurring.serve.record`, they record
what they serve and take feedback (docs/online.md)."""

from __future__ import annotations

import copy
import os
from typing import Optional

from areal_pipeline import auth
from areal_pipeline.processes import ServerProcess
from areal_pipeline.recurring.line import Line
from areal_pipeline.run_dir import write_json
from areal_pipeline.utils import get_logger

logger = get_logger(__name__)


class LineServers:
    def __init__(self, line: Line, servers: list[ServerProcess]):
        self.line, self.servers = line, servers

    @classmethod
    def start(cls, config_path: str, overrides: list[str]) -> Optional["LineServers"]:
        """The line's own servers, started and announced; None where the line runs none."""
        from areal_pipeline.inference.launcher import launch_servers
        from areal_pipeline.run_spec import load_config

        cfg = load_config(config_path, overrides)
        auth.ensure_run_token(cfg.output_dir)  # the output directory's: the line's firings, in other processes too
        line = Line(cfg)
        serve = cfg.recurring.serve
        if serve.num_servers == 0:
            return None
        with line.lock():  # no firing publishes while the servers come up on the champion it may be replacing
            ledger = line.ledger()
            model, version = line.champion_model(ledger)
            inference = copy.deepcopy(cfg.inference)
            inference.num_servers, inference.host, inference.base_port = serve.num_servers, serve.host, serve.base_port
            servers = launch_servers(model, inference, cfg.seed, line.dir / "logs" / "servers", experiment=cfg,
                                     extra_args=recording_args(line))
            try:
                if version:
                    _label_version(servers, inference, version)
                write_json(line.dir / "servers.json", {"pid": os.getpid(), "addresses": [s.address for s in servers],
                                                       "model": model, "version": version})
            except BaseException:
                for server in servers:
                    server.stop()
                raise
        addresses = ", ".join(s.address for s in servers)
        print(f"line {line.name}: serving its champion ({model}, version {version}) on {addresses}; OpenAI-compatible "
              f"at http://{servers[0].address}/v1", flush=True)
        return cls(line, servers)

    def stop(self) -> None:
        (self.line.dir / "servers.json").unlink(missing_ok=True)
        for server in self.servers:
            server.stop()


def recording_args(line: Line) -> list[str]:
    """The line's servers' flags to record what they serve into the line's traffic directory (docs/online.md)."""
    from areal_pipeline.recurring.traffic import traffic_dir

    serve = line.cfg.recurring.serve
    if not serve.record:
        return []
    return ["--record-dir", str(traffic_dir(line.dir).resolve()),
            "--record-rotate-bytes", str(int(serve.record_rotate_mb * (1 << 20))),
            "--record-rotate-s", str(serve.record_rotate_s), "--record-retention-days", str(serve.retention_days)]


def _label_version(servers: list[ServerProcess], inference, version: int) -> None:
    """Servers started on a champion's checkpoint say so: its version labels the tokens they generate."""
    from areal_pipeline.inference.backend import engine_for
    from areal_pipeline.utils import run_async

    async def label() -> None:
        async with engine_for([s.address for s in servers], inference) as engine:
            model = await engine.get_model_info(servers[0].address)
            path = model.get("model_path") or model.get("model")
            await engine.update_weights_from_disk(path, version)

    run_async(label())
