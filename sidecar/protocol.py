"""The app socket's message format, version 1 (Contract 2).

Standard library only: ``sidecar.client`` imports this module into the model server.

One datagram is one JSON object, UTF-8, at most ``MAX_MESSAGE_BYTES``. Every message names its
format version (``v``), its ``kind`` and the sender's ``pid``. Kinds:

``hello``      ``gpus``: the UUIDs the process uses (at most 64). Announces the pod's GPUs.
               Optional ``publisher``: what sends, as ``name/version`` (the injected publisher
               sends ``gpu-sidecar-inject/<agent release>``), so that an agent can say once
               when a publisher of another release talks to it; at most 64 characters of
               letters, digits and ``._+/-``.
``allocator``  ``gpu`` and the caching allocator's figures in bytes and counts:
               ``reserved_bytes``, ``allocated_bytes``, ``active_bytes``, ``inactive_split_bytes``,
               ``alloc_retries``, ``ooms``; optional ``largest_free_block_bytes``,
               ``private_pool_bytes``.
``latency``    ``gpu``, ``bounds`` (finite, strictly increasing upper bounds in seconds, at most
               64), ``counts`` (cumulative counts, one per bound plus one for +Inf, never
               decreasing) and ``sum`` (seconds). Counts are cumulative since the process started.
``round``      one publish round of one process in one datagram: ``gpus`` (as in hello),
               ``allocators`` (a list of allocator objects: ``gpu`` and the allocator fields)
               and ``latency`` (a list of latency objects: ``gpu``, ``bounds``, ``counts``,
               ``sum``). The kernel queues only ``net.unix.max_dgram_qlen`` (10 by default, and
               a pod cannot raise it) datagrams per socket, so a round of 8 GPUs sent as 17
               messages loses some whenever a few processes publish at once; as one it does not.
               A process that times requests for several GPUs (a tensor-parallel server) sends
               its histogram for each GPU it names, the same counts: each GPU served each
               request (a client before this sent it for its first GPU only; both are valid).
               A round larger than ``MAX_MESSAGE_BYTES`` (about 14 GPUs with their histograms)
               is split by the sender into several rounds, each a whole part of the GPUs and
               naming only those in its ``gpus``.

The agent's bounds on size and buckets are options (``--app-max-message-bytes``,
``--app-max-buckets``); the defaults here are what the client keeps to.

The single-purpose kinds stay accepted, so clients and agents of different releases work
together. A round is validated whole: one bad part refuses the round (counted by reason).

Unknown fields are rejected rather than ignored: a typo must not pass for a missing figure, and
a new field is a new version. One exception, the hello's optional ``publisher``, added within
version 1: an agent from before it refuses such a hello (``unknown_field``) and nothing else,
which is why the injected publisher sends it in a hello of its own, never in a round.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

VERSION = 1
MAX_MESSAGE_BYTES = 8192
MAX_GPUS = 64
MAX_BUCKETS = 64
MAX_BYTES = 1 << 50  # 1 PiB: no single GPU has more; anything above is corrupt
MAX_COUNT = 1 << 53  # exact in a JSON double
DEFAULT_SOCKET_PATH = "/run/gpu-sidecar/app.sock"
ENV_PREFIX = "GPU_SIDECAR_"  # of every variable of the agent: sidecar.config takes it from here
SOCKET_ENV = ENV_PREFIX + "SOCKET"  # the socket path, read by the client and the agent alike

# Latency buckets (seconds) shared by the client and the simulator: fine around the 50-300 ms
# where the seed's latency went from 80 to 260 ms, coarse beyond.
DEFAULT_LATENCY_BOUNDS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)

# \Z, not $: "$" also matches before a trailing newline, which would reach a label
UUID_RE = re.compile(r"\A(GPU|MIG)-[0-9A-Za-z][0-9A-Za-z/\-]{3,95}\Z")
PUBLISHER_RE = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._+/-]{0,63}\Z")  # a hello's publisher: it is logged

ALLOCATOR_REQUIRED = (
    "reserved_bytes",
    "allocated_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "alloc_retries",
    "ooms",
)
ALLOCATOR_OPTIONAL = ("largest_free_block_bytes", "private_pool_bytes")
_COMMON = ("v", "kind", "pid")
_FIELDS = {
    "hello": frozenset((*_COMMON, "gpus", "publisher")),
    "allocator": frozenset((*_COMMON, "gpu", *ALLOCATOR_REQUIRED, *ALLOCATOR_OPTIONAL)),
    "latency": frozenset((*_COMMON, "gpu", "bounds", "counts", "sum")),
    "round": frozenset((*_COMMON, "gpus", "allocators", "latency")),
}
_ALLOCATOR_ITEM = frozenset(("gpu", *ALLOCATOR_REQUIRED, *ALLOCATOR_OPTIONAL))
_LATENCY_ITEM = frozenset(("gpu", "bounds", "counts", "sum"))


class Rejected(ValueError):
    """A message that fails validation; ``reason`` is the counter label, the text says why."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Hello:
    pid: int
    gpus: tuple[str, ...]
    publisher: str | None = None  # "name/version" of the sender, when it says


@dataclass(frozen=True, slots=True)
class Allocator:
    pid: int
    gpu: str
    reserved_bytes: int
    allocated_bytes: int
    active_bytes: int
    inactive_split_bytes: int
    alloc_retries: int
    ooms: int
    largest_free_block_bytes: int | None = None
    private_pool_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class Latency:
    pid: int
    gpu: str
    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float


@dataclass(frozen=True, slots=True)
class Round:
    pid: int
    gpus: tuple[str, ...]
    allocators: tuple[Allocator, ...] = ()
    latency: tuple[Latency, ...] = ()


Message = Hello | Allocator | Latency | Round


def encode(message: Message) -> bytes:
    """The datagram for ``message``; raises ValueError if it would be refused."""
    data = _serialise(message)
    if len(data) > MAX_MESSAGE_BYTES:
        raise ValueError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    return data


def _serialise(message: Message) -> bytes:
    body: dict[str, Any] = {"v": VERSION}
    if isinstance(message, Hello):
        body |= {"kind": "hello", "pid": message.pid, "gpus": list(message.gpus)}
        if message.publisher is not None:
            body["publisher"] = message.publisher
    elif isinstance(message, Allocator):
        body |= {"kind": "allocator", "pid": message.pid, **_allocator_body(message)}
    elif isinstance(message, Latency):
        body |= {"kind": "latency", "pid": message.pid, "gpu": message.gpu,
                 "bounds": list(message.bounds), "counts": list(message.counts),
                 "sum": message.sum}
    else:
        body |= {"kind": "round", "pid": message.pid, "gpus": list(message.gpus),
                 "allocators": [_allocator_body(a) for a in message.allocators],
                 "latency": [{"gpu": h.gpu, "bounds": list(h.bounds), "counts": list(h.counts),
                              "sum": h.sum} for h in message.latency]}
    return json.dumps(body, separators=(",", ":"), allow_nan=False).encode()


def split_round(message: Round) -> list[bytes]:
    """The datagrams for a round: one, or as few as fit ``MAX_MESSAGE_BYTES`` when it does not,
    each carrying whole GPUs (a GPU's figures are never split) and naming only its own GPUs in
    ``gpus`` (the first also those without figures), so the UUID list is not repeated."""
    data = _serialise(message)
    if len(data) <= MAX_MESSAGE_BYTES:
        return [data]
    order = list(dict.fromkeys([*(a.gpu for a in message.allocators),
                                *(h.gpu for h in message.latency)]))
    bare = tuple(g for g in message.gpus if g not in order)

    def part(gpus: list[str], first: bool) -> bytes:
        return _serialise(Round(
            message.pid, (*(bare if first else ()), *gpus),
            tuple(a for a in message.allocators if a.gpu in gpus),
            tuple(h for h in message.latency if h.gpu in gpus)))

    out: list[bytes] = []
    if bare and (not order or len(part(order[:1], True)) > MAX_MESSAGE_BYTES):
        out.append(_fits(_serialise(Round(message.pid, bare)), "the GPU list"))  # on its own
        bare = ()
    taken: list[str] = []
    last = b""
    for gpu in order:  # greedy: add GPUs while the part still fits
        trial = part([*taken, gpu], not out)
        if len(trial) <= MAX_MESSAGE_BYTES:
            taken.append(gpu)
            last = trial
            continue
        if not taken:
            raise ValueError(f"the figures of {gpu} alone exceed {MAX_MESSAGE_BYTES} bytes")
        out.append(last)
        taken, last = [gpu], _fits(part([gpu], False), f"the figures of {gpu}")
    if last:
        out.append(last)
    return out


def _fits(data: bytes, what: str) -> bytes:
    if len(data) > MAX_MESSAGE_BYTES:
        raise ValueError(f"{what} alone exceed {MAX_MESSAGE_BYTES} bytes")
    return data


def _allocator_body(message: Allocator) -> dict[str, Any]:
    body: dict[str, Any] = {"gpu": message.gpu}
    for name in ALLOCATOR_REQUIRED:
        body[name] = getattr(message, name)
    for name in ALLOCATOR_OPTIONAL:
        value = getattr(message, name)
        if value is not None:
            body[name] = value
    return body


def _reject_constant(name: str) -> Any:
    raise Rejected("bad_number", f"{name} is not a number JSON allows")


def decode(data: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES,
           max_buckets: int = MAX_BUCKETS) -> Message:
    """Parse and validate one datagram; raises ``Rejected`` with a reason and an explanation.

    ``max_bytes`` and ``max_buckets`` are the receiver's bounds (``--app-max-message-bytes``,
    ``--app-max-buckets``); the defaults are what ``encode`` and the client keep to."""
    if len(data) > max_bytes:
        raise Rejected("too_large", f"datagram of {len(data)} bytes exceeds {max_bytes}; split "
                       "it (protocol.split_round) or raise --app-max-message-bytes")
    try:
        body = json.loads(data.decode("utf-8"), parse_constant=_reject_constant)
    except Rejected:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise Rejected("not_json", f"not a UTF-8 JSON document: {str(exc)[:80]}") from None
    if not isinstance(body, dict):
        raise Rejected("not_object", "a message is a JSON object")
    version = body.get("v")
    if type(version) is not int:
        raise Rejected("bad_version", "field 'v' (format version) is missing or not an integer")
    if version != VERSION:
        raise Rejected("bad_version", f"format version {version!r} is not supported (want {VERSION})")
    kind = body.get("kind")
    if kind not in _FIELDS:
        raise Rejected("bad_kind", f"kind {str(kind)[:32]!r} is not one of {sorted(_FIELDS)}")
    unknown = set(body) - _FIELDS[kind]
    if unknown:
        raise Rejected("unknown_field", f"unknown fields for {kind}: {sorted(unknown)[:5]}")
    pid = _int(body, "pid", 1, 1 << 22)
    if kind == "hello":
        return Hello(pid, _gpus(body), _publisher(body))
    if kind == "round":
        return _round(body, pid, max_buckets)
    gpu = _uuid(body.get("gpu"))
    if kind == "allocator":
        return _allocator(body, pid, gpu)
    return _latency(body, pid, gpu, max_buckets)


def _gpus(body: dict[str, Any]) -> tuple[str, ...]:
    gpus = body.get("gpus")
    if not isinstance(gpus, list) or not gpus or len(gpus) > MAX_GPUS:
        raise Rejected("bad_type", f"'gpus' must be a list of 1..{MAX_GPUS} GPU UUIDs")
    return tuple(_uuid(g) for g in gpus)


def _publisher(body: dict[str, Any]) -> str | None:
    value = body.get("publisher")
    if value is None and "publisher" not in body:
        return None
    if not isinstance(value, str) or not PUBLISHER_RE.match(value):
        raise Rejected("bad_type", "'publisher' must be name/version: 1..64 letters, digits or ._+/-")
    return value


def _round(body: dict[str, Any], pid: int, max_buckets: int) -> Round:
    parts = []
    for name, allowed in (("allocators", _ALLOCATOR_ITEM), ("latency", _LATENCY_ITEM)):
        items = body.get(name, [])
        if not isinstance(items, list) or len(items) > MAX_GPUS:
            raise Rejected("bad_type", f"'{name}' must be a list of at most {MAX_GPUS} objects")
        for item in items:
            if not isinstance(item, dict):
                raise Rejected("bad_type", f"every entry of '{name}' is a JSON object")
            unknown = set(item) - allowed
            if unknown:
                raise Rejected("unknown_field", f"unknown fields in {name}: {sorted(unknown)[:5]}")
        parts.append(items)
    allocators = tuple(_allocator(a, pid, _uuid(a.get("gpu"))) for a in parts[0])
    latency = tuple(_latency(h, pid, _uuid(h.get("gpu")), max_buckets) for h in parts[1])
    return Round(pid, _gpus(body), allocators, latency)


def _allocator(body: dict[str, Any], pid: int, gpu: str) -> Allocator:
    figures = {name: _int(body, name, 0, MAX_BYTES) for name in ALLOCATOR_REQUIRED}
    optional = {
        name: _int(body, name, 0, MAX_BYTES) for name in ALLOCATOR_OPTIONAL if name in body
    }
    reserved = figures["reserved_bytes"]
    for name in ("allocated_bytes", "active_bytes", "inactive_split_bytes",
                 *optional.keys()):
        value = figures.get(name, optional.get(name))
        if value is not None and value > reserved:
            raise Rejected("inconsistent", f"{name}={value} exceeds reserved_bytes={reserved}")
    return Allocator(pid, gpu, **figures, **optional)


def _latency(body: dict[str, Any], pid: int, gpu: str, max_buckets: int) -> Latency:
    bounds, counts, total = body.get("bounds"), body.get("counts"), body.get("sum")
    if not isinstance(bounds, list) or not bounds:
        raise Rejected("bad_type", "'bounds' must be a non-empty list of numbers")
    if len(bounds) > max_buckets:
        raise Rejected("too_many_buckets", f"{len(bounds)} latency bounds, more than "
                       f"{max_buckets}; use fewer buckets or raise --app-max-buckets")
    if not isinstance(counts, list) or len(counts) != len(bounds) + 1:
        raise Rejected("bad_type", "'counts' must have one entry per bound plus one for +Inf")
    clean_bounds: list[float] = []
    for b in bounds:
        if type(b) not in (int, float) or not math.isfinite(b) or b <= 0:
            raise Rejected("out_of_range", "every bound must be a finite number of seconds > 0")
        if clean_bounds and b <= clean_bounds[-1]:
            raise Rejected("out_of_range", "bounds must be strictly increasing")
        clean_bounds.append(float(b))
    previous = 0
    for c in counts:
        if type(c) is not int or not 0 <= c <= MAX_COUNT:
            raise Rejected("out_of_range", f"every count must be an integer in 0..{MAX_COUNT}")
        if c < previous:
            raise Rejected("inconsistent", "cumulative counts must never decrease")
        previous = c
    if isinstance(total, bool) or not isinstance(total, (int, float)) \
            or not math.isfinite(total) or total < 0:
        raise Rejected("out_of_range", "'sum' must be a finite number of seconds >= 0")
    return Latency(pid, gpu, tuple(clean_bounds), tuple(counts), float(total))


def _int(body: dict[str, Any], name: str, low: int, high: int) -> int:
    if name not in body:
        raise Rejected("missing_field", f"field {name!r} is required")
    value = body[name]
    if type(value) is not int:  # bool is an int subclass; type() keeps it out
        raise Rejected("bad_type", f"field {name!r} must be an integer, not {type(value).__name__}")
    if not low <= value <= high:
        raise Rejected("out_of_range", f"field {name!r}={value} is outside {low}..{high}")
    return value


def _uuid(value: Any) -> str:
    if not isinstance(value, str) or not UUID_RE.match(value):
        raise Rejected("bad_uuid", f"{str(value)[:48]!r} is not a GPU or MIG UUID")
    return value
