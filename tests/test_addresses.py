"""One loopback check and one host:port split (areal_pipeline/config/addresses.py), by hand-written cases: the union
of what the configuration's rules and the trainer nodes each called loopback before they shared the check."""

import re

import pytest

from areal_pipeline.config import ConfigError
from areal_pipeline.config.addresses import is_loopback, split_address, weight_group_master
from areal_pipeline.run_spec import load_config


@pytest.mark.parametrize("host", [
    "127.0.0.1", "127.1.2.3", "127.255.255.254",  # all of 127.0.0.0/8
    "localhost", "LocalHost", "ip6-localhost", "ip6-loopback",  # the hosts file's names, in any case
    "::1", "[::1]", "0:0:0:0:0:0:0:1", "::ffff:127.0.0.1",  # IPv6, bracketed as in an address, IPv4-mapped
])
def test_loopback_hosts(host):
    assert is_loopback(host)


@pytest.mark.parametrize("host", [
    "", "0.0.0.0", "::",  # the wildcard listens everywhere: not loopback
    "10.0.0.1", "128.0.0.1", "::2", "fe80::1",
    "gen", "train-a", "127.example.com", "localhost.example.com", "my-localhost",  # names are not resolved
])
def test_other_hosts(host):
    assert not is_loopback(host)


@pytest.mark.parametrize("address, expected", [
    ("gen:30000", ("gen", 30000)),
    ("10.0.0.5:0", ("10.0.0.5", 0)),
    ("train-a.example.com:65535", ("train-a.example.com", 65535)),
    ("[::1]:8000", ("::1", 8000)),  # bracketed IPv6
    ("::1:8000", ("::1", 8000)),  # bare IPv6 as a node announces the address it bound: the port after the last colon
    ("fe80::1%eth0:29400", ("fe80::1%eth0", 29400)),
])
def test_split_address(address, expected):
    assert split_address(address) == expected


@pytest.mark.parametrize("address", ["gen", "gen:", ":8000", "gen:http", "gen:70000", "gen:-1", "[::1]", "::1",
                                     "a]:1", "gen:８０"])
def test_a_malformed_address_is_named(address):
    with pytest.raises(ValueError, match=re.escape(f"address {address!r}")):
        split_address(address)


def test_the_config_takes_host_port_by_the_same_split():
    with pytest.raises(ConfigError, match=r"trainer.rdzv_endpoint='train-a:99999': must be empty or host:port"):
        load_config(None, ["trainer.rdzv_endpoint=train-a:99999"])
    with pytest.raises(ConfigError, match=r"inference.addresses=\['gen:1', 'gen'\]: must be a list of distinct"):
        load_config(None, ["inference.addresses=[gen:1,gen]"])


def test_the_configs_host_rules_call_every_loopback_name_loopback():
    """ip6-localhost was loopback to the trainer nodes but not to the rules, which let two trainer nodes meet at a
    rendezvous on it that the second node cannot reach."""
    with pytest.raises(ConfigError, match=r"trainer.rdzv_endpoint='ip6-localhost:29400': 2 trainer nodes meet"):
        load_config(None, ["trainer.nnodes=2", "trainer.address=auto", "trainer.rdzv_endpoint=ip6-localhost:29400",
                           "output_dir=/shared/runs"])


@pytest.mark.parametrize("configured, trainer, expected", [
    ("10.1.2.1", "", "10.1.2.1"), ("10.1.2.1", "auto", "10.1.2.1"),  # the configured one wins
    ("", "", "127.0.0.1"),  # a trainer the run launches
    ("", "auto", ""),  # announced once it runs
    ("", "10.0.0.3:8000", "10.0.0.3"), ("", "[::1]:8000", "::1"),
])
def test_the_weight_groups_master(configured, trainer, expected):
    assert weight_group_master(configured, trainer) == expected


def test_a_trainer_on_loopback_is_no_master_for_servers_on_other_hosts():
    """The rules read the master as the launcher and the push do: a trainer at 127.0.0.1:P (started by hand on this
    host) was accepted as a master for servers on other hosts, which then cannot reach it."""
    shared = ["inference.addresses=[10.1.2.3:30000]", "trainer.weight_sync=distributed", "trainer.port=8000"]
    with pytest.raises(ConfigError, match=re.escape("trainer.weight_sync_master_address='' (the host of "
                                                    "trainer.address='127.0.0.1:8000'): servers on other hosts")):
        load_config(None, [*shared, "trainer.address=127.0.0.1:8000"])
    load_config(None, [*shared, "trainer.address=127.0.0.1:8000", "trainer.weight_sync_master_address=10.1.2.1"])
