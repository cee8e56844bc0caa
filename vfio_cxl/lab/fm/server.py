"""The control protocol server: the fabric manager's UNIX socket, its clients, framing and bounds.

Runs in the loop thread only (no other thread touches a socket).  It reads
request lines, parses them (:func:`protocol.parse_request`), hands each to
``handle`` and writes the answers back in order.  ``handle`` returns the answer,
or None when the request went to the op worker: the connection is then *busy*,
its later requests wait, and :meth:`ControlServer.answer_later` sends the answer
and goes on with them.

What a connection may cost is bounded: past MAX_LINE bytes not yet served the
server stops reading it (the client's writes block), a line longer than
MAX_LINE is refused and the connection closed, and a follower whose unsent
output passes MAX_OUTBUF is dropped.
"""

from __future__ import annotations

import os
import selectors
import socket
import traceback
from pathlib import Path
from typing import Callable

from ...errors import LabError
from . import protocol

MAX_OUTBUF = 4 << 20   # a follower that reads slower than this is dropped


class Client:
    """One connection to the control socket."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.inbuf = bytearray()
        self.scanned = 0            # inbuf[:scanned] has no newline
        self.outbuf = bytearray()
        self.mask = 0               # what the loop's selector waits for on it (0: not registered)
        self.follow = False
        self.close_after_flush = False
        self.busy = False           # a slow op of this connection runs: its later requests wait
        self.backlog: list[bytes] = []   # `event` lines owed to a new follower after its answer
        self.eof = False            # the client shut its side: no more requests


class ControlServer:
    def __init__(self, sel: selectors.BaseSelector, handle: Callable[[Client, dict], dict | None],
                 log: Callable[[str], None]):
        self.sel = sel
        self.handle = handle
        self.log = log
        self.clients: dict[int, Client] = {}
        self.listener: socket.socket | None = None
        self.path: Path | None = None

    def listen(self, path: Path) -> None:
        """Serve on ``path`` (mode 0600: only the lab's user connects)."""
        path.unlink(missing_ok=True)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        os.chmod(path, 0o600)
        self.listener.listen(128)
        self.listener.setblocking(False)
        self.path = path
        self.sel.register(self.listener, selectors.EVENT_READ, ("listen", None))

    def accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except BlockingIOError:
            return
        sock.setblocking(False)
        client = Client(sock)
        self.clients[sock.fileno()] = client
        self._interest(client)

    def ready(self, client: Client, mask: int) -> None:
        """The selector says ``client`` can be read and/or written."""
        if mask & selectors.EVENT_READ:
            self._read(client)
        if mask & selectors.EVENT_WRITE and client.sock.fileno() in self.clients:
            self._flush(client)

    def broadcast(self, line: bytes) -> None:
        """An `event` line to every follower."""
        for client in list(self.clients.values()):
            if client.follow:
                self.send(client, line)

    def answer_later(self, client: Client, data: bytes) -> None:
        """The answer of a connection's slow op: sent, and its next requests served (if it is
        still connected)."""
        if self.clients.get(client.sock.fileno()) is client:
            client.busy = False
            self.send(client, data)
            self._serve_lines(client)

    def close(self) -> None:
        """Send what each client is owed (1 s each at most), close every connection and the socket."""
        for client in list(self.clients.values()):
            client.sock.setblocking(True)
            client.sock.settimeout(1)
            try:
                client.sock.sendall(client.outbuf)
            except OSError:
                pass
            self._drop(client)
        if self.listener:
            self.listener.close()
            self.path.unlink(missing_ok=True)

    def send(self, client: Client, data: bytes) -> None:
        client.outbuf += data
        if len(client.outbuf) > MAX_OUTBUF:
            self.log("dropping a client that does not read its events")
            self._drop(client)
            return
        self._flush(client)

    def _read(self, client: Client) -> None:
        try:
            data = client.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:   # the client sends no more: answer what it sent, then close
            client.eof = True
            self._serve_lines(client)
            return
        client.inbuf += data   # a bytearray: appending does not copy what is there
        self._serve_lines(client)

    def _parse(self, client: Client, line: bytes) -> dict | None:
        """The request on ``line``, or None once the client has its error."""
        try:
            return protocol.parse_request(line)
        except LabError as err:
            self.send(client, protocol.encode(protocol.error(err.what, err.fix)))
        except Exception as err:   # whatever a client sends, the lab stays up
            self.log(f"internal error parsing a request: {traceback.format_exc()}")
            self.send(client, protocol.encode(protocol.error(
                f"fabric manager could not parse the request: {type(err).__name__}",
                'send one JSON object per line, e.g. {"version": 1, "op": "status"}')))
        return None

    def _answer(self, client: Client, request: dict) -> None:
        """Answer one request now, or mark the connection busy while the worker runs it."""
        answer = self.handle(client, request)
        if answer is None:
            client.busy = True
            return
        self.send(client, protocol.encode(answer))
        backlog, client.backlog = client.backlog, []
        for line in backlog:
            if client.sock.fileno() < 0:
                break
            self.send(client, line)

    def _serve_lines(self, client: Client) -> None:
        """Answer the complete request lines of a connection, in order, until one goes to the
        worker (the rest wait for its answer)."""
        buf, start = client.inbuf, 0
        while not client.close_after_flush and not client.busy and client.sock.fileno() >= 0:
            end = buf.find(b"\n", max(start, client.scanned))
            if end < 0:
                client.scanned = len(buf)
                break
            if end - start > protocol.MAX_LINE:
                client.scanned = end   # refused below, as a line without its newline
                break
            line = bytes(buf[start:end])
            start = end + 1
            request = self._parse(client, line)
            if request is not None:
                self._answer(client, request)
        del buf[:start]   # once per call, not once per line
        client.scanned = max(client.scanned - start, 0)
        self._after_serving(client)

    def _after_serving(self, client: Client) -> None:
        """Close a connection that said its last, refuse an over-long line, else wait on it."""
        if client.sock.fileno() < 0:
            return   # dropped while answering (a follower that does not read)
        if client.eof and not client.busy and not client.close_after_flush:
            client.close_after_flush = True   # a partial last line is dropped
            self._flush(client)
            return
        if client.close_after_flush:
            client.inbuf.clear()
        elif not client.busy and client.scanned > protocol.MAX_LINE:
            client.inbuf.clear()
            client.scanned = 0
            client.close_after_flush = True
            self.send(client, protocol.encode(protocol.error(
                f"request longer than {protocol.MAX_LINE} bytes without a newline",
                "end each JSON request with a newline")))
            return
        self._interest(client)

    def _interest(self, client: Client) -> None:
        """Read a connection unless it has a full request line's worth waiting (backpressure);
        write to it while it has output."""
        reading = len(client.inbuf) <= protocol.MAX_LINE and not client.close_after_flush and not client.eof
        events = (selectors.EVENT_READ if reading else 0) | (selectors.EVENT_WRITE if client.outbuf else 0)
        # events == 0: nothing to do until its slow op ends (a hang-up is seen when it answers)
        if events != client.mask:
            if client.mask == 0:
                self.sel.register(client.sock, events, ("client", client))
            elif events == 0:
                self.sel.unregister(client.sock)
            else:
                self.sel.modify(client.sock, events, ("client", client))
            client.mask = events

    def _flush(self, client: Client) -> None:
        try:
            while client.outbuf:
                sent = client.sock.send(client.outbuf)
                del client.outbuf[:sent]
        except BlockingIOError:
            pass
        except OSError:
            self._drop(client)   # a failed write poisons the connection
            return
        if not client.outbuf and client.close_after_flush:
            self._drop(client)
            return
        self._interest(client)

    def _drop(self, client: Client) -> None:
        if self.clients.pop(client.sock.fileno(), None) is not None and client.mask:
            self.sel.unregister(client.sock)
        client.mask = 0
        client.sock.close()
