"""What the router's and the workers' HTTP servers share: reading a request's JSON body, and the server.

`read_json_body` takes exactly ``Content-Length`` bytes of JSON within the handler's ``timeout`` and
raises `BodyError` (a `FieldError` naming ``Content-Length``, ``Transfer-Encoding`` or ``body``, with the
HTTP status to answer) for anything else, so bad bytes on the wire get one line, never a traceback or a
thread left waiting. `Server` is a threading HTTP server that does not print a traceback for a client
that hung up. See docs/router.md "HTTP API" and docs/protocol.md.
"""

from __future__ import annotations

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from testbed.errors import FieldError

MAX_BODY_BYTES = 64 << 20  # a request body above this is refused (413) before any of it is read


class BodyError(FieldError):
    """A request body that is not exactly its Content-Length of JSON; `status` is the HTTP answer."""

    def __init__(self, field: str, message: str, status: int = 400) -> None:
        super().__init__(field, message)
        self.status = status


def read_json_body(handler: BaseHTTPRequestHandler, max_bytes: int = MAX_BODY_BYTES) -> Any:
    """The request's JSON body (None when it has none), read within `handler.timeout`; the connection's
    timeout is lifted afterwards (the answer may take as long as the request does)."""
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
        handler.connection.settimeout(None)
    if len(data) < n:
        raise BodyError("body", f"Content-Length says {n} bytes but the body ended after {len(data)}")
    try:
        return json.loads(data) if data else None
    except ValueError as exc:
        raise BodyError("body", f"not valid JSON: {exc}") from None
    except RecursionError:
        raise BodyError("body", "JSON nested too deeply") from None


class RequestHandler(BaseHTTPRequestHandler):
    """The router's and the workers' handler base: each request of a kept-alive connection is read within `timeout`
    again (`read_json_body` lifts it for the answer, which may take as long as the request does; the next request's
    wait then had none, and an idle keep-alive client held a server thread for good)."""

    def handle_one_request(self) -> None:
        self.connection.settimeout(self.timeout)
        super().handle_one_request()


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # the default backlog of 5 resets clients (drops SYNs) when a burst arrives at once

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hung up (before its answer, mid-request) is the client's business: no traceback."""
        if isinstance(sys.exc_info()[1], ConnectionError):  # BrokenPipe, ConnectionReset, ConnectionAborted
            return
        super().handle_error(request, client_address)
