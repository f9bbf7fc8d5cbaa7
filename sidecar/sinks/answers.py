"""What a receiver's answer means and when to try again: one ``Policy`` per receiver kind.

Every decision about an answer lives here, so that the delivery rules (docs/reliability.md)
can be read in one place:

- a 2xx is final: the request was stored;
- a 3xx is an answer about the URL, never followed: retried like an outage (``redirect``);
- the statuses a kind's receivers use for "busy, try later" (``Policy.retried``) and network
  errors are retried with exponential backoff, full jitter and a floor that ``Retry-After`` can
  lengthen (up to ``Policy.retry_after_cap_s``), never shorten;
- an answer about the data itself (``Policy.data_refusals``: 400, 413, 422) sets a batch aside;
  a 400 before the run had any request accepted is first checked with an empty request by the
  spooled sender (``SpooledSink._url_or_data``): refused as well, the URL is wrong, not the data;
- any other refusal (401, 403, 404, 405, 415, 501, ...) says that the URL, the credentials or
  the receiver are wrong, not the data: a spooled sink keeps every batch (``Held``) and tries
  the head again every ``--retry-max-backoff`` seconds.

What a receiver said is shortened and every configured secret masked before any log line or
error carries it.
"""

from __future__ import annotations

import email.utils
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any
from urllib.parse import urljoin, urlsplit

import tenacity

from sidecar.config import RETRY_AFTER_CAP_S
from sidecar.urls import redact_url

BODY_LOGGED = 300  # characters of a receiver's answer kept in a log line
# the first retry's wait, the backoff's floor (it grows from there up to --retry-max-backoff); no
# option sets it: the sinks take it as a keyword, for tests that retry faster or not at all
INITIAL_BACKOFF_S = 0.5


@dataclass(frozen=True)
class Response:
    """What a receiver answered: only what the sinks and the policy look at. ``unread`` says why
    the body could not be read whole (time out, connection lost): a 2xx stays final all the
    same, and the sink says that it could not read the rest."""

    status_code: int
    headers: Mapping[str, str]  # case-insensitive ``get``
    content: bytes
    url: str
    unread: str | None = None

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")


class Retryable(Exception):
    """Worth another try after a backoff: the network, a busy receiver, a redirect, a secret
    file that cannot be read right now."""

    def __init__(self, reason: str, detail: str, retry_after: float | None = None) -> None:
        super().__init__(detail)
        self.reason = reason
        self.retry_after = retry_after


class Refused(Exception):
    """The receiver refused the request; ``about_data`` tells whether it objects to the data (the
    batch is set aside) or to the URL, the credentials or itself (the batch is kept)."""

    def __init__(self, status: int, detail: str, hint: str, *, about_data: bool) -> None:
        super().__init__(detail)
        self.status = status
        self.hint = hint
        self.about_data = about_data


class Held(Retryable):
    """A refusal that is not about the data (wrong URL, credentials, receiver): the batch stays
    in the spool and is tried again after the longest backoff, since nothing changes by itself
    soon."""

    def __init__(self, refused: Refused) -> None:
        super().__init__(f"http_{refused.status}", str(refused))
        self.status = refused.status
        self.hint = refused.hint


def mask(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every secret replaced, longest first (a secret may contain another)."""
    for secret in sorted(secrets, key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header: a number of seconds or an HTTP date."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _text(response: Response) -> str:
    return response.text


@dataclass(frozen=True)
class Endpoint:
    """Where one kind of receiver takes a protocol, and from which release: what a hint about a
    refused URL may suggest. ``requires`` names the minimum release (and any flag), as checked
    in the receiver's changelog (docs/configuration.md, *Receivers and their versions*)."""

    receiver: str
    path: str
    requires: str


@dataclass(frozen=True, kw_only=True)
class Policy:
    """How one kind of receiver answers, and what the agent does about each answer.

    Built once per kind (``REMOTE_WRITE``, ``OTLP``); the backoff's first and longest waits are
    the configuration's (``--retry-max-backoff``), given to ``retrying``."""

    retried: frozenset[int]
    """Statuses that mean "busy, try later": retried with backoff like a network error."""
    hints: Mapping[int, str]
    """Advice per status for the log line: what to fix."""
    data_refusals: frozenset[int] = frozenset({400, 413, 422})
    """Answers about the data itself: only these set a batch aside (and split a merged request);
    any other refusal keeps the batch, so a fixed URL or token delivers the whole backlog."""
    said: Callable[[Response], str] = _text
    """What the receiver said, as text (OTLP receivers answer a protobuf ``Status``)."""
    retry_after_cap_s: float = RETRY_AFTER_CAP_S
    """``Retry-After`` is honoured up to this: a receiver asking for a day must not stall the
    spool for a day."""
    closing_retry_s: float = 0.25
    """While the agent shuts down, retries are at most this far apart: the time left goes to
    sending."""
    protocol: str = "remote-write"
    endpoints: tuple[Endpoint, ...] = ()
    """Where each receiver takes this protocol: the hint for a refused URL is built from them."""
    url_statuses: frozenset[int] = frozenset({404})
    """Refusals that say "nothing here takes this protocol": their hint is ``url_hint``."""

    def url_hint(self, url: str) -> str:
        """What to check when the receiver refuses the URL itself. Never names the refused URL
        or suggests its path again: told "use X" after X was refused, an operator tries X again.
        Where the refused path is one a receiver takes this protocol at, the receiver is older
        than that or has the protocol off, so the hint says which releases (and flags) take it;
        the other receivers' paths follow, for a URL that names the wrong receiver."""
        path = urlsplit(url).path.rstrip("/")
        longest = max((e.path for e in self.endpoints if path.endswith(e.path)), key=len,
                      default=None)
        matched = [e for e in self.endpoints if e.path == longest]
        others = [e for e in self.endpoints if e.path != longest and e.path not in path]
        listed = "; ".join(f"{e.receiver} {_verb([e])} {e.path} ({e.requires})" for e in others)
        if not matched:
            return f"no receiver takes {self.protocol} at this path: {listed}"
        parts = [f"the path is where {_names(matched)} {_verb(matched)} {self.protocol}, yet the "
                 f"receiver refuses it: check its version and that {self.protocol} is on "
                 f"({'; '.join(f'{e.receiver}: {e.requires}' for e in matched)})"]
        if others:
            parts.append(f"elsewhere: {listed}")
        return "; ".join(parts)

    def hint(self, status: int, url: str) -> str:
        """The advice for a refusal: about the URL (``url_hint``) or per status."""
        if status in self.url_statuses and self.endpoints:
            return self.url_hint(url)
        return self.hints.get(status, "the receiver refused the request")

    def check(self, response: Response, secrets: Iterable[str] = ()) -> None:
        """Raise ``Retryable`` or ``Refused`` unless the receiver accepted the request."""
        status = response.status_code
        if 200 <= status < 300:
            return
        secrets = list(secrets)
        if 300 <= status < 400:
            location = response.headers.get("Location", "")
            target = mask(redact_url(urljoin(response.url, location)), secrets) if location else "?"
            raise Retryable("redirect", f"HTTP {status}: the receiver redirects to {target}; "
                            "redirects are never followed: configure that URL instead")
        said = mask(self.said(response), secrets)[:BODY_LOGGED].strip()
        detail = f"HTTP {status}: {said}"
        if status in self.retried:
            raise Retryable("http_429" if status == 429 else f"http_{status // 100}xx", detail,
                            parse_retry_after(response.headers.get("Retry-After")))
        raise Refused(status, detail, self.hint(status, response.url),
                      about_data=status in self.data_refusals)

    def failure_reasons(self) -> tuple[str, ...]:
        """The push-failure reasons a sink counts from its first push, at 0 until they happen,
        so that alerts see the first failure."""
        return ("network", "tls", "credentials", "redirect", "http_429", "http_5xx", "internal",
                *(f"http_{status}" for status in self.hints))

    def wait(self, *, initial_s: float, max_s: float,
             closing: Callable[[], bool] = lambda: False) -> tenacity.wait.wait_base:
        return _Backoff(self, initial_s, max_s, closing)

    def retrying(self, *, initial_s: float, max_s: float, stop: Any, sleep: Any,
                 closing: Callable[[], bool] = lambda: False) -> tenacity.Retrying:
        """Retry ``Retryable`` until ``stop`` says so; any other outcome ends the attempts."""
        return tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(Retryable),
            wait=self.wait(initial_s=initial_s, max_s=max_s, closing=closing),
            stop=stop, sleep=sleep, reraise=True)


def _names(endpoints: list[Endpoint]) -> str:
    names = [e.receiver for e in endpoints]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _verb(endpoints: list[Endpoint]) -> str:
    """"take" for several receivers (or one named "X and Y"), else "takes"."""
    plural = len(endpoints) > 1 or " and " in endpoints[0].receiver
    return "take" if plural else "takes"


class _Backoff(tenacity.wait.wait_base):
    """Exponential backoff with full jitter above a floor: ``initial_s`` plus a wait drawn
    uniformly from zero to ``initial_s * 2**(attempt - 1)`` (tenacity's
    ``wait_random_exponential``), ``max_s`` at most. Jitter from the first retry on: a fleet
    that lost its receiver together does not come back in step (a floor that clipped the draw
    instead would put most first retries on the floor itself). A receiver's ``Retry-After``
    raises the wait (capped), never lowers it; a ``Held`` refusal waits the longest; closing
    cuts every wait short."""

    def __init__(self, policy: Policy, initial_s: float, max_s: float,
                 closing: Callable[[], bool]) -> None:
        self.policy = policy
        self.max_s = max_s
        self.closing = closing
        self.jittered = (tenacity.wait_fixed(initial_s)
                         + tenacity.wait_random_exponential(multiplier=initial_s,
                                                            max=max(0.0, max_s - initial_s)))

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        outcome = retry_state.outcome
        exc = outcome.exception() if outcome is not None else None
        if isinstance(exc, Held):
            wait = self.max_s
        else:
            wait = float(self.jittered(retry_state))
            if isinstance(exc, Retryable) and exc.retry_after is not None:
                wait = max(wait, min(exc.retry_after, self.policy.retry_after_cap_s))
        return min(wait, self.policy.closing_retry_s) if self.closing() else wait


HINTS = MappingProxyType({
    400: "the receiver refused the data itself; the batch is set aside in the spool's rejected/",
    401: "authentication failed: check the bearer token or basic-auth files",
    403: "not authorised: check the token's permissions or the tenant header",
    404: "no remote-write endpoint at this URL (the hint names where each receiver takes it)",
    405: "wrong method for this URL: is it the remote-write path?",
    413: "batch too large for the receiver: lower --batch-max-samples",
    422: "the receiver refused the data itself (unprocessable); the batch is set aside in the "
         "spool's rejected/",
})

# Minimum releases as their changelogs say (docs/configuration.md, *Receivers and their
# versions*, cites each). A path not confirmed there (Thanos Receive's OTLP, from v0.38.0) is
# not suggested.
REMOTE_WRITE_ENDPOINTS = (
    Endpoint("Prometheus", "/api/v1/write",
             "2.33.0 or later, started with --web.enable-remote-write-receiver"),
    Endpoint("VictoriaMetrics and vmagent", "/api/v1/write",
             "any release, Debian's 1.79 included"),
    Endpoint("Mimir", "/api/v1/push", "any release, 2.0.0 on"),
    Endpoint("Thanos Receive", "/api/v1/receive", "any release"),
)

REMOTE_WRITE = Policy(
    # remote-write 1.0 and the Pushgateway: 429 and every 5xx are "try later"
    retried=frozenset({429, *range(500, 600)}),
    hints=HINTS,
    endpoints=REMOTE_WRITE_ENDPOINTS,
)
"""Remote-write receivers (Prometheus, VictoriaMetrics, Mimir, vmagent) and the Pushgateway."""


def _otlp_said(response: Response) -> str:
    """An OTLP receiver answers a failure with a google.rpc.Status: its message (or code), else
    the text of an answer that is not protobuf."""
    if is_protobuf(response):
        # imported here: an agent without an OTLP sink loads nothing of OTLP
        from sidecar.wire import otlp as otlp_wire

        return otlp_wire.status_message(response.content)
    return response.text


def is_protobuf(response: Response) -> bool:
    return "protobuf" in (response.headers.get("Content-Type") or "").lower()


OTLP_HINTS = MappingProxyType({
    **HINTS,
    400: "the receiver refused the data itself (OTLP: bad data); the batch is set aside in the "
         "spool's rejected/",
    404: "no OTLP endpoint at this URL (the hint names where each receiver takes it)",
    405: "wrong method for this URL: is it the OTLP metrics path (.../v1/metrics)?",
    415: "the receiver does not take protobuf bodies or gzip: it must support OTLP/HTTP protobuf",
    501: "the receiver does not implement OTLP metrics at this URL",
})

OTLP_ENDPOINTS = (
    Endpoint("VictoriaMetrics and vmagent", "/opentelemetry/v1/metrics",
             "OTLP from v1.92.0, this path from early 2024; Debian's 1.79 takes no OTLP"),
    Endpoint("VictoriaMetrics and vmagent", "/opentelemetry/api/v1/push",
             "v1.92.0 or later: their first OTLP path"),
    Endpoint("Prometheus", "/api/v1/otlp/v1/metrics",
             "3.0.0 or later with --web.enable-otlp-receiver; 2.47.0 to 2.55 with "
             "--enable-feature=otlp-write-receiver"),
    Endpoint("Mimir", "/otlp/v1/metrics", "2.3 or later, experimental there"),
    Endpoint("an OpenTelemetry Collector", "/v1/metrics",
             "its otlp receiver's HTTP protocol, port 4318"),
)

OTLP = Policy(
    # the OTLP/HTTP specification's retryable statuses, and 500 against its "MUST NOT retry" on
    # purpose: Prometheus 3 answers 500 for transient append errors, and nothing spooled may be
    # lost. Any other 5xx (501 above all) says the receiver cannot take OTLP here: held.
    retried=frozenset({429, 500, 502, 503, 504}),
    hints=OTLP_HINTS,
    said=_otlp_said,
    protocol="OTLP/HTTP",
    endpoints=OTLP_ENDPOINTS,
)
"""OTLP/HTTP metrics receivers (an OpenTelemetry Collector, Prometheus 3, VictoriaMetrics)."""

FAILURE_REASONS = REMOTE_WRITE.failure_reasons()
