"""TCP ports and addresses for servers, routers, rendezvous and transfer groups: the project's one place.

In: how many ports, the host to bind; or the URLs of the engines that must connect back.
Out: port numbers the OS handed out a moment ago; `address_reaching(urls)`: this host's address
as the engines at those URLs can reach it (the weight-transfer group's rendezvous address).
`free_ports(n)` holds all sockets open while the OS picks, so the n ports are distinct
(two separate free_port() calls can return the same port: seen in CI as a router whose HTTP
and Prometheus ports collided).
"""

from __future__ import annotations

import ipaddress
import os
import socket
from urllib.parse import urlsplit

ADVERTISE_ENV = "SKYRL_ADVERTISE_ADDR"  # overrides address_reaching (a multi-homed host, NAT)


def free_ports(n: int, host: str = "127.0.0.1", exclude=()) -> list[int]:
    """`n` distinct TCP ports, none in `exclude`, that were free a moment ago."""
    socks, ports = [], []
    try:
        while len(ports) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((host, 0))
            p = s.getsockname()[1]
            if p not in exclude:
                ports.append(p)
        return ports
    finally:
        for s in socks:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    """One TCP port that was free a moment ago."""
    return free_ports(1, host)[0]


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could listen on `port` now (with SO_REUSEADDR, as uvicorn binds:
    connections of a dead server in TIME_WAIT do not block it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except OSError:
            return False


def is_this_host(host: str) -> bool:
    """True when `host` names this machine: loopback, or an address of one of its interfaces."""
    if is_loopback(host):
        return True
    try:
        ip = socket.gethostbyname(host)
    except OSError:
        return False
    import psutil

    return any(a.address == ip for addrs in psutil.net_if_addrs().values() for a in addrs)


def remote_hosts(urls) -> list[str]:
    """The hosts of `urls` that are not this machine, in order, once each."""
    hosts = [urlsplit(u).hostname or "" for u in urls]
    return list(dict.fromkeys(h for h in hosts if not is_this_host(h)))


def address_reaching(urls) -> str:
    """This host's IPv4 address that the hosts of `urls` can connect back to: 127.0.0.1 when
    every one of them is this host's loopback, else the source address the OS routes to the
    first remote one with (a UDP socket's connect: nothing is sent). $SKYRL_ADVERTISE_ADDR wins."""
    if os.environ.get(ADVERTISE_ENV):
        return os.environ[ADVERTISE_ENV]
    remote = [h for h in (urlsplit(u).hostname or "" for u in urls) if not is_loopback(h)]
    if not remote:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((socket.gethostbyname(remote[0]), 9))
            return s.getsockname()[0]
        except OSError as e:
            raise OSError(f"no route from this host to the engine host {remote[0]} ({e}); set "
                          f"{ADVERTISE_ENV} to this host's address the engines can reach") from e
