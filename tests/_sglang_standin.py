"""A stand-in SGLang server for weight-sync tests: SGLang's own weight-update code, from its wheel, behind its routes.

    python tests/_sglang_standin.py VERSION PORT TP_SIZE OUT_DIR

Each tensor-parallel rank is a process of its own, as in SGLang, running the release's `init_weights_update_group`,
its receive (`ModelRunner.update_weights_from_distributed` in 0.5.10, `WeightUpdater.receive_weights_from_distributed`
in 0.5.23) and `init_custom_process_group` unchanged, with torch's default process group initialised (SGLang asserts
it). What each rank receives goes to OUT_DIR/tp<tp rank>-call<k>.safetensors, each update request to
OUT_DIR/requests.jsonl. An update for a group the server lacks ends the process, as SGLang's scheduler does.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
logger = logging.getLogger("sglang-standin")

# where each release keeps the code (module, the receiving method)
RECEIVE = {"0.5.10.post1": ("sglang/srt/model_executor/model_runner.py", "ModelRunner.init_weights_update_group",
                            "ModelRunner.update_weights_from_distributed", "ModelRunner.destroy_weights_update_group"),
           "0.5.23": ("sglang/srt/model_executor/model_runner_components/weight_updater.py",
                      "WeightUpdater.init_weights_update_group", "WeightUpdater.receive_weights_from_distributed",
                      "WeightUpdater.destroy_weights_update_group")}


def sglang_functions(version: str) -> dict[str, Any]:
    """SGLang's own functions of `version`, under short names: init_custom_process_group, init, receive, destroy."""
    import torch

    import _sglang_reference as ref

    common = ref.definitions(ref.source(version, "sglang/srt/utils/common.py"), ["init_custom_process_group"], {})
    network = ref.definitions(ref.source(version, "sglang/srt/utils/network.py"), ["NetworkAddress"], {})
    path, init, receive, destroy = RECEIVE[version]
    provided = {"torch": torch, "logger": logger, **common, **network}
    found = ref.definitions(ref.source(version, path), [init, receive, destroy], provided)
    return {**common, "init": found[init], "receive": found[receive], "destroy": found[destroy]}


class _Model:
    """What 0.5.10's update hands the received tensors to."""

    def __init__(self):
        self.loaded: list = []

    def load_weights(self, weights):
        self.loaded = list(weights)


class _Runner:
    """The attributes SGLang's methods read on `self` (ModelRunner / WeightUpdater)."""

    def __init__(self, tp_rank: int):
        self.tp_rank = tp_rank
        self.device = "cpu"
        self.model = _Model()
        self._model_update_group: dict = {}


def _rank(version: str, tp_rank: int, tp_size: int, default_port: int, out_dir: str, conn) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    try:
        functions = sglang_functions(version)
    except Exception as e:
        conn.send(("dead", f"{type(e).__name__}: {e}"))
        return
    # SGLang's TP ranks share a default group (it asserts one exists before joining a weight-update group)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{default_port}", rank=tp_rank, world_size=tp_size)
    runner, calls = _Runner(tp_rank), 0
    conn.send(("ready", ""))
    while True:
        command, kwargs = conn.recv()
        try:
            if command == "init":
                reply = functions["init"](runner, **kwargs)
            elif command == "destroy":
                reply = functions["destroy"](runner, **kwargs)
            else:
                received = functions["receive"](runner, **kwargs)
                if isinstance(received, tuple):  # 0.5.10: (success, message), the tensors handed to the model
                    reply, received = received, runner.model.loaded
                else:
                    reply = (True, "Succeeded to update parameter online.")
                save_file({name: t.contiguous() for name, t in received},
                          str(Path(out_dir) / f"tp{tp_rank}-call{calls}.safetensors"))
                calls += 1
        except AssertionError as e:  # SGLang's scheduler dies on it (SIGQUIT to the server)
            conn.send(("dead", str(e)))
            return
        conn.send(tuple(reply))


def main(version: str, port: int, tp_size: int, out_dir: str) -> None:
    from areal_pipeline.utils import exit_when_parent_dies, find_free_port

    logging.basicConfig(level="INFO")
    exit_when_parent_dies()
    ctx = multiprocessing.get_context("spawn")
    default_port = find_free_port()
    pipes, ranks = [], []
    for tp_rank in range(tp_size):
        parent, child = ctx.Pipe()
        process = ctx.Process(target=_rank, args=(version, tp_rank, tp_size, default_port, out_dir, child), daemon=True)
        process.start()
        pipes.append(parent)
        ranks.append(process)
    started = [pipe.recv() for pipe in pipes]
    if any(reply[0] != "ready" for reply in started):
        sys.exit(f"a rank could not start: {started}")

    def run(command: str, kwargs: dict) -> Optional[tuple[bool, str]]:
        for pipe in pipes:
            pipe.send((command, kwargs))
        replies = [pipe.recv() for pipe in pipes]
        if any(r[0] == "dead" for r in replies):
            logger.error("a rank died: %s", replies)
            os._exit(1)
        return all(r[0] for r in replies), "; ".join(r[1] for r in replies)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self.path == "/init_weights_update_group":
                ok, message = run("init", {k: body[k] for k in ("master_address", "master_port", "rank_offset",
                                                                "world_size", "group_name", "backend")})
            elif self.path == "/update_weights_from_distributed":
                with open(Path(out_dir) / "requests.jsonl", "a") as f:
                    f.write(json.dumps(body) + "\n")
                ok, message = run("update", {k: body[k] for k in ("names", "dtypes", "shapes", "group_name")})
            elif self.path == "/destroy_weights_update_group":
                ok, message = run("destroy", {"group_name": body.get("group_name", "weight_update_group")})
            else:
                ok, message = False, f"no route {self.path}"
            data = json.dumps({"success": ok, "message": message}).encode()
            self.send_response(200 if ok else 400)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            data = json.dumps({"tp_size": tp_size, "dp_size": 1, "version": version}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    print("standin ready", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
