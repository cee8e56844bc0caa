"""The EventService's deliveries: the FM's events (``events --follow``) as Redfish Events,
POSTed to every subscription's Destination.

One thread follows the FM; one thread delivers, from a bounded queue (a destination that
does not answer within DELIVERY_TIMEOUT costs that much once per event, and events beyond
MAX_QUEUED are dropped and counted, never buffered without bound)."""

from __future__ import annotations

import json
import queue
import threading
from datetime import datetime, timezone
import urllib.error
import urllib.request

from .model import EVENT_REGISTRY, TYPES, gpu_endpoint, host_endpoint, oem, ref

DELIVERY_TIMEOUT = 5.0
MAX_QUEUED = 1000

# FM event kind -> (ResourceEvent message, what it is about)
MESSAGES = {
    "gpu-server-died": ("ResourceStatusChangedCritical", "gpu"),
    "vm-died": ("ResourceStatusChangedCritical", "vm"),
    "gpu-attached": ("ResourceChanged", "gpu"),
    "gpu-released": ("ResourceChanged", "gpu"),
    "gpu-freed": ("ResourceChanged", "gpu"),
    "gpu-surprise-removal": ("ResourceChanged", "gpu"),
    "gpu-restarted": ("ResourceStatusChangedOK", "gpu"),
}


def redfish_event(ev: dict, context: str) -> dict | None:
    """The Redfish Event for one FM event, or None for the kinds not delivered."""
    if ev["kind"] not in MESSAGES:
        return None
    message, about = MESSAGES[ev["kind"]]
    origin = gpu_endpoint(ev["gpu"]) if about == "gpu" else host_endpoint(ev["vm"])
    args = [origin, "Critical"] if message == "ResourceStatusChangedCritical" else \
        [origin, "OK"] if message == "ResourceStatusChangedOK" else []
    record = {"MemberId": "0", "EventId": str(ev["seq"]),
              "EventTimestamp": datetime.fromtimestamp(ev["time"], timezone.utc).isoformat(timespec="milliseconds"),
              "MessageId": f"{EVENT_REGISTRY}.{message}", "MessageArgs": args,
              "Message": ev["message"], "MessageSeverity": "Critical" if "Critical" in message else "OK",
              "OriginOfCondition": ref(origin),
              "Oem": oem({k: v for k, v in ev.items() if k != "message"})}
    return {"@odata.type": TYPES["Event"], "Id": str(ev["seq"]), "Name": f"Fabric event {ev['kind']}",
            "Context": context, "Events": [record], "Events@odata.count": 1}


class Deliverer:
    def __init__(self, subscriptions, log=print):
        self.subscriptions = subscriptions
        self.log = log
        self.queue: queue.Queue = queue.Queue(MAX_QUEUED)
        self.dropped = 0
        self.delivered = 0
        self.thread = threading.Thread(target=self._run, name="redfish-delivery", daemon=True)
        self.thread.start()

    def offer(self, ev: dict) -> None:
        try:
            self.queue.put_nowait(ev)
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        while True:
            ev = self.queue.get()
            for sub in self.subscriptions.snapshot().values():
                body = redfish_event(ev, sub["Context"])
                if body is None:
                    continue
                req = urllib.request.Request(sub["Destination"], data=json.dumps(body).encode(), method="POST",
                                             headers={"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(req, timeout=DELIVERY_TIMEOUT) as answer:
                        answer.read(4096)
                    self.delivered += 1
                except (urllib.error.URLError, OSError) as err:
                    self.log(f"event {ev['seq']} ({ev['kind']}) to {sub['Destination']}: {err}")


def follow(fm_client, deliverer: Deliverer, since: int) -> None:
    """Hand every FM event after ``since`` to the deliverer until the FM closes the stream."""
    for ev in fm_client.follow_events(since=since):
        deliverer.offer(ev)
