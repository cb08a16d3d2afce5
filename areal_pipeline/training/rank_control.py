"""Rank 0's side of the trainer's command loop: the HTTP endpoint commands arrive on, and the control group's
collectives that hand each command to the other ranks, bounded on rank 0 (trainer_server.py runs the loop)."""

from __future__ import annotations

import json
import queue
import ssl
import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional

import torch
import torch.distributed as dist

from areal_pipeline.auth import LIVENESS_PATH, UNAUTHORIZED_MESSAGE, authorized
from areal_pipeline.training.command_input import BODY_READ_TIMEOUT_S, read_command
from areal_pipeline.utils import PeerTimeout, get_logger

logger = get_logger("areal_pipeline.trainer")


def wait_on_time(work, timeout: Optional[timedelta], what: str) -> None:
    """Wait for a collective of the control group; on rank 0 (`timeout` set) at most `timeout`: a rank that
    stopped (SIGSTOP, a hung host) would otherwise hold every command for the control group's idle limit."""
    if timeout is None:
        work.wait()
        return
    try:
        work.wait(timeout)
    except RuntimeError as e:
        others = ", ".join(str(r) for r in range(1, dist.get_world_size()))
        raise PeerTimeout(f"trainer rank(s) {others} (one or more)", what, timeout.total_seconds()) from e


def broadcast_json(obj: Optional[dict], group, timeout: Optional[timedelta] = None) -> dict:
    """Rank 0's `obj` on every rank, sent as JSON bytes (never pickled); rank 0 waits at most `timeout`."""
    if dist.get_rank() == 0:
        data = torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.long)
    else:
        size = torch.zeros(1, dtype=torch.long)
    what = f"receipt of command '{(obj or {}).get('cmd')}'"
    wait_on_time(dist.broadcast(size, 0, group=group, async_op=True), timeout, what)
    if dist.get_rank() != 0:
        data = torch.zeros(int(size), dtype=torch.uint8)
    wait_on_time(dist.broadcast(data, 0, group=group, async_op=True), timeout, what)
    return json.loads(bytes(data.tolist()).decode())


class Endpoint:
    """Rank 0's HTTP front: requests queue up and are answered when the rank loop has run them."""

    def __init__(self, host: str, port: int, trainer: Any, token: Optional[str] = None,
                 ssl_context: Optional[ssl.SSLContext] = None):
        """`token`: what every request but the bare liveness probe must carry (None: no credential asked);
        `ssl_context`: serve HTTPS with it."""
        self.inbox: queue.Queue = queue.Queue()
        self.busy_with: Optional[str] = None
        self.trainer = trainer
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            timeout = BODY_READ_TIMEOUT_S  # the socket's: a client that stops sending mid-body is let go

            def log_message(self, fmt, *args):  # keep the trainer log for the trainer
                pass

            def _reply(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _refused(self) -> bool:
                """Whether the request lacks the credential (answered 401, its body unread and the connection
                closed)."""
                if authorized(self.headers.get("Authorization"), token):
                    return False
                self.close_connection = True
                data = json.dumps({"error": {"message": UNAUTHORIZED_MESSAGE, "code": "unauthorized"}}).encode()
                self.send_response(401)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("WWW-Authenticate", "Bearer")
                self.end_headers()
                self.wfile.write(data)
                return True

            def do_GET(self):
                if self.path == LIVENESS_PATH and not authorized(self.headers.get("Authorization"), token):
                    return self._reply(200, {"status": "ok"})  # the bare probe: up, and nothing of the run
                if self._refused():
                    return None
                if self.path != "/health":
                    status = 405 if self.path == "/command" else 404
                    return self._reply(status, {"error": {"message": f"no route GET {self.path}"}})
                self._reply(200, {"status": "ok", "busy_with": endpoint.busy_with, **endpoint.trainer.status()})

            def do_POST(self):
                if self._refused():
                    return None
                if self.path != "/command":
                    status = 405 if self.path == "/health" else 404
                    return self._reply(status, {"error": {"message": f"no route POST {self.path}"}})
                command, refused = read_command(self.headers, self.rfile)
                if refused is not None:
                    self.close_connection = True  # a body left unread must not be taken for the next request
                    return self._reply(refused[0], {"error": {"message": refused[1], "code": "bad_request"}})
                done = threading.Event()
                slot: dict = {"replied": threading.Event()}
                endpoint.inbox.put((command, slot, done))
                done.wait()
                try:
                    self._reply(slot["status"], slot["body"])
                finally:
                    slot["replied"].set()

        self.server = ThreadingHTTPServer((host, port), Handler)
        if ssl_context is not None:
            # the handshake on the connection's own thread (its first read), not in the loop that accepts: a caller
            # that connects and never speaks would otherwise hold up every other one
            self.server.socket = ssl_context.wrap_socket(self.server.socket, server_side=True,
                                                         do_handshake_on_connect=False)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()


def give_up(endpoint: Endpoint, slot: Optional[dict], done: Optional[threading.Event], error: PeerTimeout) -> None:
    """Rank 0, once a rank missed a collective: the ranks are out of step for good, so the command's caller is
    told who did not answer and the trainer ends (the pipeline starts a new one)."""
    logger.error("%s: the trainer stops", error)
    if slot is not None:
        slot.update(status=500, body={"error": {"message": str(error), "code": "peer_timeout",
                                                "peer": error.peer}})
        done.set()
        slot["replied"].wait(10)  # written by the endpoint's thread, which the process's end would cut short
    endpoint.stop()
