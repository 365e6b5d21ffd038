"""Free TCP ports: the one place megarl asks the kernel for a port. It imports nothing of megarl
(and no Ray), so every package may use it.

`host` is the address to bind: "" means every interface (a port other nodes will connect to),
"127.0.0.1" this machine only.
"""
from __future__ import annotations

import socket
from collections.abc import Collection


def free_port(host: str, avoid: Collection[int] = ()) -> int:
    """A TCP port that was free on `host` a moment ago and is not in `avoid`. The kernel picks it
    from its ephemeral range (above Ray's worker ports 10002-19999, where a GCS port would collide
    with Ray's own workers)."""
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in avoid:
            return port


def port_is_free(port: int, host: str = "") -> bool:
    """Whether `port` can be bound on `host` right now (default: on every interface)."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
