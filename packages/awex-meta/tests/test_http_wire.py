"""The MetaServer connection (``awex.meta.http_wire``): a request leaves in one packet; answers with a length,
chunked, or running to the close are read whole; a connection closed while idle raises what the client retries on;
a malformed answer raises, never returns half of one."""

from __future__ import annotations

import http.client
import socket
import threading

import pytest

from awex.meta.http_wire import MAX_HEAD, Connection


def _serving(answers: list[bytes]):
    """A server on a loopback port that reads one request per answer, sends it (closing after the last), and
    keeps each request's bytes as they arrived, packet by packet."""
    listener = socket.create_server(("127.0.0.1", 0))
    packets: list[list[bytes]] = []

    def run():
        conn, _ = listener.accept()
        with conn:
            for answer in answers:
                got = [conn.recv(65536)]
                while b"\r\n\r\n" not in b"".join(got):
                    got.append(conn.recv(65536))
                packets.append(got)
                conn.sendall(answer)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return listener.getsockname()[1], packets, thread, listener


def test_a_request_leaves_whole_and_answers_of_every_framing_are_read():
    answers = [
        b'HTTP/1.1 200 OK\r\nContent-Length: 7\r\nX-Awex-Epoch: e1\r\n\r\n{"a":1}',
        b'HTTP/1.1 409 Conflict\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n{"b\r\n4\r\n":2}\r\n0\r\n\r\n',
        b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n[1,2]",
    ]
    port, packets, thread, listener = _serving(answers)
    conn = Connection("127.0.0.1", port, 5.0)
    conn.request("PUT", "/v1/x", b'{"v":1}', {"Accept": "application/json"})
    first = conn.getresponse()
    assert (first.status, first.body, first.headers["x-awex-epoch"], first.will_close) == (200, b'{"a":1}', "e1", False)
    assert len(packets[0]) == 1 and packets[0][0].endswith(b'\r\n\r\n{"v":1}')  # headers and body in one packet
    assert b"Content-Length: 7\r\n" in packets[0][0] and b"Host: 127.0.0.1:" in packets[0][0]
    conn.request("GET", "/v1/y", None, {})
    second = conn.getresponse()
    assert (second.status, second.body) == (409, b'{"b":2}')
    conn.request("GET", "/v1/z", None, {})
    third = conn.getresponse()
    assert (third.body, third.will_close) == (b"[1,2]", True)
    conn.close()
    thread.join(5)
    listener.close()


def test_a_connection_closed_while_idle_raises_what_the_client_retries_on():
    port, _, thread, listener = _serving([])  # accepts, then closes
    conn = Connection("127.0.0.1", port, 5.0)
    conn.request("GET", "/v1/health", None, {})
    thread.join(5)
    with pytest.raises((http.client.RemoteDisconnected, ConnectionResetError)):  # closed, or reset (request unread)
        conn.getresponse()
    listener.close()


@pytest.mark.parametrize(
    "answer",
    [
        b"SPDY/9 200 OK\r\n\r\n",
        b"HTTP/1.1 2x0 OK\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: -3\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
        b"HTTP/1.1 200 OK\r\nX-Big: " + b"x" * (MAX_HEAD + 10),
    ],
    ids=["protocol", "status", "header", "length", "chunk", "cut-short", "huge-head"],
)
def test_a_malformed_answer_raises(answer):
    port, _, thread, listener = _serving([answer])
    conn = Connection("127.0.0.1", port, 5.0)
    conn.request("GET", "/v1/health", None, {})
    with pytest.raises(http.client.HTTPException):
        conn.getresponse()
    conn.close()
    thread.join(5)
    listener.close()
