"""A fault-injecting HTTP proxy in front of a real S3 server (moto), for tests and bench/flaky_store.py.

It forwards every request to the server and, by a seeded draw per request or by explicit rules,
answers as a flaky object store does:

    slowdown       503 SlowDown, not applied (the store asks the client to back off)
    internal       500 InternalError, not applied
    reset_before   the connection is reset before the request reaches the store (not applied)
    reset_after    the request is applied, then the connection is reset: the answer is lost
    latency        the answer comes `delay` seconds late (applied)

`down = True` is a full outage, as when a store's endpoint goes away: it stops listening (new
connections are refused) and a request on a connection already open is reset; `down = False`
listens again on the same port. Counts of requests and of each fault are kept, so a test can say
how many requests were faulted.
"""

from __future__ import annotations

import http.client
import random
import socket
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

FAULTS = ("slowdown", "internal", "reset_before", "reset_after", "latency")
_ERROR_XML = (
    '<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{message}</Message>'
    "<RequestId>fleetgen-faulty-store</RequestId></Error>"
)
_ANSWERS = {
    "slowdown": (503, "SlowDown", "Please reduce your request rate."),
    "internal": (500, "InternalError", "We encountered an internal error. Please try again."),
}
_HOP = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-length",
    "proxy-connection",
    "te",
    "trailer",
    "upgrade",
}


@dataclass
class Rule:
    """Fault the next `times` requests that match (method, a substring of the path, a header present)."""

    fault: str
    method: str | None = None
    path: str | None = None  # substring of the request path (bucket/key and query)
    header: str | None = None  # e.g. "If-None-Match": only conditional creates
    times: int = 1
    after: Rule | None = None  # active only once this other rule has fired all its times

    def matches(self, method: str, path: str, headers) -> bool:
        return (
            self.times > 0
            and (self.after is None or self.after.times == 0)
            and (self.method is None or method == self.method)
            and (self.path is None or self.path in path)
            and (self.header is None or self.header in headers)
        )


class FaultyStore:
    def __init__(self, upstream: str, seed: int = 0, delay: float = 0.5, port: int = 0):
        self.upstream = urlsplit(upstream)
        self.random = random.Random(seed)
        self.rate = 0.0  # fraction of requests faulted by the draw
        self.weights = dict.fromkeys(FAULTS, 1.0)  # relative frequency of each fault in the draw
        self.delay = delay  # seconds, for `latency`
        self._down = False
        self.rules: list[Rule] = []
        self.counts: Counter = Counter()  # "requests", each fault, "outage"
        self.log: list[tuple[str, str, str]] = []  # (fault, method, path) of every faulted request
        self._lock = threading.Lock()
        self._listen(port)  # 0: any free port
        self.port = self._server.server_address[1]

    def _listen(self, port: int) -> None:
        self._server = ThreadingHTTPServer(("127.0.0.1", port), _Handler)
        self._server.daemon_threads = True
        self._server.store = self
        self._server.handle_error = lambda *_: None  # a reset connection is the point, not an error
        self._thread = threading.Thread(target=self._server.serve_forever, name="faulty-store", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FaultyStore:
        self._thread.start()
        return self

    def stop(self) -> None:
        if not self._down:
            self.stop_listening()

    @property
    def down(self) -> bool:
        return self._down

    @down.setter
    def down(self, value: bool) -> None:
        with self._lock:
            if value == self._down:
                return
            self._down = value
        if value:
            self.stop_listening()
        else:
            self._listen(self.port)
            self.start()

    def stop_listening(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def reset(self, rate: float = 0.0, seed: int | None = None, **weights: float) -> None:
        """Faults off (or at `rate`, drawn with `weights`), rules and counts cleared."""
        self.down = False
        with self._lock:
            self.rate, self.rules = rate, []
            self.weights = {**dict.fromkeys(FAULTS, 1.0), **weights}
            self.counts, self.log = Counter(), []
            if seed is not None:
                self.random.seed(seed)

    def add_rule(self, rule: Rule) -> Rule:
        with self._lock:
            self.rules.append(rule)
        return rule

    def faulted(self) -> int:
        return sum(self.counts[f] for f in FAULTS) + self.counts["outage"]

    def _decide(self, method: str, path: str, headers) -> str | None:
        with self._lock:
            self.counts["requests"] += 1
            if self._down:
                fault = "outage"
            else:
                fault = None
                for rule in self.rules:
                    if rule.matches(method, path, headers):
                        rule.times -= 1
                        fault = rule.fault
                        break
                if fault is None and self.rate and self.random.random() < self.rate:
                    kinds = [k for k in FAULTS if self.weights.get(k)]
                    fault = self.random.choices(kinds, [self.weights[k] for k in kinds])[0]
            if fault:
                self.counts[fault] += 1
                self.log.append((fault, method, path))
            return fault


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the S3 clients use it

    def log_message(self, *args) -> None:
        pass

    def _body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            parts = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _reset(self) -> None:
        """Drop the connection with a TCP reset, as a store or a load balancer does."""
        self.close_connection = True
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
        except OSError:
            pass

    def finish(self) -> None:
        try:
            super().finish()
        except OSError:
            pass  # the connection was reset on purpose

    def _forward(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        store = self.server.store
        up = http.client.HTTPConnection(store.upstream.hostname, store.upstream.port, timeout=60)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
            headers["Content-Length"] = str(len(body))
            up.request(self.command, self.path, body=body, headers=headers)
            answer = up.getresponse()
            data = answer.read()
            return answer.status, answer.getheaders(), data
        finally:
            up.close()

    def _answer(self, status: int, headers: list[tuple[str, str]], data: bytes) -> None:
        self.send_response_only(status)
        length = None
        for k, v in headers:
            if k.lower() == "content-length":
                length = v
            elif k.lower() not in _HOP:
                self.send_header(k, v)
        # A HEAD answer says the object's length and carries no body.
        self.send_header("Content-Length", length if self.command == "HEAD" and length else str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _handle(self) -> None:
        store = self.server.store
        body = self._body()
        fault = store._decide(self.command, self.path, self.headers)
        if fault in ("outage", "reset_before"):
            return self._reset()
        if fault in _ANSWERS:
            status, code, message = _ANSWERS[fault]
            data = _ERROR_XML.format(code=code, message=message).encode()
            return self._answer(status, [("Content-Type", "application/xml")], data)
        status, headers, data = self._forward(body)
        if fault == "reset_after":
            return self._reset()
        if fault == "latency":
            time.sleep(store.delay)
        self._answer(status, headers, data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle
