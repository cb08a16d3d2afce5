"""Hosts and host:port addresses, decided in one place: whether a host is this machine's loopback, and how an address
splits into its host and port. The configuration's rules (host_rules.py) and the code that launches and reaches
processes (training/nodes.py, cluster.py, inference/launcher.py) ask the same functions, so a config the rules
accept is one the launchers read alike. Standard library only: the configuration package may import it.
"""

from __future__ import annotations

import ipaddress

# The names a system's hosts file gives its loopback (Debian's gives ::1 both ip6-* names); a name is never resolved
# here, since another host resolves it against its own hosts file
LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost", "ip6-loopback"})


def unbracketed(host: str) -> str:
    """`host` without the brackets an IPv6 address wears inside host:port and URLs ([::1] -> ::1)."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine's loopback wherever it is read: a loopback name, an address of 127.0.0.0/8,
    ::1 (bracketed or not), or an IPv4-mapped loopback (::ffff:127.0.0.1). Host names are case-insensitive."""
    host = unbracketed(host.strip()).lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:  # any other name: what it resolves to is each host's own business
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def split_address(address: str) -> tuple[str, int]:
    """`host:port` -> (host, port), the port after the last colon. An IPv6 host may be bracketed ([::1]:8000) or
    bare (::1:8000, as a node announces the address it bound) and comes back without brackets. ValueError, naming
    the address, when there is no host, no port, a port outside 0..65535, or a bare host with colons that is no
    IPv6 address."""
    host, colon, port = address.strip().rpartition(":")
    if not colon or not (port.isascii() and port.isdigit()) or int(port) > 65535:
        raise ValueError(f"address {address!r}: must be host:port, the port in 0..65535 (an IPv6 host in brackets: "
                         "[::1]:8000)")
    host = unbracketed(host)
    if not host or "[" in host or "]" in host or (":" in host and not _is_ipv6(host)):
        raise ValueError(f"address {address!r}: {host!r} is no host name or IP address (an IPv6 host in brackets: "
                         "[::1]:8000)")
    return host, int(port)


def weight_group_master(weight_sync_master_address: str, trainer_address: str) -> str:
    """The host the trainer's weight-update group meets on (trainer.weight_sync=distributed), as the rules, the
    launcher and the push all read it: the configured one, else the host of the trainer's endpoint (127.0.0.1 for a
    trainer the run launches); "" for trainer.address=auto, whose endpoint is known only once it runs."""
    if weight_sync_master_address:
        return weight_sync_master_address
    if not trainer_address:
        return "127.0.0.1"
    return "" if trainer_address == "auto" else split_address(trainer_address)[0]


def _is_ipv6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:
        return False
