"""A fault-injecting HTTP proxy in front of a real object store's server — S3 (moto), GCS
(fake-gcs-server), Azure Blob (Azurite) — for tests and bench/flaky_store.py.

It forwards every request to the server and, by a seeded draw per request or by explicit rules,
answers as a flaky object store does:

    slowdown       503 SlowDown, not applied (the store asks the client to back off)
    internal       500 InternalError, not applied
    reset_before   the connection is reset before the request reaches the store (not applied)
    reset_after    the request is applied, then the connection is reset: the answer is lost
    latency        the answer comes `delay` seconds late (applied)
    denied         (by rule only) the store refuses the caller's credentials: 401/403 in its dialect

Error answers are written in the store's own dialect (`dialect`: S3's XML, GCS's JSON, Azure's XML
with its `x-ms-error-code` header), as its client expects to parse them.

`down = True` is a full outage, as when a store's endpoint goes away: it stops listening (new
connections are refused) and a request on a connection already open is reset; `down = False`
listens again on the same port. Counts of requests and of each fault are kept, so a test can say
how many requests were faulted.
"""

from __future__ import annotations

import http.client
import json
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
# (status, code, message) per fault and dialect, as each store answers it (S3: SlowDown / InternalError;
# GCS: 503 / 500 with a JSON error; Azure: ServerBusy / InternalError).
_ANSWERS = {
    "s3": {
        "denied": (403, "AccessDenied", "Access Denied"),
        "slowdown": (503, "SlowDown", "Please reduce your request rate."),
        "internal": (500, "InternalError", "We encountered an internal error. Please try again."),
    },
    "gcs": {
        "denied": (401, "required", "Anonymous caller does not have storage.objects.list access to the bucket."),
        "slowdown": (503, "backendError", "We encountered an internal error. Please try again."),
        "internal": (500, "backendError", "Backend Error"),
    },
    "azure": {
        "denied": (403, "AuthenticationFailed", "Server failed to authenticate the request."),
        "slowdown": (503, "ServerBusy", "The server is currently unable to receive requests. Please retry."),
        "internal": (500, "InternalError", "The server encountered an internal error. Please retry the request."),
    },
}


def error_answer(dialect: str, status: int, code: str, message: str) -> tuple[list[tuple[str, str]], bytes]:
    """(headers, body) of an error answer as the store `dialect` writes it."""
    if dialect == "gcs":
        body = {"error": {"code": status, "message": message, "errors": [{"reason": code, "message": message}]}}
        return [("Content-Type", "application/json; charset=UTF-8")], json.dumps(body).encode()
    headers = [("Content-Type", "application/xml")]
    if dialect == "azure":
        headers.append(("x-ms-error-code", code))
    return headers, _ERROR_XML.format(code=code, message=message).encode()


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
    path: str | tuple[str, ...] | None = None  # substring(s) of the request path (bucket/key and query), all present
    header: str | None = None  # e.g. "If-None-Match": only conditional creates
    body: str | None = None  # substring of the request body (GCS names an upload's key in its JSON part)
    times: int = 1
    after: Rule | None = None  # active only once this other rule has fired all its times

    def matches(self, method: str, path: str, headers, body: bytes = b"") -> bool:
        return (
            self.times > 0
            and (self.after is None or self.after.times == 0)
            and (self.method is None or method == self.method)
            and (
                self.path is None or all(p in path for p in ((self.path,) if isinstance(self.path, str) else self.path))
            )
            and (self.header is None or self.header in headers)
            and (self.body is None or self.body.encode() in body)
        )


class FaultyStore:
    def __init__(self, upstream: str, seed: int = 0, delay: float = 0.5, port: int = 0, dialect: str = "s3"):
        self.upstream = urlsplit(upstream)
        self.dialect = dialect
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

    def _decide(self, method: str, path: str, headers, body: bytes = b"") -> str | None:
        with self._lock:
            self.counts["requests"] += 1
            if self._down:
                fault = "outage"
            else:
                fault = None
                for rule in self.rules:
                    if rule.matches(method, path, headers, body):
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
        fault = store._decide(self.command, self.path, self.headers, body)
        if fault in ("outage", "reset_before"):
            return self._reset()
        answers = _ANSWERS[store.dialect]
        if fault in answers:
            status, code, message = answers[fault]
            return self._answer(status, *error_answer(store.dialect, status, code, message))
        status, headers, data = self._forward(body)
        if fault == "reset_after":
            return self._reset()
        if fault == "latency":
            time.sleep(store.delay)
        self._answer(status, headers, data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _handle
