"""Free ports: one the kernel gives is bindable, `avoid` is honoured, a bound port is not free."""
import socket

from megarl.net import free_port, port_is_free


def test_free_port_is_bindable_on_its_host_and_avoids_ports():
    port = free_port("127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        busy = s.getsockname()[1]
        assert free_port("", avoid=(busy,)) != busy


def test_a_bound_port_is_not_free():
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
        assert not port_is_free(port)
        assert not port_is_free(port, "127.0.0.1")
