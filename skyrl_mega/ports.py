"""TCP ports for servers, routers, rendezvous and transfer groups: the project's one place.

In: how many ports, the host to bind. Out: port numbers the OS handed out a moment ago.
`free_ports(n)` holds all sockets open while the OS picks, so the n ports are distinct
(two separate free_port() calls can return the same port: seen in CI as a router whose HTTP
and Prometheus ports collided).
"""

from __future__ import annotations

import socket


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
