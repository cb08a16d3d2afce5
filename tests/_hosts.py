"""Simulated hosts on one Linux machine: one network namespace per host, joined by a switch.

Why each piece exists:
- One network namespace per host gives it its own interfaces, ports and loopback: a service a host binds to
  127.0.0.1 (PostgreSQL, say) is not reachable from the other hosts, as on a cluster, and every host can use the
  same port numbers.
- The switch is one more namespace holding a Linux bridge, with one veth pair per host (`eth0` in the host, its
  peer on the bridge). The bridge is not in the root namespace because there bridge-nf-call-iptables and
  Docker's FORWARD DROP policy may drop host-to-host traffic; a namespace of its own has empty netfilter tables.
  Links are made inside the namespaces, so their names never meet the root namespace's or another set's.
- Each set takes one /24 of 10.0.0.0/8 at random, hosts .1, .2, ... in the order given; sets never share a
  namespace, so parallel tests' sets cannot collide even where their subnets do.
- Names resolve as on a cluster: `ip netns exec` bind-mounts /etc/netns/<ns>/hosts over /etc/hosts, which maps
  every host's name to its address; `unshare --uts` gives each process its host's hostname (where util-linux
  allows it: `SimulatedHosts.hostnames` says whether it does).
- Processes are found by namespace (`ip netns pids`), not by process group, so killing a host catches every
  process started on it, grandchildren and daemons included: that is what a host's crash does.
- Namespaces carry the creating process's pid, so a later set removes what a crashed test session left behind.
"""

from __future__ import annotations

import functools
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Optional, Sequence

IP = shutil.which("ip", path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))
NETNS_ETC = Path("/etc/netns")
COMMAND_TIMEOUT = 30.0  # for each `ip` / `unshare` call: they return at once unless the kernel is stuck
HOSTNAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?$")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([IP, *args], capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


@functools.lru_cache(maxsize=None)
def namespaces_unavailable() -> Optional[str]:
    """None where this process can make simulated hosts; else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if IP is None:
        return "`ip` (iproute2) is not installed"
    probe = f"apl{os.getpid()}-probe"
    try:
        for args in (["netns", "add", probe], ["-n", probe, "link", "add", "br0", "type", "bridge"],
                     ["-n", probe, "link", "add", "eth0", "type", "veth", "peer", "name", "p0"],
                     ["netns", "exec", probe, "true"]):
            done = _ip(*args, check=False)
            if done.returncode != 0:
                return f"ip {' '.join(args)} refused: {done.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


@functools.lru_cache(maxsize=None)
def uts_namespaces_work() -> bool:
    """Whether `unshare --uts` can give a process a hostname of its own (it leaves this machine's alone)."""
    try:
        done = subprocess.run(["unshare", "--uts", "hostname", "apl-probe"], capture_output=True,
                              timeout=COMMAND_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def netns_names() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]


def netns_pids(namespace: str) -> list[int]:
    done = _ip("netns", "pids", namespace, check=False)
    return [int(word) for word in done.stdout.split()] if done.returncode == 0 else []


def remove_namespace(namespace: str) -> None:
    """Removes the name and its /etc/netns files; the kernel frees the namespace (and its links) once no process
    is left in it."""
    _ip("netns", "del", namespace, check=False)
    shutil.rmtree(NETNS_ETC / namespace, ignore_errors=True)


def kill_namespace(namespace: str, sig: int = signal.SIGKILL, timeout: float = 30.0) -> list[int]:
    """Signals every process in `namespace`, also those started while it runs, until none is left (exited
    processes awaiting their parent's wait no longer count); TimeoutError after `timeout`."""
    deadline = time.monotonic() + timeout
    signalled: list[int] = []
    while pids := netns_pids(namespace):
        for pid in pids:
            if pid not in signalled:
                try:
                    os.kill(pid, sig)
                    signalled.append(pid)
                except ProcessLookupError:
                    pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"processes {pids} still in namespace {namespace} after {timeout}s")
        time.sleep(0.02)
    return signalled


def remove_stale_sets(prefix: str) -> None:
    """Removes namespaces named `<prefix><pid>-...` whose pid is no process any more (a crashed session's)."""
    names = set(netns_names()) | {p.name for p in NETNS_ETC.glob(f"{prefix}*")}
    for namespace in names:
        match = re.fullmatch(re.escape(prefix) + r"(\d+)-.+", namespace)
        if match is None or Path(f"/proc/{match.group(1)}").exists():
            continue
        try:
            kill_namespace(namespace, timeout=10.0)
        except TimeoutError:
            pass  # the name goes anyway; the kernel frees the namespace when its last process exits
        remove_namespace(namespace)


class SimulatedHosts:
    """Hosts `names` (hostnames such as "head", "train-a") on one switch, for the `with` block."""

    def __init__(self, names: Sequence[str], prefix: str = "apl"):
        if len(set(names)) != len(names) or not 0 < len(names) < 250:
            raise ValueError(f"host names must be 1 to 249 distinct names: {names}")
        for name in names:
            if not HOSTNAME_RE.match(name):
                raise ValueError(f"{name!r} is no hostname (lowercase letters, digits, '-', at most 32)")
        self.names = list(names)
        self.prefix = prefix
        set_id = secrets.token_hex(2)
        self.namespaces = {name: f"{prefix}{os.getpid()}-{set_id}-{name}" for name in names}
        self.switch = f"{prefix}{os.getpid()}-{set_id}_switch"
        subnet = f"10.{random.randint(64, 250)}.{random.randint(0, 255)}"
        self.addresses = {name: f"{subnet}.{index}" for index, name in enumerate(names, start=1)}
        self.hostnames = False
        self._made: list[str] = []
        self._processes: dict[str, list[subprocess.Popen]] = {name: [] for name in names}

    def __enter__(self) -> "SimulatedHosts":
        reason = namespaces_unavailable()
        if reason is not None:
            raise RuntimeError(f"cannot simulate hosts: {reason}")
        remove_stale_sets(self.prefix)
        self.hostnames = uts_namespaces_work()
        try:
            self._build()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _build(self) -> None:
        hosts_file = "127.0.0.1\tlocalhost\n::1\tlocalhost\n" + "".join(
            f"{address}\t{name}\n" for name, address in self.addresses.items())
        for namespace in [self.switch, *self.namespaces.values()]:
            _ip("netns", "add", namespace)
            self._made.append(namespace)
            _ip("-n", namespace, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for index, (name, namespace) in enumerate(self.namespaces.items()):
            port = f"p{index}"
            _ip("-n", namespace, "link", "add", "eth0", "type", "veth", "peer", "name", port, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
            _ip("-n", namespace, "addr", "add", f"{self.addresses[name]}/24", "dev", "eth0")
            _ip("-n", namespace, "link", "set", "eth0", "up")
            (NETNS_ETC / namespace).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / namespace / "hosts").write_text(hosts_file)

    def __exit__(self, *exc_info) -> None:
        """Kills every process of every host, then removes the namespaces (their links go with them)."""
        problems = []
        for name in self.names:
            try:
                self.kill_host(name)
            except (TimeoutError, RuntimeError, subprocess.TimeoutExpired) as error:
                problems.append(str(error))
        for namespace in reversed(self._made):
            remove_namespace(namespace)
        self._made.clear()
        if problems:
            raise RuntimeError("simulated hosts not cleanly stopped: " + "; ".join(problems))

    def address(self, name: str) -> str:
        return self.addresses[name]

    def command(self, name: str, argv: Sequence[str]) -> list[str]:
        """`argv` as a command that runs on host `name` (its network, /etc/hosts and, where possible, hostname)."""
        prefix = [IP, "netns", "exec", self.namespaces[name]]
        if self.hostnames:
            prefix += ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', name]
        return prefix + list(argv)

    def popen(self, name: str, argv: Sequence[str], **popen_kwargs) -> subprocess.Popen:
        popen_kwargs.setdefault("start_new_session", True)
        process = subprocess.Popen(self.command(name, argv), **popen_kwargs)
        self._processes[name].append(process)
        return process

    def run(self, name: str, argv: Sequence[str], timeout: float, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(name, argv), timeout=timeout, **kw)

    def pids(self, name: str) -> list[int]:
        return netns_pids(self.namespaces[name])

    def kill_host(self, name: str, sig: int = signal.SIGKILL, timeout: float = 30.0) -> list[int]:
        """Signals every process on host `name` until none is left (TimeoutError after `timeout`) and reaps the
        ones this set started. Returns the pids signalled."""
        deadline = time.monotonic() + timeout
        started = [process for process in self._processes[name] if process.poll() is None]
        for process in started:  # one just started may not have entered the namespace yet
            process.send_signal(sig)
        namespace = self.namespaces[name]
        killed = kill_namespace(namespace, sig, timeout) if namespace in self._made else []
        for process in started:
            process.wait(max(deadline - time.monotonic(), 0.1))
        self._processes[name] = []
        return list(dict.fromkeys([process.pid for process in started] + killed))
