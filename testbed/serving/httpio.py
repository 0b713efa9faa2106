"""What the router's and the workers' HTTP servers share: reading a request's JSON body, and the server.

`read_json_body` takes exactly ``Content-Length`` bytes of JSON within the handler's ``timeout`` and
raises `BodyError` (a `FieldError` naming ``Content-Length``, ``Transfer-Encoding``, ``body`` or a key given
twice, with the HTTP status to answer) for anything else, so bad bytes on the wire get one line, never a
traceback or a thread left waiting. `RequestHandler` gives a request's line, headers and body that timeout in
all, not per read (`_DeadlineReader`). `json_value` is the one reader of JSON that comes over HTTP: the
bodies, and the router's reading of the workers' answers. `Server` is a threading HTTP server that does not
print a traceback for a client that hung up. See docs/router.md "HTTP API" and docs/protocol.md.
"""

from __future__ import annotations

import io
import json
import socket
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from testbed.errors import FieldError

MAX_BODY_BYTES = 64 << 20  # a request body above this is refused (413) before any of it is read
NESTED_TOO_DEEPLY = "JSON nested too deeply"


class BodyError(FieldError):
    """A request body that is not exactly its Content-Length of JSON; `status` is the HTTP answer."""

    def __init__(self, field: str, message: str, status: int = 400) -> None:
        super().__init__(field, message)
        self.status = status


class RepeatedKey(ValueError):
    """A JSON object that gives one key twice (`json.loads` kept the last, silently)."""

    def __init__(self, key: str) -> None:
        super().__init__(f"key {key!r} is given twice in one object; give it once")
        self.key = key


def _one_value_per_key(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise RepeatedKey(key)
        out[key] = value
    return out


def json_value(data: bytes | str) -> Any:
    """JSON that came over HTTP, read; anything else is a ValueError: invalid JSON, bytes that are not UTF-8, a whole
    number past the digits Python reads, a key given twice in one object (`RepeatedKey`: ``{"max_tokens": 1,
    "max_tokens": 99}`` was served with 99, the first dropped without a word), or data nested deeper than Python's
    recursion limit (a RecursionError, which no reader caught: a worker's `/v1/state` of 100,000 brackets ended the
    router's state polls for the rest of the run). ``NaN`` and ``Infinity`` read as floats; each field's reader
    refuses them where it needs a number."""
    try:
        return json.loads(data, object_pairs_hook=_one_value_per_key)
    except RecursionError:
        raise ValueError(NESTED_TOO_DEEPLY) from None


def read_json_body(handler: BaseHTTPRequestHandler, max_bytes: int = MAX_BODY_BYTES) -> Any:
    """The request's JSON body (None when it has none), read within what is left of `handler.timeout` (a
    `RequestHandler`'s request line, headers and body share it); the connection's timeout is lifted afterwards (the
    answer may take as long as the request does)."""
    if handler.headers.get("Transfer-Encoding"):
        raise BodyError("Transfer-Encoding", "is not supported; send the body with a Content-Length", 411)
    given = handler.headers.get_all("Content-Length") or []
    if len(given) > 1:  # the first one won: a proxy that read the other would see another body (request smuggling)
        raise BodyError("Content-Length", f"given {len(given)} times; give it once")
    raw = (given[0] if given else "0").strip()
    if not (raw.isascii() and raw.isdigit()):
        raise BodyError("Content-Length", f"{raw!r} is not a whole number of bytes >= 0")
    n = int(raw)
    if n > max_bytes:
        raise BodyError("Content-Length", f"{n} bytes is above the limit of {max_bytes}", 413)
    try:
        data = handler.rfile.read(n)
    except TimeoutError:
        raise BodyError("body", f"the {n} bytes of Content-Length did not arrive within {handler.timeout} s") from None
    finally:
        if isinstance(handler, RequestHandler):
            handler.lift_deadline()
        else:
            handler.connection.settimeout(None)
    if len(data) < n:
        raise BodyError("body", f"Content-Length says {n} bytes but the body ended after {len(data)}")
    try:
        return json_value(data) if data else None
    except RepeatedKey as exc:
        raise BodyError(exc.key, "is given twice in one object; give it once") from None
    except ValueError as exc:
        raise BodyError("body", NESTED_TOO_DEEPLY if str(exc) == NESTED_TOO_DEEPLY else f"not valid JSON: {exc}") from None


class _DeadlineReader(io.RawIOBase):
    """A connection's reads, each given only what is left of the request's time (`deadline_s`, on the monotonic clock;
    None: no bound). A socket timeout bounds one read: a client that sent a byte of its headers or body every
    `timeout` - 1 s held a server thread for as long as it liked (the 100 headers of 64 KiB the stdlib takes, at a
    byte each, are 6.5 million reads)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.deadline_s: float | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self.deadline_s is None:
            return self.sock.recv_into(buffer)
        left = self.deadline_s - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        timeout = self.sock.gettimeout()  # what the answer's writes are given: the handler's
        self.sock.settimeout(left if timeout is None else min(left, timeout))
        try:
            return self.sock.recv_into(buffer)
        finally:
            self.sock.settimeout(timeout)


class RequestHandler(BaseHTTPRequestHandler):
    """The router's and the workers' handler base: each request of a kept-alive connection -- the wait for it, its
    request line, headers and body -- is read within `timeout` in all, from the moment the handler waits for it
    (`_DeadlineReader`; until 2026-12-07 `timeout` bounded each read, and a byte every few seconds held the thread).
    `read_json_body` lifts it for the answer, which may take as long as the request does; the next request's wait
    gets it again (it had none, and an idle keep-alive client held a server thread for good). Headers that do not
    arrive in time end the connection without an answer, as the stdlib's handler ends them."""

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the stdlib's reader: ours bounds the request's reads together
        self._reader = _DeadlineReader(self.connection)
        self.rfile = io.BufferedReader(self._reader)

    def handle_one_request(self) -> None:
        self.connection.settimeout(self.timeout)
        self._reader.deadline_s = time.monotonic() + self.timeout if self.timeout is not None else None
        super().handle_one_request()

    def lift_deadline(self) -> None:
        """The request is read: its answer may take as long as the request does."""
        self._reader.deadline_s = None
        self.connection.settimeout(None)


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # the default backlog of 5 resets clients (drops SYNs) when a burst arrives at once

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hung up (before its answer, mid-request) is the client's business: no traceback."""
        if isinstance(sys.exc_info()[1], ConnectionError):  # BrokenPipe, ConnectionReset, ConnectionAborted
            return
        super().handle_error(request, client_address)


class HangupWatch:
    """Notices a client that hangs up while its answer is still being prepared, as an ASGI server tells vLLM's
    API server that a request is disconnected: one thread polls every watched connection (`selectors`) and
    calls its `on_hangup` once the client has closed or reset it. A client that sends anything instead (HTTP
    pipelining) is left alone from then on: only an end of stream says it went away. The router watches a
    streaming completion's connection until its first token (docs/router.md, "A client that goes away")."""

    POLL_S = 0.05  # how often the watch re-reads what it watches (a connection added meanwhile waits at most this)

    def __init__(self) -> None:
        import selectors
        import threading

        self._sel = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hangup-watch", daemon=True)  # started by the first watch

    def watch(self, sock: socket.socket, on_hangup: Any) -> None:
        import selectors

        with self._lock:
            if not self._thread.is_alive() and not self._stop.is_set():
                self._thread.start()
            try:
                self._sel.register(sock, selectors.EVENT_READ, on_hangup)
            except (KeyError, ValueError, OSError):  # already watched, or closed meanwhile
                pass

    def unwatch(self, sock: socket.socket) -> None:
        with self._lock:
            try:
                self._sel.unregister(sock)
            except (KeyError, ValueError, OSError):
                pass

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=1.0)
        with self._lock:
            self._sel.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                if not self._sel.get_map():
                    ready = []
                else:
                    ready = self._sel.select(0)
            spurious = 0
            for key, _ in ready:
                sock = key.fileobj
                try:
                    gone = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
                except BlockingIOError:  # readable a moment ago, nothing now
                    spurious += 1
                    continue
                except OSError:  # reset
                    gone = True
                self.unwatch(sock)
                if gone:
                    try:
                        key.data()
                    except Exception as exc:  # one callback's fault must not end the watch of every other connection
                        print(f"hangup watch: {type(exc).__name__}: {exc}", file=sys.stderr)
            if spurious == len(ready):  # nothing to do (no connection, or none readable for good): wait
                self._stop.wait(self.POLL_S)
