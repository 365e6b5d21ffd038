"""`ServerControl`'s connections: the calls of a process to one server share a kept-alive
connection, one idle for longer than `REUSE_IDLE_S` is not used again, one the server closed is
replaced without failing a call, and a server that went away fails the next call at once, named.
The oracle is the server's side: a plain HTTP/1.1 server (the standard library's) that answers
each request with the client port it came from."""
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megarl.rollout import control
from megarl.rollout.control import ServerControl, ServerError


class PortEcho(BaseHTTPRequestHandler):
    """Answers every request with `{"port": <the client's port>}`; keeps the connection open
    (HTTP/1.1) unless the server's `close_after_answer` is set, then closes it after answering
    without saying so, as a server whose keep-alive timeout ran out does."""

    protocol_version = "HTTP/1.1"

    def do_GET(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.requests.append((self.path, self.client_address[1]))
        if self.server.close_unanswered > 0:  # close without a byte of answer, as a server does racing a request
            self.server.close_unanswered -= 1
            self.close_connection = True
            return
        body = json.dumps({"port": self.client_address[1], "path": self.path}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = self.server.close_after_answer

    do_POST = do_GET

    def log_message(self, *args):  # quiet
        pass


@pytest.fixture
def echo():
    """(server, url): a running PortEcho server on a free port, shut down after the test."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), PortEcho)
    server.daemon_threads = True
    server.close_after_answer = False
    server.close_unanswered = 0  # the number of requests to come that get no answer
    server.requests = []  # (path, client port) of each request it read
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(10)


def port(server: ServerControl) -> int:
    return server._call("GET", "/model_info")["port"]


def test_calls_to_one_server_share_one_connection(echo):
    _, url = echo
    first = ServerControl(url, timeout_s=10)
    ports = [port(first), port(first), first._call("POST", "/flush_cache", {})["port"]]
    ports.append(port(ServerControl(url, api_key="k", timeout_s=10)))  # another object, same process and server
    assert len(set(ports)) == 1, ports


def test_a_connection_idle_for_longer_than_the_bound_is_not_used_again(echo, monkeypatch):
    _, url = echo
    monkeypatch.setattr(control, "REUSE_IDLE_S", 0.2)
    server = ServerControl(url, timeout_s=10)
    before = port(server)
    assert port(server) == before  # within the bound
    time.sleep(0.4)
    assert port(server) != before


def test_a_connection_the_server_closed_is_replaced_without_a_failed_call(echo):
    httpd, url = echo
    server = ServerControl(url, timeout_s=10)
    httpd.close_after_answer = True
    ports = [port(server) for _ in range(3)]  # each call finds its predecessor's connection closed
    assert len(set(ports)) == 3, ports


def test_a_kept_connection_closed_unanswered_is_sent_again_once_on_a_new_one(echo):
    """The kept-connection race made deterministic: the server closes the kept connection instead of
    answering; the call goes out again once on a new connection and succeeds."""
    httpd, url = echo
    server = ServerControl(url, timeout_s=10)
    kept = port(server)
    httpd.close_unanswered = 1
    answered_on = server._call("POST", "/flush_cache", {})["port"]
    assert [p for _, p in httpd.requests] == [kept, kept, answered_on] and answered_on != kept


def test_a_new_connection_closed_unanswered_is_not_sent_again(echo):
    """On a connection opened for the call, no answer is a failure of the call: not retried."""
    httpd, url = echo
    httpd.close_unanswered = 1
    with pytest.raises(ServerError, match=r"RemoteDisconnected"):
        ServerControl(url, timeout_s=10)._call("POST", "/flush_cache", {})
    assert len(httpd.requests) == 1


def test_a_kept_connection_closed_unanswered_twice_fails_the_call(echo):
    """One more try only: a server that closes the new connection unanswered too fails the call."""
    httpd, url = echo
    server = ServerControl(url, timeout_s=10)
    port(server)
    httpd.close_unanswered = 2
    with pytest.raises(ServerError, match=r"RemoteDisconnected"):
        server._call("POST", "/flush_cache", {})
    assert len(httpd.requests) == 3


def test_a_server_gone_after_a_call_fails_the_next_one_at_once_naming_it(echo):
    httpd, url = echo
    server = ServerControl(url, timeout_s=30)
    httpd.close_after_answer = True  # the kept connection goes with the server, as when its process ends
    port(server)
    httpd.shutdown()
    httpd.server_close()
    started = time.monotonic()
    with pytest.raises(ServerError, match=rf"^{url}/model_info: "):
        port(server)
    assert time.monotonic() - started < 5  # refused, not waited out (the call's bound is 30 s)
    assert not server.health(timeout_s=5)


def test_a_path_in_the_url_prefixes_every_endpoint(echo):
    _, url = echo
    assert ServerControl(url + "/prefix/", timeout_s=10)._call("GET", "/model_info")["path"] == "/prefix/model_info"
