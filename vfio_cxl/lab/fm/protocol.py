"""The control protocol between the CLI (or any client) and a lab's fabric manager.

Transport: a UNIX stream socket, ``<run dir>/fm.sock``.  Framing: one JSON
object per line (UTF-8, ``\\n``-terminated, at most ``MAX_LINE`` bytes).
A connection carries any number of requests, answered in order.

    request   {"version": 1, "op": "status"}                       + op's fields
    response  {"version": 1, "ok": true,  "result": {...}}
              {"version": 1, "ok": false, "error": {"what": "...", "fix": "..."}}
    stream    {"version": 1, "event": {...}}    (after "events" with "follow": true)

A request the manager cannot parse, of another version, or naming an unknown
op gets an error response; the connection stays usable unless the line was
not even a line (too long: then the manager answers and closes it).  See
docs/fabric-manager.md for every op and its fields.
"""

from __future__ import annotations

import json
from typing import Any

from ...errors import LabError

VERSION = 1
MAX_LINE = 1 << 20
# op -> {field: (type, required)}; fields not listed are refused.
OPS: dict[str, dict[str, tuple[type, bool]]] = {
    "hello": {},
    "status": {},
    "events": {"since": (int, False), "limit": (int, False), "follow": (bool, False)},
    "ssh_info": {"vm": (str, True)},
    "stop": {},
    "restart": {"gpu": (str, True)},
    "assign": {"gpu": (str, True), "vm": (str, True), "keep_vram": (bool, False)},
    "release": {"gpu": (str, True), "force": (bool, False), "keep_vram": (bool, False),
                "timeout": ((int, float), False)},
    "redfish": {"port": (int, False), "stop": (bool, False)},   # the Redfish service (docs/redfish.md)
}


# How long the fabric manager may take for a slow op, so a client waits at least that long
# (seconds).  Its waits on the guest -- DEVICE_DELETED (a release's timeout, twice with force:
# before and after the kill) and the bind check -- plus STEP_BUDGET for its other steps, each
# bounded on its own: QMP commands (10 s), the holders and kill scripts (60 s, 30 s), a fresh GPU
# server.  An op queued behind another waits for that one first.
RELEASE_TIMEOUT = 15.0      # default of release's `timeout`
RELEASE_TIMEOUT_MAX = 600.0
RESTART_RELEASE_TIMEOUT = 10.0
BIND_TIMEOUT = 30.0
STEP_BUDGET = 300.0


def op_timeout(op: str, fields: dict) -> float | None:
    """The longest the fabric manager may work on ``op`` with ``fields``; None for a fast op."""
    if op == "release":
        return 2 * float(fields.get("timeout", RELEASE_TIMEOUT)) + STEP_BUDGET
    if op == "assign":
        return 2 * RELEASE_TIMEOUT + BIND_TIMEOUT + STEP_BUDGET
    if op == "restart":
        return 2 * RESTART_RELEASE_TIMEOUT + BIND_TIMEOUT + STEP_BUDGET
    return None


class ProtocolError(LabError):
    """A request or response that breaks the protocol."""


class RemoteError(LabError):
    """The fabric manager refused or failed a request; carries its what/fix."""


def encode(message: dict) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def ok(result: Any) -> dict:
    return {"version": VERSION, "ok": True, "result": result}


def error(what: str, fix: str) -> dict:
    return {"version": VERSION, "ok": False, "error": {"what": what, "fix": fix}}


def event(ev: dict) -> dict:
    return {"version": VERSION, "event": ev}


def request(op: str, **fields) -> dict:
    return {"version": VERSION, "op": op, **fields}


def _short(value: Any, limit: int = 80) -> str:
    """repr of a client's value for an error message, cut to ``limit`` characters: an answer
    never grows with what a client sent."""
    try:
        text = repr(value)
    except RecursionError:
        return f"a {type(value).__name__} nested too deeply to show"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def parse_request(line: bytes) -> dict:
    """A checked request, or ProtocolError naming what is wrong with it."""
    try:
        message = json.loads(line)
    except RecursionError:
        raise ProtocolError("request is nested too deeply to parse",
                            'send one flat JSON object per line, e.g. {"version": 1, "op": "status"}') from None
    except (ValueError, UnicodeDecodeError) as err:
        raise ProtocolError(f"request is not JSON: {err}",
                            'send one JSON object per line, e.g. {"version": 1, "op": "status"}') from None
    if not isinstance(message, dict):
        raise ProtocolError(f"request must be a JSON object, not {type(message).__name__}",
                            'send e.g. {"version": 1, "op": "status"}')
    version = message.get("version")
    if version != VERSION:
        raise ProtocolError(f"protocol version {_short(version)} is not supported (this fabric manager speaks {VERSION})",
                            f'send "version": {VERSION}; use the vfio-cxl that started the lab')
    op = message.get("op")
    if not isinstance(op, str) or op not in OPS:
        raise ProtocolError(f"unknown op {_short(op)}", f"ops: {', '.join(OPS)}")
    fields = OPS[op]
    for name, value in message.items():
        if name in ("version", "op"):
            continue
        if name not in fields:
            raise ProtocolError(f"op {op!r} has no field {_short(name)}",
                                f"fields of {op!r}: {', '.join(fields) or 'none'}")
        kind = fields[name][0]
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            kind_name = " or ".join(k.__name__ for k in kind) if isinstance(kind, tuple) else kind.__name__
            raise ProtocolError(f"op {op!r}: field {name!r} must be {kind_name}, not {_short(value)}",
                                "fix the request")
    for name, (_, required) in fields.items():
        if required and name not in message:
            raise ProtocolError(f"op {op!r} needs field {name!r}", "add it to the request")
    return message


def parse_response(line: bytes) -> dict:
    try:
        message = json.loads(line)
    except (ValueError, UnicodeDecodeError, RecursionError) as err:
        raise ProtocolError(f"fabric manager sent a line that is not JSON: {err}",
                            "is the socket a vfio-cxl fabric manager's?") from None
    if not isinstance(message, dict) or message.get("version") != VERSION:
        raise ProtocolError(f"fabric manager answered with protocol {_short(message)}",
                            "use the vfio-cxl that started the lab")
    return message
