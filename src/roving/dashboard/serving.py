"""The dashboard's HTTP/1.1 serving: a bounded number of connections, each under a deadline, on one
asyncio event loop in a thread of its own; answers are computed by a few worker threads.

Why an event loop rather than threads per connection: a thread per connection gives a stranger a
thread for every connection it opens (300 idle ones, 300 threads), and a fixed pool of threads is taken
whole by a few connections that send nothing (or a byte a second) until their deadlines, the real request
waiting behind them. On the loop a connection that sends nothing costs a socket and a timer; TLS
handshakes run non-blocking side by side, never on the accept path.

Guarantees (figures from :class:`Limits`):

- At most ``connections`` connections are open at once, handshaking or not. A new one beyond that
  closes the connection that has waited longest among those of the source address holding the most
  (one being answered is never closed for a newcomer; when every open one is, the newcomer is closed).
- Each connection has ``handshake_s`` for its TLS handshake, ``request_s`` to send each request's head
  (request line and headers, counted from its handshake or its previous answer: this also bounds how
  long it may stay idle between requests), and ``answer_s`` for its answer to be made and taken. Past a
  deadline it is closed, whatever it is doing; a slow sender cannot extend one by sending a byte at a time.
- A request head over ``header_bytes`` gets 431, one with a body 400, then the connection is closed.
- Threads: one for the loop, ``workers`` for answers, whatever comes in. A connection has at most one
  request in work; further ones it sends meanwhile wait in its buffer (at most ``header_bytes`` of them).
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import functools
import http
import http.client
import io
import logging
import queue
import socket
import ssl
import sys
import threading
from typing import Any, Callable, Dict, Optional, Tuple

from ..errors import RovingError

log = logging.getLogger(__name__)

__all__ = ["Limits", "Request", "Answer", "HttpServer"]


@dataclasses.dataclass(frozen=True)
class Limits:
    """How much the server gives the peers it does not know yet (see the module's guarantees)."""

    connections: int = 64
    handshake_s: float = 5.0
    request_s: float = 15.0
    answer_s: float = 30.0
    header_bytes: int = 16384
    workers: int = 2

    def __post_init__(self) -> None:
        for name in ("connections", "header_bytes", "workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"Limits.{name} must be at least 1, not {getattr(self, name)!r}")
        for name in ("handshake_s", "request_s", "answer_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Limits.{name} must be a positive number of seconds, not {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True)
class Request:
    """A request's head: ``target`` is the path with its query, as sent."""

    method: str
    target: str
    version: str
    headers: http.client.HTTPMessage
    source: str

    @property
    def keep_alive(self) -> bool:
        connection = (self.headers.get("Connection") or "").lower()
        return "close" not in connection and (self.version == "HTTP/1.1" or "keep-alive" in connection)


@dataclasses.dataclass(frozen=True)
class Answer:
    """What is sent back: ``headers`` besides Content-Type, Content-Length and Connection."""

    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"
    headers: Tuple[Tuple[str, str], ...] = ()
    close: bool = False


def _problem(status: int, text: str) -> Answer:
    return Answer(status, f"{status}: {text}\n".encode(), headers=(("X-Content-Type-Options", "nosniff"),), close=True)


class _Phase(enum.IntEnum):
    HANDSHAKE = 0
    WAITING = 1  # for a request's head (idle, or reading one)
    ANSWERING = 2


@dataclasses.dataclass(eq=False)
class _Connection:
    source: str
    sock: socket.socket
    since: float
    phase: _Phase = _Phase.HANDSHAKE
    task: Optional["asyncio.Task[None]"] = None
    timer: Optional[asyncio.TimerHandle] = None
    transport: Optional[asyncio.BaseTransport] = None
    clean: bool = False  # ended after a complete answer: closed gently (the answer's bytes flushed)


class _Closed(RovingError):
    """The peer went away (or the connection was aborted) mid-request."""


class _TooLarge(RovingError):
    """A request head over Limits.header_bytes."""


class _Wire(asyncio.Protocol):
    """One connection's bytes: a bounded input buffer read head by head, and write flow control."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._buffer = bytearray()
        self._eof = self._lost = self._paused = False
        self._arrived = asyncio.Event()
        self._writable = asyncio.Event()
        self._writable.set()
        self.transport: Any = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if len(self._buffer) > self._limit and not self._paused:
            self._paused = True  # nothing more is read until the head in the buffer is served
            self.transport.pause_reading()
        self._arrived.set()

    def eof_received(self) -> None:
        self._eof = True
        self._arrived.set()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._eof = self._lost = True
        self._arrived.set()
        self._writable.set()

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    async def head(self) -> Optional[bytes]:
        """The next request's head (up to its blank line); None at an end between requests."""
        while True:
            while self._buffer[:2] == b"\r\n":  # blank lines before a request line are allowed
                del self._buffer[:2]
            end = self._buffer.find(b"\r\n\r\n")
            if 0 <= end <= self._limit - 4:
                head = bytes(self._buffer[:end + 4])
                del self._buffer[:end + 4]
                if self._paused and len(self._buffer) <= self._limit and not self._lost:
                    self._paused = False
                    self.transport.resume_reading()
                return head
            if len(self._buffer) >= self._limit:
                raise _TooLarge()
            if self._eof:
                if self._buffer:
                    raise _Closed()
                return None
            self._arrived.clear()
            await self._arrived.wait()

    async def send(self, data: bytes) -> None:
        """Write ``data`` and wait until the transport has taken it (its buffer below the high mark)."""
        if self._lost:
            raise _Closed()
        self.transport.write(data)
        await self._writable.wait()
        if self._lost:
            raise _Closed()


class _Workers:
    """A fixed number of daemon threads computing answers (a hung one never holds up the program's exit)."""

    def __init__(self, count: int, name: str) -> None:
        self._jobs: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(count)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)

    def run(self, fn: Callable[[Any], Any], arg: Any) -> "asyncio.Future[Any]":
        """``fn(arg)`` in a worker; the future (of the calling loop) gets its result or exception."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._jobs.put((fn, arg, loop, fut))
        return fut

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, arg, loop, fut = job
            if fut.cancelled():  # the connection was closed meanwhile
                continue
            try:
                result, error = fn(arg), None
            except BaseException as exc:  # handed to the connection, which answers 500
                result, error = None, exc
            try:
                loop.call_soon_threadsafe(_settle, fut, result, error)
            except RuntimeError:  # the loop is closed: the server stopped
                pass


def _settle(fut: "asyncio.Future[Any]", result: Any, error: Optional[BaseException]) -> None:
    if not fut.done():
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)


def _parse(head: bytes, source: str) -> Tuple[Optional[Request], Optional[Answer]]:
    """The request in ``head``, or the answer that refuses it."""
    line, _, rest = head.partition(b"\r\n")
    parts = line.decode("latin-1").split(" ")
    if len(parts) != 3 or parts[2] not in ("HTTP/1.0", "HTTP/1.1") or not parts[1]:
        return None, _problem(400, "not an HTTP/1.x request line")
    try:
        headers = http.client.parse_headers(io.BytesIO(rest))
    except (http.client.HTTPException, ValueError) as exc:
        return None, _problem(400, f"bad headers ({type(exc).__name__})")
    if headers.get("Transfer-Encoding") or (headers.get("Content-Length") or "0").strip() != "0":
        return None, _problem(400, "this server takes no request bodies")
    return Request(parts[0], parts[1], parts[2], headers, source), None


def _encode(answer: Answer, request: Optional[Request], close: bool) -> bytes:
    try:
        reason = http.HTTPStatus(answer.status).phrase
    except ValueError:
        reason = "Status"
    lines = [f"HTTP/1.1 {answer.status} {reason}", f"Content-Type: {answer.content_type}",
             f"Content-Length: {len(answer.body)}"]
    lines += [f"{name}: {value}" for name, value in answer.headers]
    if close:
        lines.append("Connection: close")
    data = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return data if request is not None and request.method == "HEAD" else data + answer.body


class HttpServer:
    """Serves ``handler(request) -> Answer`` (called in a worker thread) on ``host``:``port``, over TLS
    with ``ssl_context``. The socket listens once this is made (OSError if it cannot); :meth:`start`
    begins serving."""

    def __init__(self, handler: Callable[[Request], Answer], host: str, port: int,
                 ssl_context: Optional[ssl.SSLContext] = None, limits: Optional[Limits] = None,
                 name: str = "roving-dashboard") -> None:
        limits = limits or Limits()
        self._handler, self._ssl, self.limits, self._name = handler, ssl_context, limits, name
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=128)
        self._listener.setblocking(False)
        self.address: Tuple[str, int] = self._listener.getsockname()[:2]
        self._open: Dict[_Connection, None] = {}  # in arrival order
        self._workers = _Workers(limits.workers, f"{name}-answer")
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._stopping: Optional[asyncio.Event] = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    @property
    def open_connections(self) -> int:
        """Connections open now (handshaking, waiting or being answered)."""
        return len(self._open)

    def start(self, timeout: float = 10.0) -> None:
        """Start serving (returns once the loop runs; RuntimeError after ``timeout`` seconds otherwise)."""
        self._workers.start()
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError(f"the {self._name} server did not start within {timeout} s")

    def stop(self, timeout: float = 5.0) -> None:
        """Close every connection and the socket; returns within about ``timeout`` seconds."""
        loop, stopping = self._loop, self._stopping
        if loop is not None and stopping is not None and self._thread.is_alive():
            try:
                loop.call_soon_threadsafe(stopping.set)
            except RuntimeError:  # its loop already closed
                pass
            self._thread.join(timeout)
        self._workers.stop()
        self._listener.close()

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        # a stranger's broken handshake is not the program's error: no traceback on its terminal
        loop.set_exception_handler(lambda _loop, ctx: log.debug("%s: %s", self._name, ctx.get("message"),
                                                                exc_info=ctx.get("exception")))
        self._loop = loop
        try:
            loop.run_until_complete(self._main())
        finally:
            loop.close()

    async def _main(self) -> None:
        loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        accepting = loop.create_task(self._accept(loop))
        self._ready.set()
        await self._stopping.wait()
        accepting.cancel()
        tasks = [c.task for c in self._open if c.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(accepting, *tasks, return_exceptions=True)
        for _ in range(3):  # the aborted transports close their sockets in callbacks of their own
            await asyncio.sleep(0)

    async def _accept(self, loop: asyncio.AbstractEventLoop) -> None:
        while True:
            try:
                sock, addr = await loop.sock_accept(self._listener)
            except (ConnectionAbortedError, InterruptedError):
                continue
            except OSError as exc:  # out of descriptors (EMFILE) or memory: make room, then go on
                log.warning("%s: accept failed (%s); closing the longest-waiting connection", self._name, exc)
                self._evict()
                await asyncio.sleep(0.05)
                continue
            conn = _Connection(source=str(addr[0]), sock=sock, since=loop.time())
            if len(self._open) >= self.limits.connections and not self._evict():
                sock.close()  # every open connection is being answered: this one waits for none of them
                continue
            self._open[conn] = None
            conn.task = loop.create_task(self._serve(conn, loop))
            conn.task.add_done_callback(functools.partial(self._closed, conn))

    def _evict(self) -> bool:
        """Close the longest-waiting connection of the source holding the most; False if none may be closed."""
        waiting = [c for c in self._open if c.phase != _Phase.ANSWERING]
        if not waiting:
            return False
        per_source = collections.Counter(c.source for c in waiting)
        most = max(per_source.values())
        victim = min((c for c in waiting if per_source[c.source] == most), key=lambda c: c.since)
        log.debug("%s: connection from %s closed to make room", self._name, victim.source)
        self._open.pop(victim, None)
        if victim.task is not None:
            victim.task.cancel()
        return True

    def _phase(self, conn: _Connection, phase: _Phase, seconds: float, loop: asyncio.AbstractEventLoop) -> None:
        conn.phase, conn.since = phase, loop.time()
        if conn.timer is not None:
            conn.timer.cancel()
        task = conn.task
        conn.timer = loop.call_later(seconds, lambda: task is not None and task.cancel())

    def _closed(self, conn: _Connection, _task: Any = None) -> None:
        self._open.pop(conn, None)
        if conn.timer is not None:
            conn.timer.cancel()
        if conn.transport is None:
            conn.sock.close()
        elif conn.clean:
            conn.transport.close()
        else:
            conn.transport.abort()  # type: ignore[attr-defined]

    async def _serve(self, conn: _Connection, loop: asyncio.AbstractEventLoop) -> None:
        limits = self.limits
        try:
            self._phase(conn, _Phase.HANDSHAKE, limits.handshake_s, loop)
            wire = _Wire(limits.header_bytes)
            tls: Dict[str, Any] = {}
            if self._ssl is not None:
                tls = {"ssl": self._ssl, "ssl_handshake_timeout": limits.handshake_s}
                if sys.version_info >= (3, 11):  # else a close waits up to 30 s for the peer's close_notify
                    tls["ssl_shutdown_timeout"] = 1.0
            conn.transport, _ = await loop.connect_accepted_socket(lambda: wire, conn.sock, **tls)
            while True:
                self._phase(conn, _Phase.WAITING, limits.request_s, loop)
                request: Optional[Request] = None
                answer: Optional[Answer] = None
                try:
                    head = await wire.head()
                except _TooLarge:
                    answer = _problem(431, f"request head over {limits.header_bytes} bytes")
                else:
                    if head is None:
                        return
                    request, answer = _parse(head, conn.source)
                self._phase(conn, _Phase.ANSWERING, limits.answer_s, loop)
                if answer is None:
                    try:
                        answer = await self._workers.run(self._handler, request)
                    except Exception:
                        log.exception("%s: answering %s failed", self._name, request and request.target)
                        answer = _problem(500, "the dashboard failed to answer (logged)")
                assert answer is not None
                close = answer.close or request is None or not request.keep_alive
                await wire.send(_encode(answer, request, close))
                if close:
                    conn.clean = True
                    return
        except (asyncio.CancelledError, _Closed, OSError) as exc:  # a deadline, an eviction, a peer gone
            log.debug("%s: connection from %s ended: %r", self._name, conn.source, exc)
