"""The one private torch name the weight-update group relies on (`_new_process_group_helper`, as SGLang calls it):
these fail when a torch release changes what `new_process_group` passes it or what it builds."""

from __future__ import annotations

import inspect
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from areal_pipeline.training.weight_group import NamedAddressTCPStore, destroy_weight_group, new_process_group


def test_the_private_helper_still_takes_what_sglang_and_this_project_pass():
    parameters = inspect.signature(c10d._new_process_group_helper).parameters
    positional = list(parameters)[:5]
    assert positional == ["group_size", "group_rank", "global_ranks_in_group", "backend", "store"]
    assert {"group_name", "backend_options", "timeout", "device_id"} <= set(parameters)
    assert isinstance(c10d._world.pg_group_ranks, dict)


def test_a_group_built_through_the_helper_broadcasts_and_its_name_can_be_used_again():
    store = NamedAddressTCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    for _ in range(2):  # destroyed, the name is free again (a restarted server's group is joined afresh)
        group = new_process_group("gloo", dist.PrefixStore("wg-test", store), 0, 1, "wg-test", timedelta(seconds=30))
        tensor = torch.arange(4.0)
        dist.broadcast(tensor, src=0, group=group)  # ranks are registered as SGLang registers them
        group.broadcast(tensor, root=0).wait()
        assert torch.equal(tensor, torch.arange(4.0)) and group.size() == 1
        destroy_weight_group(group)
    with pytest.raises(ValueError, match="unknown weight-update backend"):
        from areal_pipeline.training.weight_group import host_weight_group

        host_weight_group("mpi", "127.0.0.1", 0, 2, "x")


# A server that joins the weight-update group as SGLang's would, then answers every update at once without
# receiving a tensor (a server whose receiving side is stuck): the trainer's broadcast waits on it.
_DEAF_SERVER = r'''
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
from areal_pipeline.training.weight_group import join_weight_group

groups = []

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/init_weights_update_group":
            groups.append(join_weight_group(body["backend"], body["master_address"], body["master_port"],
                                            body["rank_offset"], body["world_size"], body["group_name"]))
        data = json.dumps({"success": True, "message": "ok"}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

server = HTTPServer(("127.0.0.1", 0), Handler)
print(server.server_address[1], flush=True)
server.serve_forever()
'''


def test_a_server_that_joins_and_never_receives_fails_the_push_within_the_collective_timeout_naming_it():
    import socket
    import subprocess
    import sys
    import time

    from areal_pipeline.training.weight_sync import broadcast_weights
    from areal_pipeline.utils import PeerTimeout

    deaf = subprocess.Popen([sys.executable, "-c", _DEAF_SERVER], stdout=subprocess.PIPE, text=True)
    try:
        server = f"127.0.0.1:{deaf.stdout.readline().strip()}"
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        # large enough that gloo cannot hand it to the socket buffers and call it sent
        state = {"w": torch.ones(4 << 20)}
        started = time.monotonic()
        with pytest.raises(PeerTimeout, match=f"{server}: no receive of w of weight version 3 within 2 s") as raised:
            broadcast_weights({}, state, [server], 3, "127.0.0.1", port, "wg-deaf", "float32", "gloo",
                              tied_embeddings=False, timeout=2.0)
        assert raised.value.peer == server and time.monotonic() - started < 15
    finally:
        deaf.kill()
        deaf.wait(10)
