"""Addresses handed to engines: routable from the engines' hosts (issue: cluster-ready)."""

import socket

import pytest

from skyrl_mega.ports import ADVERTISE_ENV, address_reaching


def own_ipv4() -> str | None:
    """A non-loopback IPv4 address of this host (the one its default route uses), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: routed, never sent to
            return s.getsockname()[0]
        except OSError:
            return None


def test_local_engines_get_loopback(monkeypatch):
    monkeypatch.delenv(ADVERTISE_ENV, raising=False)
    assert address_reaching(["http://127.0.0.1:8000", "http://localhost:8001/"]) == "127.0.0.1"
    assert address_reaching([]) == "127.0.0.1"


def test_a_remote_engine_gets_this_hosts_routable_address(monkeypatch):
    """Before: the transfer group's address was 127.0.0.1 whatever the engines' hosts, so an
    engine on another node was sent to connect to itself."""
    monkeypatch.delenv(ADVERTISE_ENV, raising=False)
    own = own_ipv4()
    if own is None:
        pytest.skip("this host has no routed IPv4 interface")
    got = address_reaching(["http://127.0.0.1:8000", "http://192.0.2.7:8000"])
    assert got == own and got != "127.0.0.1"
    with socket.socket() as s:  # an address of this host: a listener can bind it
        s.bind((got, 0))


def test_the_transfer_group_advertises_it(monkeypatch):
    """The disaggregated transport (NCCL broadcast; gloo on CPU) sends engines this address."""
    from skyrl_mega.rollout.control import EngineControl
    from skyrl_mega.weight_sync.transports.nccl import NcclBroadcastTransport

    monkeypatch.setenv(ADVERTISE_ENV, "10.9.8.7")
    remote = NcclBroadcastTransport(EngineControl(["http://10.0.0.5:8000"]), device="cpu")
    assert remote.master_address == "10.9.8.7"
    monkeypatch.delenv(ADVERTISE_ENV)
    local = NcclBroadcastTransport(EngineControl(["http://127.0.0.1:8000"]), device="cpu")
    assert local.master_address == "127.0.0.1"
