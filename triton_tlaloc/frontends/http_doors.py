"""The doors every request to `tlaloc openai` passes before a route sees it, outermost first:

    Host header     TrustedHostMiddleware: bound to a loopback address, only the loopback names
                    are accepted (400 otherwise), so a web page whose name an attacker points at
                    127.0.0.1 (DNS rebinding) cannot reach the server from a local browser
    CORS            CORSMiddleware, only when origins are configured: none by default
    API key         ApiKeyDoor: `Authorization: Bearer KEY` or 401, on every route
    body            BodyDoor: 413 for a body over the limit (by Content-Length before reading,
                    or while reading a chunked one), 415 unless it is JSON, 408 for a body not
                    all come within its deadline

and below them all, in uvicorn's HTTP protocol (guarded_h11_protocol), a deadline for a
request's headers: a client that sends them a byte at a time (slowloris) is cut off, where
uvicorn alone would wait for ever.

and, inside the generation routes, GenerationSlots: 429 for a generation over the most in
flight, and parse_body with its typed fields: 400 naming what is wrong with a body that is not
a JSON object or holds a field of the wrong type. Every refusal but the Host header's answers
with OpenAI's error object.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import math
import threading
from typing import Callable

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# The Host header's names for this machine, as a local browser or client sends them (the port
# is not compared; an IPv6 literal comes in brackets).
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


def error_response(status: int, message: str, kind: str = "invalid_request_error",
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """OpenAI's error object; `code` is the HTTP status."""
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}},
                        status_code=status, headers=headers)


class APIError(Exception):
    """A request the server refuses: answered with OpenAI's error object and `status`."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.headers = status, message, kind, headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.kind, self.headers)

    def payload(self) -> dict:
        """The error as the event of a stream already answered with 200."""
        return {"error": {"message": self.message, "type": self.kind, "code": self.status}}


# ------------------------------------------------------------------ Host header

def is_loopback(host: str) -> bool:
    """Whether binding `host` serves this machine only (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def default_allowed_hosts(bind_host: str) -> tuple[str, ...]:
    """The Host headers accepted when bound to `bind_host` and none are configured: the
    loopback names (and the bound address itself) on a loopback address; any elsewhere."""
    if not is_loopback(bind_host):
        return ("*",)
    return tuple(dict.fromkeys(LOOPBACK_HOSTS + (bind_host.lower(),)))


# ------------------------------------------------------------------ API key

class ApiKeyDoor:
    """401 for an HTTP request whose Authorization header is not `Bearer KEY`. The key is
    compared in constant time (hmac.compare_digest), so the time of a refusal tells nothing of
    how much of a guess was right."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self._key = api_key.encode()

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.strip().partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(),
                                                                            self._key)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self._authorized(scope):
            refusal = error_response(401, "a missing or wrong API key: send the header "
                                     "`Authorization: Bearer KEY`", "authentication_error",
                                     {"WWW-Authenticate": "Bearer"})
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)


# ------------------------------------------------------------------ body

class _TooLarge(Exception):
    pass


class _ClientGone(Exception):
    pass


class BodyDoor:
    """For a request with a body (every method but GET, HEAD and OPTIONS): 413 when its
    Content-Length is over `max_bytes`, before reading it, or as soon as a chunked body read
    passes it; 415 unless its Content-Type is application/json (with any parameters); 408 when
    it has not all come `timeout_s` after its headers (a client dribbling its body a byte at a
    time would otherwise hold its connection for ever). A JSON Content-Type is what a web page
    cannot send another origin without a CORS preflight: a "simple" text/plain form post from a
    page in a local browser starts no generation.

    The body is read here, whole, and handed to the app as one message; later calls to
    `receive` go to the server's, so the app still sees the client disconnect."""

    BODILESS = ("GET", "HEAD", "OPTIONS")

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float = 60.0):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    def _refusal_by_headers(self, headers: Headers) -> APIError | None:
        length = headers.get("content-length")
        if length is not None:
            try:
                length_value = int(length)
            except ValueError:
                return APIError(400, f"Content-Length {length!r}: not a number")
            if length_value > self.max_bytes:
                return self._too_large()
        media_type = headers.get("content-type", "").split(";")[0].strip().lower()
        if media_type != "application/json":
            return APIError(415, f"Content-Type {media_type or '(none)'!r}: send "
                                 f"application/json")
        return None

    def _too_large(self) -> APIError:
        # Connection: close, so the server stops reading a body it will not use.
        return APIError(413, f"the body is over {self.max_bytes} bytes, the most this server "
                             f"reads", headers={"Connection": "close"})

    async def _read(self, receive: Receive) -> bytes:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise _TooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in self.BODILESS:
            await self.app(scope, receive, send)
            return
        refusal = self._refusal_by_headers(Headers(scope=scope))
        if refusal is None:
            try:
                async with asyncio.timeout(self.timeout_s):
                    body = await self._read(receive)
            except _ClientGone:
                return  # no one to answer
            except _TooLarge:
                refusal = self._too_large()
            except TimeoutError:
                refusal = APIError(408, f"the body did not come within {self.timeout_s:g} s",
                                   headers={"Connection": "close"})
        if refusal is not None:
            await refusal.response()(scope, receive, send)
            return
        await self.app(scope, _replaying(body, receive), send)


def _replaying(body: bytes, receive: Receive) -> Receive:
    """A `receive` whose first message is the whole body, and later ones the server's."""
    given = False

    async def replay() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay


# ------------------------------------------------------------------ JSON bodies

def shown(value) -> str:
    """A value as a message quotes it: its JSON, cut short."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse_body(raw: bytes) -> dict:
    """The request's JSON object (400 if the body is not one). NaN and Infinity, which
    Python's json reads, are refused: no sampling parameter has a use for them."""
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise APIError(400, f"the body is not valid JSON: {e}")
    if not isinstance(body, dict):
        raise APIError(400, f"the body is JSON but not an object: {shown(body)}")
    return body


def typed(body: dict, key: str, kinds: tuple, what: str, where: str = ""):
    """body[key] (None if absent or null) when it has one of the JSON types `kinds` (a
    boolean is not a number), else a 400 naming the field (`where` it is, if nested)."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) != (bool in kinds) or not isinstance(value, kinds):
        raise APIError(400, f"{where}{key}: {what}, not {shown(value)}")
    return value


def number(body: dict, key: str, default=None):
    """body[key] as a finite JSON number, or `default` if absent (400 otherwise)."""
    value = typed(body, key, (int, float), "a number")
    if isinstance(value, float) and not math.isfinite(value):  # 1e999 reads as inf
        raise APIError(400, f"{key}: a finite number, not {value}")
    return default if value is None else value


# ------------------------------------------------------------------ generations in flight

class GenerationSlots:
    """The generations in flight, at most `limit`: take() refuses the one over with 429 (and
    Retry-After) at once, rather than queueing it behind the others. It returns the slot's
    release, to call from whichever thread when the generation ends or its client goes,
    whichever comes first: a release after the first does nothing, so a generation still
    winding down after its client left does not hold a slot another client could use."""

    RETRY_AFTER_S = 1

    def __init__(self, limit: int):
        self.limit = limit
        self.in_flight = 0
        self._lock = threading.Lock()

    def take(self) -> Callable[[], None]:
        with self._lock:
            if self.in_flight >= self.limit:
                raise APIError(429, f"{self.limit} generations are in flight, the most this "
                                    f"server runs at once: retry later", "rate_limit_error",
                               {"Retry-After": str(self.RETRY_AFTER_S)})
            self.in_flight += 1
        released = False

        def release() -> None:
            nonlocal released
            with self._lock:
                if not released:
                    released = True
                    self.in_flight -= 1
        return release


# ------------------------------------------------------------------ slow clients

def guarded_h11_protocol(header_timeout_s: float) -> type:
    """uvicorn's h11 protocol with a deadline for each request's headers: the connection is
    closed when they are not all in `header_timeout_s` after it opened, or after the response
    before (uvicorn's keep-alive timeout closes a connection that sends nothing then, but its
    first byte stops that timer, and nothing bounds the wait for the first request at all). A
    deadline, not an idle timeout: a slowloris client keeps an idle timer from running out."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        _header_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_header_deadline()

        def connection_lost(self, exc) -> None:
            self._disarm_header_deadline()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request's headers have all come
                self._disarm_header_deadline()

        def on_response_complete(self) -> None:
            # before the base's, which reads a pipelined request's headers at once
            if not self.transport.is_closing():
                self._arm_header_deadline()
            super().on_response_complete()

        def _arm_header_deadline(self) -> None:
            self._disarm_header_deadline()
            self._header_deadline = self.loop.call_later(header_timeout_s, self._headers_late)

        def _disarm_header_deadline(self) -> None:
            if self._header_deadline is not None:
                self._header_deadline.cancel()
                self._header_deadline = None

        def _headers_late(self) -> None:
            # Armed only between requests (disarmed once headers come): no answer is cut short.
            self._header_deadline = None
            self.transport.close()

    return GuardedH11Protocol


def add_doors(app, *, api_key: str | None, max_body_bytes: int,
              cors_origins: tuple[str, ...], allowed_hosts: tuple[str, ...],
              body_timeout_s: float = 60.0) -> None:
    """The doors above on `app` (a Starlette or FastAPI app). The last middleware added is
    the outermost: the Host header is checked first; CORS answers a preflight (which carries
    no Authorization) before the key is asked for, and puts its headers on a 401 too."""
    app.add_middleware(BodyDoor, max_bytes=max_body_bytes, timeout_s=body_timeout_s)
    if api_key:
        app.add_middleware(ApiKeyDoor, api_key=api_key)
    if cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins),
                           allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(allowed_hosts),
                       www_redirect=False)
