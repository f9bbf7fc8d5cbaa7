"""``gpu-sidecar resend-rejected``: send again the batches a receiver refused for their data.

A batch refused for its data (400, 413, 422) is set aside in its spool's ``rejected/``, never
retried by the agent: the receiver would refuse it again. Once the cause is fixed (a receiver's
limit raised, a relabelling rule corrected), an operator sends them again with this command,
beside the running agent (``kubectl exec ... -- gpu-sidecar resend-rejected``, with the agent's
own environment): each batch is sent once, as stored, oldest first, and deleted only after a 2xx.
A batch refused again stays; a receiver that cannot be reached stops the round for that receiver,
and what is left stays for the next one.

The running agent holds its spool's lock; this command never touches the batches waiting there,
only ``rejected/``, whose files the agent no longer reads. The agent's own gauge of the bytes
kept there (``gpu_sidecar_spool_bytes{state="rejected"}``) counts the removed files until its
next start.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import structlog

from sidecar.config import Config
from sidecar.durability.spool import read_batch
from sidecar.sinks.answers import Policy, Refused, Retryable
from sidecar.sinks.http import Http
from sidecar.urls import redact_url

log = structlog.get_logger("sidecar.resend")


@dataclass(frozen=True, kw_only=True)
class Resent:
    """What one receiver's round did: batches and samples sent, refused again, left unsent."""

    sink: str
    directory: Path
    sent: int = 0
    samples: int = 0
    refused: int = 0
    left: int = 0
    unreadable: int = 0
    stopped_by: str | None = None  # why the round stopped early, when it did

    @property
    def complete(self) -> bool:
        return not (self.refused or self.left or self.unreadable)


def resend_rejected(url: str, directory: Path, cfg: Config, *, sink: str,
                    headers: Mapping[str, str], policy: Policy) -> Resent:
    """Send every batch of ``directory`` (a spool's ``rejected/``) to ``url`` once, oldest
    first; a batch is deleted only after the receiver accepted it."""
    batches = sorted(directory.glob("*.batch")) if directory.is_dir() else []
    sent = samples = refused = unreadable = 0
    stopped_by = None
    http = Http(cfg)
    try:
        for index, path in enumerate(batches):
            try:
                count, body = read_batch(path)
            except (OSError, ValueError) as exc:
                unreadable += 1
                log.error("rejected_batch_unreadable", sink=sink, batch=path.name,
                          error=str(exc), effect="left where it is")
                continue
            try:
                response = http.request("POST", url, data=body, headers=dict(headers))
                http.check(response, policy)
            except Refused as exc:
                if not exc.about_data:  # the URL or the credentials: no batch will pass
                    stopped_by = f"{exc} ({exc.hint})"
                    return _resent(sink, directory, sent, samples, refused, unreadable,
                                   len(batches) - index, stopped_by)
                refused += 1
                log.error("rejected_batch_refused_again", sink=sink, url=redact_url(url),
                          batch=path.name, samples=count, receiver_said=str(exc),
                          effect="left in rejected/")
                continue
            except Retryable as exc:
                stopped_by = str(exc)
                return _resent(sink, directory, sent, samples, refused, unreadable,
                               len(batches) - index, stopped_by)
            sent += 1
            samples += count
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:  # taken, but it stays: the next round would send it again
                log.error("rejected_batch_not_removed", sink=sink, batch=path.name,
                          error=exc.strerror, effect="delivered; delete it by hand, or the "
                          "next resend-rejected sends it a second time")
    finally:
        http.close()
    return _resent(sink, directory, sent, samples, refused, unreadable, 0, stopped_by)


def _resent(sink: str, directory: Path, sent: int, samples: int, refused: int, unreadable: int,
            left: int, stopped_by: str | None) -> Resent:
    outcome = Resent(sink=sink, directory=directory, sent=sent, samples=samples, refused=refused,
                     left=left, unreadable=unreadable, stopped_by=stopped_by)
    if stopped_by is not None:
        log.error("resend_stopped", sink=sink, sent=sent, left=left, error=stopped_by,
                  effect="what is left stays in rejected/ for the next round")
    return outcome
