"""Nothing a run starts listens beyond loopback: the inference server, the trainer (its endpoint, torchrun's
rendezvous and worker stores, the ranks' gloo), the weight-update group and the retrieval server."""

from __future__ import annotations

import ipaddress
import os
import socket

import psutil

from areal_pipeline.run_spec import load_config
from areal_pipeline.services import Services
from areal_pipeline.training.weight_group import NamedAddressTCPStore
from areal_pipeline.utils import find_free_port
from conftest import http
from areal_pipeline.forkserver import processes_of


def listening_sockets(processes: list[psutil.Process]) -> list[tuple[str, str, int]]:
    """(process command, address, port) of every TCP socket the processes listen on and UDP socket they hold."""
    found = []
    for proc in processes:
        try:
            command = " ".join(proc.cmdline()[1:4])
            for conn in proc.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN or (conn.type == socket.SOCK_DGRAM and conn.laddr):
                    found.append((command, conn.laddr.ip, conn.laddr.port))
        except psutil.NoSuchProcess:
            pass
    return found


def test_every_socket_a_search_agent_run_opens_is_on_loopback(tiny_model_dir, tmp_path):
    cfg = load_config("configs/search_agent.yaml", [f"output_dir={tmp_path}", f"model.path={tiny_model_dir}",
                                                    "trainer.nproc=2"])
    services = Services(cfg, str(tiny_model_dir), tmp_path / "logs")
    try:
        services.start_inference()
        services.start_trainer()
        services.start_tools()
        # a distributed weight push: the trainer hosts the weight-update group's store, the server joins its gloo
        reply = services.trainer_client.call("update_weights_distributed", servers=services.addresses,
                                             master_address="127.0.0.1", master_port=find_free_port())
        assert reply["version"] == 0
        assert http(services.addresses[0], "/get_model_info")[1]["weight_version"] == "0"

        processes = processes_of(os.getpid(), forkserver=False)
        commands = " | ".join(" ".join(p.cmdline()) for p in processes)
        for service in ("areal_pipeline.inference.server", "areal_pipeline.training.client",
                        "areal_pipeline.training.trainer_server", "areal_pipeline.tools.retrieval_server"):
            assert service in commands, f"{service} is not among the run's processes: {commands}"
        sockets = listening_sockets(processes)
        # the endpoints of three servers and a trainer, torchrun's two stores, gloo (two groups a rank), the
        # weight-update group's store
        assert len(sockets) >= 10, sockets
        exposed = [s for s in sockets if not ipaddress.ip_address(s[1]).is_loopback]
        assert not exposed, f"listening beyond loopback: {exposed}"
    finally:
        services.stop()


def test_a_store_listens_on_the_address_it_is_named_by():
    """torch's own TCPStore server listens on every interface whatever host it is given."""
    store = NamedAddressTCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = NamedAddressTCPStore("127.0.0.1", store.port)
    client.set("key", "value")
    assert store.get("key") == b"value"
    sockets = listening_sockets([psutil.Process()])
    assert [(ip, port) for _, ip, port in sockets if port == store.port] == [("127.0.0.1", store.port)]
