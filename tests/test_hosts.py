"""The simulated hosts of tests/_hosts.py: real servers reached across hosts by address and by name, loopback
kept to each host, a host's processes killed as a whole, nothing left behind."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests._hosts import IP, NETNS_ETC, SimulatedHosts, namespaces_unavailable, netns_names

pytestmark = pytest.mark.skipif(namespaces_unavailable() is not None, reason=str(namespaces_unavailable()))

# Fetches each URL (retrying until `wait` seconds have passed, where asked) and says what this host calls itself.
PROBE = r"""
import json, socket, sys, time, urllib.request
wait, urls = float(sys.argv[1]), sys.argv[2:]
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
deadline = time.monotonic() + wait
name = socket.gethostname()
report = {"hostname": name, "hostname_address": socket.gethostbyname(name)}
for url in urls:
    while True:
        try:
            with opener.open(url, timeout=5) as response:
                report[url] = response.status
            break
        except OSError as error:
            if time.monotonic() > deadline:
                report[url] = type(getattr(error, "reason", error)).__name__
                break
            time.sleep(0.05)
print(json.dumps(report))
"""


def probe(hosts: SimulatedHosts, host: str, urls: list[str], wait: float) -> dict:
    done = hosts.run(host, [sys.executable, "-c", PROBE, str(wait), *urls], timeout=wait + 30,
                     capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def http_server(hosts: SimulatedHosts, host: str, bind: str, port: int, directory: Path) -> subprocess.Popen:
    return hosts.popen(host, [sys.executable, "-m", "http.server", str(port), "--bind", bind,
                              "--directory", str(directory)],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ))


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited and waiting for its parent, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_servers_reached_across_hosts_by_address_and_name_loopback_stays_on_its_host(tmp_path):
    with SimulatedHosts(["head", "gen", "train-a"]) as hosts:
        # Ports are per host: head and gen both serve on port 8000.
        http_server(hosts, "head", hosts.address("head"), 8000, tmp_path)
        http_server(hosts, "head", "127.0.0.1", 8001, tmp_path)
        http_server(hosts, "gen", "127.0.0.1", 8000, tmp_path)
        on_head = probe(hosts, "head", [f"http://{hosts.address('head')}:8000/", "http://127.0.0.1:8001/"], 20)
        assert list(on_head.values())[2:] == [200, 200]
        assert probe(hosts, "gen", ["http://127.0.0.1:8000/"], 20)["http://127.0.0.1:8000/"] == 200

        on_train = probe(hosts, "train-a", [f"http://{hosts.address('head')}:8000/", "http://head:8000/",
                                            "http://127.0.0.1:8001/", "http://127.0.0.1:8000/"], 0)
        assert list(on_train.values())[2:] == [200, 200, "ConnectionRefusedError", "ConnectionRefusedError"]
        if hosts.hostnames:
            assert on_train["hostname"] == "train-a"
            assert on_train["hostname_address"] == hosts.address("train-a")
        assert hosts.addresses == {name: hosts.address(name) for name in ["head", "gen", "train-a"]}
        assert len(set(hosts.addresses.values())) == 3


def test_kill_host_kills_its_process_tree_and_spares_other_hosts():
    with SimulatedHosts(["train-a", "train-b"]) as hosts:
        tree = hosts.popen("train-a", ["sh", "-c", "sleep 100 & sleep 100 & wait"])
        other = hosts.popen("train-b", ["sleep", "100"])
        tree_pids = wait_for_pids(hosts, "train-a", 3)
        killed = hosts.kill_host("train-a")
        assert set(tree_pids) <= set(killed)
        assert hosts.pids("train-a") == []
        assert tree.returncode == -9
        assert not any(alive(pid) for pid in tree_pids)
        assert other.poll() is None and hosts.pids("train-b") == [other.pid]


def wait_for_pids(hosts: SimulatedHosts, host: str, count: int, timeout: float = 10) -> list[int]:
    deadline = time.monotonic() + timeout
    while len(pids := hosts.pids(host)) < count:
        assert time.monotonic() < deadline, f"{host} has {pids}, not {count} processes"
        time.sleep(0.02)
    return pids


class Failure(Exception):
    pass


@pytest.mark.parametrize("raises", [False, True], ids=["block-returns", "block-raises"])
def test_nothing_is_left_after_the_block(raises):
    with pytest.raises(Failure) if raises else contextlib.nullcontext():
        with SimulatedHosts(["head", "gen"]) as hosts:
            hosts.popen("head", ["sh", "-c", "sleep 100 & sleep 100 & wait"])
            hosts.popen("gen", ["sleep", "100"])
            pids = wait_for_pids(hosts, "head", 3) + wait_for_pids(hosts, "gen", 1)
            namespaces = [hosts.switch, *hosts.namespaces.values()]
            assert set(namespaces) <= set(netns_names())
            if raises:
                raise Failure()
    assert not set(namespaces) & set(netns_names())
    assert not any((NETNS_ETC / namespace).exists() for namespace in namespaces)
    assert not any(alive(pid) for pid in pids)
    hosts.__exit__(None, None, None)  # idempotent


def test_a_crashed_sessions_namespaces_are_removed():
    gone = subprocess.Popen(["true"])
    gone.wait(10)
    stale = f"apl{gone.pid}-dead-head"
    subprocess.run([IP, "netns", "add", stale], check=True, timeout=30)
    (NETNS_ETC / stale).mkdir(parents=True)
    with SimulatedHosts(["head"]):
        assert stale not in netns_names()
        assert not (NETNS_ETC / stale).exists()


def test_a_failed_start_removes_what_it_made():
    hosts = SimulatedHosts(["head", "gen"])
    taken = hosts.namespaces["gen"]
    subprocess.run([IP, "netns", "add", taken], check=True, timeout=30)
    try:
        with pytest.raises(RuntimeError, match="File exists"):
            hosts.__enter__()
        left = set(netns_names())
        assert hosts.switch not in left and hosts.namespaces["head"] not in left
        assert not (NETNS_ETC / hosts.namespaces["head"]).exists()
    finally:
        subprocess.run([IP, "netns", "del", taken], check=True, timeout=30)
