"""The Redfish service (Flask): a view of the lab and a client of its fabric manager.

Every GET asks the FM for its status and builds the resources from it (model.build); a POST
of a Connection is ``fm assign``, its DELETE ``fm release``.  The only state of its own is
the event subscriptions (EventService), which live as long as this process.

Errors are Redfish ``error`` objects with ``@Message.ExtendedInfo`` from DMTF's Base message
registry, each with a Resolution saying what would be right.  Everything a client sends is
bounded: the body (MAX_BODY), the subscriptions (MAX_SUBSCRIPTIONS), their strings.
"""

from __future__ import annotations

import json
import threading
from typing import Callable
from urllib.parse import urlsplit

from flask import Flask, Response, request
from werkzeug.exceptions import HTTPException

from ....errors import LabError
from ..protocol import RemoteError
from .csdl import OEM_SCHEMA, metadata, oem_schema, service_document
from .model import (BASE_REGISTRY, FABRIC, ROOT, TYPES, build, collection, gpu_endpoint, host_endpoint,
                    ref, resource)

GENERAL_ERROR = ("A general error has occurred.  See Resolution for information on how to resolve the error, "
                 "or @Message.ExtendedInfo if Resolution is not provided.")
MAX_BODY = 64 << 10
MAX_SUBSCRIPTIONS = 16
MAX_STRING = 256
CONNECTIONS = f"{FABRIC}/Connections"
SUBSCRIPTIONS = f"{ROOT}/EventService/Subscriptions"


class RedfishError(Exception):
    """An error response: HTTP status, a Base registry message, what would be right."""

    def __init__(self, http: int, message_id: str, message: str, args: list = (), resolution: str = "",
                 severity: str = "Warning", related: list[str] = (), detail: str = ""):
        super().__init__(message)
        self.http, self.message_id, self.message, self.detail = http, message_id, message, detail
        self.args_, self.resolution, self.severity, self.related = list(args), resolution, severity, list(related)

    def body(self) -> dict:
        info = {"@odata.type": TYPES["Message"], "MessageId": f"{BASE_REGISTRY}.{self.message_id}",
                "Message": self.message, "MessageArgs": [str(a) for a in self.args_],
                "MessageSeverity": self.severity, "Resolution": self.resolution}
        if self.related:
            info["RelatedProperties"] = self.related
        return {"error": {"code": f"{BASE_REGISTRY}.{self.message_id}", "message": self.detail or self.message,
                          "@Message.ExtendedInfo": [info]}}


def not_found(kind: str, name: str, resolution: str = "") -> RedfishError:
    return RedfishError(404, "ResourceNotFound", f"The requested resource of type {kind} named '{name}' "
                        "was not found.", [kind, name], resolution or "Provide a valid resource identifier "
                        "and resubmit the request.", "Critical")


def not_in_list(value, prop: str, allowed: list[str]) -> RedfishError:
    return RedfishError(400, "PropertyValueNotInList", f"The value '{value}' for the property {prop} is not "
                        "in the list of acceptable values.", [value, prop],
                        f"Use one of: {', '.join(allowed) or 'none'}.", related=[f"#/{prop}"])


def unknown_property(prop: str, known: list[str]) -> RedfishError:
    return RedfishError(400, "PropertyUnknown", f"The property {prop} is not in the list of valid properties "
                        "for the resource.", [prop], f"Remove it; the writable properties here are: "
                        f"{', '.join(known) or 'none'}.", related=[f"#/{prop}"])


def missing(prop: str, example: str) -> RedfishError:
    return RedfishError(400, "PropertyMissing", f"The property {prop} is a required property and must be "
                        "included in the request.", [prop], f"Add it, e.g. {example}.", related=[f"#/{prop}"])


def type_error(value, prop: str, kind: str) -> RedfishError:
    text = json.dumps(value)[:64]
    return RedfishError(400, "PropertyValueTypeError", f"The value '{text}' for the property {prop} is of a "
                        "different type than the property can accept.", [text, prop],
                        f"Give {prop} as {kind}.", related=[f"#/{prop}"])


class Subscriptions:
    """EventService subscriptions: at most MAX_SUBSCRIPTIONS, to http://127.0.0.1 only."""

    FIELDS = {"Destination": str, "Context": str, "Protocol": str, "EventFormatType": str,
              "SubscriptionType": str, "Name": str}

    def __init__(self):
        self.lock = threading.Lock()
        self.items: dict[str, dict] = {}
        self.next_id = 1

    def create(self, body: dict) -> dict:
        for key, value in body.items():
            if key not in self.FIELDS:
                raise unknown_property(key, list(self.FIELDS))
            if not isinstance(value, self.FIELDS[key]):
                raise type_error(value, key, "a string")
            if len(value) > MAX_STRING:
                raise RedfishError(400, "StringValueTooLong", f"The string '{value[:32]}...' exceeds the length "
                                   f"limit {MAX_STRING}.", [value[:32], MAX_STRING],
                                   f"Give {key} in at most {MAX_STRING} characters.", related=[f"#/{key}"])
        if "Destination" not in body:
            raise missing("Destination", '"Destination": "http://127.0.0.1:8000/events"')
        url = urlsplit(body["Destination"])
        if url.scheme != "http" or url.hostname != "127.0.0.1" or url.port is None:
            raise RedfishError(400, "PropertyValueFormatError", f"The value '{body['Destination']}' for the "
                               "property Destination is of a different format than the property can accept.",
                               [body["Destination"], "Destination"],
                               "Give http://127.0.0.1:PORT/PATH: events go to this host only, unencrypted.",
                               related=["#/Destination"])
        for key, allowed in (("Protocol", ["Redfish"]), ("EventFormatType", ["Event"]),
                             ("SubscriptionType", ["RedfishEvent"])):
            if key in body and body[key] not in allowed:
                raise not_in_list(body[key], key, allowed)
        with self.lock:
            if len(self.items) >= MAX_SUBSCRIPTIONS:
                raise RedfishError(503, "EventSubscriptionLimitExceeded", "The event subscription failed due to "
                                   "the number of simultaneous subscriptions exceeding the limit of the "
                                   "implementation.", [], f"Delete one of the {MAX_SUBSCRIPTIONS} subscriptions "
                                   f"({SUBSCRIPTIONS}) first.", "Critical")
            sid = str(self.next_id)
            self.next_id += 1
            path = f"{SUBSCRIPTIONS}/{sid}"
            self.items[sid] = resource(path, "EventDestination", sid, body.get("Name", f"Subscription {sid}"),
                                       Destination=body["Destination"], Context=body.get("Context", ""),
                                       Protocol="Redfish", EventFormatType="Event",
                                       SubscriptionType="RedfishEvent")
            return self.items[sid]

    def delete(self, sid: str) -> None:
        with self.lock:
            if self.items.pop(sid, None) is None:
                raise not_found("EventDestination", sid, f"See {SUBSCRIPTIONS}.")

    def snapshot(self) -> dict[str, dict]:
        with self.lock:
            return dict(self.items)


def create_app(fm: Callable, topology, subscriptions: Subscriptions | None = None) -> Flask:
    """The WSGI app.  ``fm()``: a new, connected FM client (a context manager: FmClient or a fake)."""
    app = Flask("vfio_cxl.redfish")
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY
    subs = subscriptions or Subscriptions()
    app.extensions["subscriptions"] = subs

    def fm_call(fn):
        try:
            with fm() as client:
                return fn(client)
        except RemoteError as err:   # the FM refused: a conflict with the lab's state
            raise RedfishError(409, "GeneralError", GENERAL_ERROR, [],
                               f"The fabric manager refused: {err.what}. {err.fix or 'See the lab fm.log.'}",
                               "Critical", detail=f"The fabric manager refused: {err.what}") from None
        except LabError as err:      # the FM did not answer
            raise RedfishError(503, "ServiceTemporarilyUnavailable", "The service is temporarily unavailable.  "
                               "Retry in 5 seconds.", ["5"], f"The fabric manager does not answer: {err.what}. "
                               f"{err.fix or 'See vfio-cxl vm ls.'}", "Critical",
                               detail=f"The fabric manager does not answer: {err.what}") from None

    def resources() -> dict:
        return build(topology, fm_call(lambda c: c.status()))

    def reply(body, code: int = 200, headers: dict | None = None) -> Response:
        response = Response(json.dumps(body, indent=1) if body is not None else "", code,
                            mimetype="application/json")
        response.headers["OData-Version"] = "4.0"
        for key, value in (headers or {}).items():
            response.headers[key] = value
        return response

    def json_body() -> dict:
        raw = request.get_data(cache=False)
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as err:
            raise RedfishError(400, "MalformedJSON", "The request body submitted was malformed JSON and could "
                               "not be parsed by the receiving service.", [],
                               f"Send one JSON object ({err}).", "Critical") from None
        if not isinstance(body, dict):
            raise RedfishError(400, "MalformedJSON", "The request body submitted was malformed JSON and could "
                               "not be parsed by the receiving service.", [],
                               f"Send a JSON object, not {type(body).__name__}.", "Critical")
        return body

    @app.errorhandler(RedfishError)
    def on_redfish_error(err: RedfishError):
        headers = {"Allow": err.allow} if getattr(err, "allow", None) else {}
        return reply(err.body(), err.http, headers)

    @app.errorhandler(HTTPException)
    def on_http_error(err: HTTPException):
        if err.code == 413:
            return on_redfish_error(RedfishError(413, "GeneralError", GENERAL_ERROR, [],
                                                 f"Send a body of at most {MAX_BODY} bytes.",
                                                 detail=f"The request body is larger than {MAX_BODY} bytes."))
        if err.code == 405:
            e = RedfishError(405, "OperationNotAllowed", "The HTTP method is not allowed on this resource.", [],
                             f"Use {', '.join(err.valid_methods or [])}.", "Critical")
            e.allow = ", ".join(err.valid_methods or [])
            return on_redfish_error(e)
        return on_redfish_error(not_found("Resource", request.path))

    @app.get("/redfish")
    def versions():
        return reply({"v1": ROOT + "/"})

    def xml(text: str) -> Response:
        response = Response(text, 200, mimetype="application/xml")
        response.headers["OData-Version"] = "4.0"
        return response

    @app.get(f"{ROOT}/$metadata")
    def service_metadata():
        return xml(metadata())

    @app.get(OEM_SCHEMA)
    def oem_csdl():
        return xml(oem_schema())

    @app.get(f"{ROOT}/odata")
    def odata():
        return reply(service_document())

    @app.get("/redfish/v1", strict_slashes=False)
    @app.get("/redfish/v1/<path:path>", strict_slashes=False)
    def get(path: str = ""):
        key = f"{ROOT}/{path}".rstrip("/") if path.strip("/") else ROOT + "/"
        if key == f"{ROOT}/EventService":
            return reply(event_service())
        if key == SUBSCRIPTIONS:
            return reply(collection(SUBSCRIPTIONS, "EventDestination", "Event subscriptions",
                                    list(f"{SUBSCRIPTIONS}/{s}" for s in subs.snapshot())))
        if key.startswith(SUBSCRIPTIONS + "/"):
            sid = key.rsplit("/", 1)[1]
            sub = subs.snapshot().get(sid)
            if sub is None:
                raise not_found("EventDestination", sid, f"See {SUBSCRIPTIONS}.")
            return reply(sub)
        found = resources().get(key)
        if found is None:
            raise not_found(kind_of(key), key.rsplit("/", 1)[-1], f"Follow the links from {ROOT}/.")
        return reply(found)

    def event_service() -> dict:
        return resource(f"{ROOT}/EventService", "EventService", "EventService", "Event Service",
                        ServiceEnabled=True, Status={"State": "Enabled", "Health": "OK"},
                        DeliveryRetryAttempts=0, DeliveryRetryIntervalSeconds=0,
                        EventFormatTypes=["Event"], RegistryPrefixes=["ResourceEvent"],
                        Subscriptions=ref(SUBSCRIPTIONS))

    @app.post(CONNECTIONS)
    def post_connection():
        body = json_body()
        gpu, vm, keep = parse_connection(body, resources())
        fm_call(lambda c: c.assign(gpu, vm, keep_vram=keep))
        cid = f"{gpu}-{vm}"
        created = resources().get(f"{CONNECTIONS}/{cid}")
        if created is None:   # the FM said yes but does not show it: say so, never pretend
            raise RedfishError(500, "InternalError", "The request failed due to an internal service error.  "
                               "The service is still operational.", [], "See the lab's fm.log.", "Critical")
        return reply(created, 201, {"Location": created["@odata.id"]})

    @app.delete(f"{CONNECTIONS}/<cid>")
    def delete_connection(cid: str):
        found = resources().get(f"{CONNECTIONS}/{cid}")
        if found is None:
            raise not_found("Connection", cid, f"See {CONNECTIONS}.")
        if not found["Oem"]["VfioCxl"]["Deletable"]:
            raise RedfishError(405, "ResourceCannotBeDeleted", "The delete request failed because the resource "
                               "requested cannot be deleted.", [], "Only a GPU's connection can be deleted "
                               "(the GPU is released); memory and controllers are wired by the topology.",
                               "Critical")
        gpu = found["Links"]["TargetEndpoints"][0]["@odata.id"].rsplit("/gpu-", 1)[1]
        fm_call(lambda c: c.release(gpu))
        return reply(None, 204)

    @app.post(SUBSCRIPTIONS)
    def post_subscription():
        created = subs.create(json_body())
        return reply(created, 201, {"Location": created["@odata.id"]})

    @app.delete(f"{SUBSCRIPTIONS}/<sid>")
    def delete_subscription(sid: str):
        subs.delete(sid)
        return reply(None, 204)

    @app.patch("/redfish/v1/<path:path>")
    def patch(path: str):
        key = f"{ROOT}/{path}".rstrip("/")
        found = (event_service() if key == f"{ROOT}/EventService" else subs.snapshot().get(key.rsplit("/", 1)[1])
                 if key.startswith(SUBSCRIPTIONS + "/") else resources().get(key))
        if found is None:
            raise not_found(kind_of(key), key.rsplit("/", 1)[-1], f"Follow the links from {ROOT}/.")
        body = json_body()
        if not body:
            raise RedfishError(400, "EmptyJSON", "The request body submitted contained an empty JSON object and "
                               "the service is unable to process it.", [], "Nothing here is writable.")
        prop = next(iter(body))
        if prop in found:
            raise RedfishError(400, "PropertyNotWritable", f"The property {prop} is a read only property and "
                               "cannot be assigned a value.", [prop], "Nothing here is writable: a GPU moves by "
                               f"POST/DELETE of {CONNECTIONS}.", related=[f"#/{prop}"])
        raise unknown_property(prop, [])

    return app


def kind_of(path: str) -> str:
    parts = path.split("/")
    for collection_name, kind in (("Endpoints", "Endpoint"), ("Connections", "Connection"), ("Zones", "Zone"),
                                  ("Ports", "Port"), ("Switches", "Switch"), ("Fabrics", "Fabric")):
        if collection_name in parts[:-1]:
            return kind
    return "Resource"


def parse_connection(body: dict, resources: dict) -> tuple[str, str, bool]:
    """(gpu, vm, keep_vram) of a Connection to create, or RedfishError saying what is wrong."""
    allowed = {"Links", "Name", "Oem", "@odata.type"}
    for key in body:
        if key not in allowed:
            if key in ("Id", "Status", "ConnectionType", "@odata.id"):
                raise RedfishError(400, "PropertyNotWritable", f"The property {key} is a read only property and "
                                   "cannot be assigned a value.", [key], "Leave it out: the service names the "
                                   "connection GPU-HOST.", related=[f"#/{key}"])
            raise unknown_property(key, sorted(allowed))
    example = ('"Links": {"InitiatorEndpoints": [{"@odata.id": "' + host_endpoint("b") + '"}], '
               '"TargetEndpoints": [{"@odata.id": "' + gpu_endpoint("gpu0") + '"}]}')
    links = body.get("Links")
    if links is None:
        raise missing("Links", example)
    if not isinstance(links, dict):
        raise type_error(links, "Links", "an object")
    for key in links:
        if key not in ("InitiatorEndpoints", "TargetEndpoints"):
            raise unknown_property(f"Links/{key}", ["Links/InitiatorEndpoints", "Links/TargetEndpoints"])
    endpoints = {path for path, r in resources.items() if r.get("@odata.type") == TYPES["Endpoint"]}
    hosts = sorted(p for p in endpoints if "/Endpoints/host-" in p)
    gpus = sorted(p for p in endpoints if "/Endpoints/gpu-" in p)

    def one(prop: str, choices: list[str]) -> str:
        value = links.get(prop)
        if value is None:
            raise missing(f"Links/{prop}", example)
        if (not isinstance(value, list) or len(value) != 1 or not isinstance(value[0], dict)
                or not isinstance(value[0].get("@odata.id"), str)):
            raise type_error(value, f"Links/{prop}", 'one reference: [{"@odata.id": "..."}]')
        target = value[0]["@odata.id"].rstrip("/")
        if target not in endpoints:
            error = not_found("Endpoint", target, f"Use one of: {', '.join(choices)}.")
            error.http = 400   # the request's URI exists; a reference in its body does not
            error.related = [f"#/Links/{prop}/0/@odata.id"]
            raise error
        if target not in choices:
            raise not_in_list(target, f"Links/{prop}", choices)
        return target

    gpu = one("TargetEndpoints", gpus).rsplit("/gpu-", 1)[1]
    vm = one("InitiatorEndpoints", hosts).rsplit("/host-", 1)[1]
    keep = False
    oem = body.get("Oem")
    if oem is not None:
        vendor = oem.get("VfioCxl") if isinstance(oem, dict) else None
        if not isinstance(vendor, dict) or set(vendor) - {"KeepVRAM"} or not isinstance(vendor.get("KeepVRAM", False), bool):
            raise type_error(oem, "Oem", '{"VfioCxl": {"KeepVRAM": true|false}}')
        keep = vendor.get("KeepVRAM", False)
    return gpu, vm, keep
