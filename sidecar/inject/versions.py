"""The publisher's release, as its hello says it (``publisher``: ``name/version``, Contract 2):
the agent says once when a publisher of another release talks to it.

The injected publisher carries the release of the agent that placed it. A restarted or
upgraded agent places its own, but the app's processes that started before keep the copy they
loaded: they go on working while both speak the same protocol version (their messages are
accepted, and this says so once per release), and are refused when they do not (this says so
once, beside the rejection counted by reason ``bad_version``).
"""

from __future__ import annotations

import json
import threading

import structlog

from sidecar import __version__, protocol
from sidecar.inject import INJECT_NAME
from sidecar.sources.app_socket import AppState

log = structlog.get_logger("sidecar.inject")

MAX_SAID = 32  # distinct publishers said once each; past that, the rejection counters say it
OURS = f"{INJECT_NAME}/{__version__}"


class PublisherAwareAppState(AppState):
    """``AppState`` that also reads who publishes: each distinct ``publisher`` of a hello is
    logged once, as a warning when its release is not the agent's."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self._said: set[tuple[str, int]] = set()
        self._said_lock = threading.Lock()

    def feed(self, data: bytes) -> protocol.Message | None:
        message = super().feed(data)
        if isinstance(message, protocol.Hello):
            if message.publisher is not None:
                self._say(message.publisher, protocol.VERSION, message.pid, accepted=True)
        elif message is None and b'"publisher"' in data:
            self._refused(data)
        return message

    def _refused(self, data: bytes) -> None:
        """A refused hello that names its publisher: said once if its protocol is not ours."""
        try:
            body = json.loads(data)
        except ValueError:
            return
        if not isinstance(body, dict):
            return
        publisher, version, pid = body.get("publisher"), body.get("v"), body.get("pid")
        if isinstance(publisher, str) and protocol.PUBLISHER_RE.match(publisher) and \
                type(version) is int and version != protocol.VERSION:
            self._say(publisher, version, pid if type(pid) is int else None, accepted=False)

    def _say(self, publisher: str, version: int, pid: int | None, *, accepted: bool) -> None:
        with self._said_lock:
            key = (publisher, version)
            if key in self._said or len(self._said) >= MAX_SAID:
                return
            self._said.add(key)
        name, _, release = publisher.rpartition("/")
        if not accepted:
            log.warning("app_publisher_protocol_differs", publisher=publisher, protocol=version,
                        agent_protocol=protocol.VERSION, agent_version=__version__, pid=pid,
                        effect="its messages are refused (reason bad_version): no figures from "
                               "its processes",
                        hint="restart the app's processes so that they load the publisher this "
                             "agent placed (or run an agent of their release)")
        elif publisher != OURS and name == INJECT_NAME:
            log.warning("app_publisher_version_differs", publisher=publisher,
                        agent_version=__version__, protocol=version, pid=pid,
                        effect=f"its figures are accepted (both speak protocol version {version}); "
                               "said once per release",
                        hint="restart the app's processes to load the publisher this agent placed")
        else:
            log.info("app_publisher", publisher=publisher, release=release or None,
                     agent_version=__version__, pid=pid, note="said once per publisher")
