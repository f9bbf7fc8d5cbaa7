"""OTLP/HTTP metrics bodies: a protobuf ``ExportMetricsServiceRequest``, gzip-compressed.

Written directly in protobuf wire format (``sidecar.wire.protobuf``), as ``remote_write`` is: the
agent does not depend on protobuf at run time, and the generated OTLP classes cost several MiB of
resident memory where these few functions cost almost nothing (bench/bench_otlp.py,
bench/RESULTS.md). The tests decode every request with the official ``opentelemetry-proto``.

Each cycle is encoded once as a whole request (one ResourceMetrics per distinct resource, one
ScopeMetrics, one Metric per OTel name); a serialized message followed by another is their merge,
and merging two requests appends their ``resource_metrics``, so a batch, a merged backlog and a
replayed journal are their cycles joined, never decoded and encoded again.

Mapping (``sidecar.metrics.OTEL``): gauges become Gauge, counters monotonic Sum, the conventions'
UpDownCounters non-monotonic Sum, all cumulative; the ``_bucket``/``_sum``/``_count`` series of a
histogram become one explicit-bucket HistogramDataPoint.

Sums and histograms carry a ``start_time_unix_nano`` per series: the time the encoder first saw
the series, moved to the time of the point when a monotonic Sum's value or a Histogram's count
goes down (a reset: the source restarted counting). Resources carry ``service.instance.id``:
``<namespace>/<pod>`` when the series name a pod, else the host name.

``hw.gpu.io`` (a monotonic Sum in bytes, per GPU and ``network.io.direction``) has no series of
its own: each PCIe rate point (``metrics.GPU_IO_SOURCES``) also gives one, the integral of that
series' rate, ``rate x (its time - the previous point's time)`` added on each cycle: the NVML
byte counters' delta when the rate came from them over the same interval, close to it from GPM,
an estimate from nvmlDeviceGetPcieThroughput's 20 ms window. The first point is 0 and its time
the start time (kept per series, bounded like the others; the total never goes down, so no
reset moves it). A gap adds nothing and restarts nothing: a point whose series was absent the
cycle before, or that comes more than 3 times the series' last interval after its previous
point, adds nothing for that gap; nor does a rate that is not a finite non-negative number, for
its own interval.

Nothing a series carries makes ``cycle`` raise: a histogram point whose counts are not
non-negative integers within 64 bits, or a series that cannot be encoded at all, is left out and
counted in ``Encoder.dropped["unencodable"]``; an integer attribute outside int64 goes as a
string.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from sidecar import metrics
from sidecar.samples import Labels, Series
from sidecar.wire.protobuf import (
    DOUBLE,
    FIXED64,
    INT64_MIN,
    UINT64_MAX,
    WireType,
    fields,
    int64,
    length_delimited,
    string,
    tag,
    varint,
)

CONTENT_HEADERS = {"Content-Encoding": "gzip", "Content-Type": "application/x-protobuf"}
UNENCODABLE = "unencodable"  # the gpu_sidecar_samples_dropped_total reason
# what encoding a value the wire cannot carry raises (struct for fixed64, int() for NaN/inf)
_ENCODING_ERRORS = (ValueError, OverflowError, struct.error, TypeError)
_INT64 = range(INT64_MIN, 1 << 63)

# The tag of each field written, named after it (opentelemetry-proto: collector/metrics/v1/
# metrics_service.proto, metrics/v1/metrics.proto, common/v1/common.proto, resource/v1/resource.proto)
_LEN, _I64, _VARINT = WireType.LEN, WireType.I64, WireType.VARINT
# ExportMetricsServiceRequest
REQUEST_RESOURCE_METRICS = tag(1, _LEN)  # repeated ResourceMetrics resource_metrics = 1
# ResourceMetrics
RESOURCE_METRICS_RESOURCE = tag(1, _LEN)  # Resource resource = 1
RESOURCE_METRICS_SCOPE_METRICS = tag(2, _LEN)  # repeated ScopeMetrics scope_metrics = 2
# Resource
RESOURCE_ATTRIBUTES = tag(1, _LEN)  # repeated KeyValue attributes = 1
# ScopeMetrics
SCOPE_METRICS_SCOPE = tag(1, _LEN)  # InstrumentationScope scope = 1
SCOPE_METRICS_METRICS = tag(2, _LEN)  # repeated Metric metrics = 2
# InstrumentationScope
SCOPE_NAME = tag(1, _LEN)  # string name = 1
SCOPE_VERSION = tag(2, _LEN)  # string version = 2
# Metric
METRIC_NAME = tag(1, _LEN)  # string name = 1
METRIC_DESCRIPTION = tag(2, _LEN)  # string description = 2
METRIC_UNIT = tag(3, _LEN)  # string unit = 3
METRIC_GAUGE = tag(5, _LEN)  # Gauge gauge = 5 (oneof data)
METRIC_SUM = tag(7, _LEN)  # Sum sum = 7 (oneof data)
METRIC_HISTOGRAM = tag(9, _LEN)  # Histogram histogram = 9 (oneof data)
# Gauge, Sum, Histogram
GAUGE_DATA_POINTS = tag(1, _LEN)  # repeated NumberDataPoint data_points = 1
SUM_DATA_POINTS = tag(1, _LEN)  # repeated NumberDataPoint data_points = 1
SUM_AGGREGATION_TEMPORALITY = tag(2, _VARINT)  # AggregationTemporality aggregation_temporality = 2
SUM_IS_MONOTONIC = tag(3, _VARINT)  # bool is_monotonic = 3
HISTOGRAM_DATA_POINTS = tag(1, _LEN)  # repeated HistogramDataPoint data_points = 1
HISTOGRAM_AGGREGATION_TEMPORALITY = tag(2, _VARINT)  # (the same as Sum's)
# NumberDataPoint
NUMBER_POINT_ATTRIBUTES = tag(7, _LEN)  # repeated KeyValue attributes = 7
NUMBER_POINT_START_TIME_UNIX_NANO = tag(2, _I64)  # fixed64 start_time_unix_nano = 2
NUMBER_POINT_TIME_UNIX_NANO = tag(3, _I64)  # fixed64 time_unix_nano = 3
NUMBER_POINT_AS_DOUBLE = tag(4, _I64)  # double as_double = 4 (oneof value)
NUMBER_POINT_FLAGS = tag(8, _VARINT)  # uint32 flags = 8 (DataPointFlags)
# HistogramDataPoint
HISTOGRAM_POINT_ATTRIBUTES = tag(9, _LEN)  # repeated KeyValue attributes = 9
HISTOGRAM_POINT_START_TIME_UNIX_NANO = tag(2, _I64)  # fixed64 start_time_unix_nano = 2
HISTOGRAM_POINT_TIME_UNIX_NANO = tag(3, _I64)  # fixed64 time_unix_nano = 3
HISTOGRAM_POINT_COUNT = tag(4, _I64)  # fixed64 count = 4
HISTOGRAM_POINT_SUM = tag(5, _I64)  # optional double sum = 5
HISTOGRAM_POINT_BUCKET_COUNTS = tag(6, _LEN)  # repeated fixed64 bucket_counts = 6 (packed)
HISTOGRAM_POINT_EXPLICIT_BOUNDS = tag(7, _LEN)  # repeated double explicit_bounds = 7 (packed)
HISTOGRAM_POINT_FLAGS = tag(10, _VARINT)  # uint32 flags = 10 (DataPointFlags)
# KeyValue, AnyValue
KEY_VALUE_KEY = tag(1, _LEN)  # string key = 1
KEY_VALUE_VALUE = tag(2, _LEN)  # AnyValue value = 2
ANY_VALUE_STRING_VALUE = tag(1, _LEN)  # string string_value = 1 (oneof value)
ANY_VALUE_INT_VALUE = tag(3, _VARINT)  # int64 int_value = 3 (oneof value)

CUMULATIVE = 2  # AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE
# DataPointFlags.DATA_POINT_FLAGS_NO_RECORDED_VALUE_MASK: "the point has no value": the series
# ended (Prometheus' staleness marker, which its OTLP receiver and VictoriaMetrics' store as one)
NO_RECORDED_VALUE = varint(1)
_TRUE, _FALSE = varint(1), varint(0)  # a bool's value

# Field numbers of the answers read (the reader gives numbers, not tags)
RESPONSE_PARTIAL_SUCCESS = 1  # ExportMetricsServiceResponse: ExportMetricsPartialSuccess partial_success = 1
PARTIAL_SUCCESS_REJECTED_DATA_POINTS = 1  # ExportMetricsPartialSuccess: int64 rejected_data_points = 1
PARTIAL_SUCCESS_ERROR_MESSAGE = 2  # ExportMetricsPartialSuccess: string error_message = 2
STATUS_CODE = 1  # google.rpc.Status: int32 code = 1
STATUS_MESSAGE = 2  # google.rpc.Status: string message = 2

# a NumberDataPoint is framed before its metric is known to be a Gauge or a Sum: the same either way
NUMBER_DATA_POINTS = GAUGE_DATA_POINTS
assert NUMBER_DATA_POINTS == SUM_DATA_POINTS


def key_value(name: str, value: str | int, field_tag: bytes = RESOURCE_ATTRIBUTES) -> bytes:
    """A KeyValue as the field ``field_tag`` (Resource.attributes, NumberDataPoint.attributes or
    HistogramDataPoint.attributes); ints (``process.pid``) as AnyValue.int_value (int64), the
    rest, and an int outside int64, as string_value."""
    if isinstance(value, int) and value in _INT64:
        any_value = ANY_VALUE_INT_VALUE + varint(value)
    else:
        any_value = string(ANY_VALUE_STRING_VALUE, str(value))
    return length_delimited(field_tag, string(KEY_VALUE_KEY, name)
                            + length_delimited(KEY_VALUE_VALUE, any_value))


@dataclass(frozen=True, slots=True)
class _Point:
    """Where one Prometheus series goes: the resource it belongs to, the OTel metric, and the
    encoded attributes of its data point (plus the histogram bound, for a bucket)."""

    resource: Labels
    metric: str
    source: str  # the Prometheus name (of the histogram, for its parts)
    attributes: bytes
    cumulative: bool  # a Sum or Histogram point: it carries the start time
    monotonic: bool = False  # a monotonic Sum: its value going down is a reset
    part: str = ""  # for a histogram: _bucket, _sum or _count
    bound: float | None = None  # a _bucket series' le; inf for +Inf


@dataclass(slots=True)
class _Integral:
    """The ``hw.gpu.io`` total of one GPU and direction."""

    start: bytes  # start_time_unix_nano, encoded: the time of the series' first point
    ts_ms: int  # the time of its last point
    cycle: int  # the encoder's cycle of its last point
    step_ms: int = 0  # the last interval counted; 0 until one was
    total: float = 0.0  # bytes since start


def _otel_of(p: _Point) -> metrics.OtelSpec | None:
    return metrics.GPU_IO if p.metric == metrics.GPU_IO.name else metrics.OTEL.get(p.source)


_GAP = 3  # an interval longer than this many times the last one counted is a gap

# OTel names that several Prometheus names share (told apart by an attribute): their Metric
# gets no description, since each source's help text speaks of one direction only
_SHARED = {o.name for o in metrics.OTEL.values()
           if sum(1 for x in metrics.OTEL.values() if x.name == o.name) > 1}


class Encoder:
    """Encodes cycles; remembers where each series it has seen goes."""

    def __init__(self, resource: Labels, resource_labels: Mapping[str, str], start_ms: int,
                 scope_version: str, max_cached_series: int = 50_000) -> None:
        """``resource``: attributes of every request's resource (service.name, host.name, ...);
        ``resource_labels``: series labels that are the pod's identity, moved to the resource
        under these names; ``start_ms``: the agent's start (``start_ns``, for the bench's
        generated-class variant; each series' start time is its own, see the module)."""
        self.resource = resource
        self.resource_labels = dict(resource_labels)
        self.start_ns = FIXED64.pack(start_ms * 1_000_000)
        self.scope = string(SCOPE_NAME, "gpu-sidecar") + string(SCOPE_VERSION, scope_version)
        self._points: dict[tuple[str, Labels], _Point] = {}
        self._headers: dict[str, bytes] = {}
        self._resources: dict[Labels, bytes] = {}
        # per cumulative point (resource, metric, attributes): [start, last value or count]
        self._starts: dict[tuple[Labels, str, bytes], list] = {}
        # per hw.gpu.io series (resource, attributes): its integral of the PCIe rate
        self._io: dict[tuple[Labels, bytes], _Integral] = {}
        self._cycles = 0  # cycles encoded, to tell a series absent from the last one
        self._max = max_cached_series
        self.dropped: dict[str, int] = {UNENCODABLE: 0}  # samples left out, by reason
        own = dict(resource)
        self._pod_keys = (self.resource_labels.get("namespace", "k8s.namespace.name"),
                          self.resource_labels.get("pod", "k8s.pod.name"))
        self._host = own.get("host.name", "")

    def _point(self, name: str, labels: Labels) -> _Point:
        key = (name, labels)
        found = self._points.get(key)
        if found is None:
            if len(self._points) > self._max:
                self._points.clear()
            found = self._points[key] = self._place(name, labels)
        return found

    def _start(self, p: _Point, value: float, ts_ms: int) -> bytes:
        """The start time of a cumulative point: when its series was first seen, moved to this
        point's time when a monotonic figure went down (the source restarted counting)."""
        key = (p.resource, p.metric, p.attributes)
        state = self._starts.get(key)
        if state is None:
            if len(self._starts) > self._max:  # bounded like the placings: beyond it, series
                self._starts.clear()           # seen again start afresh
            state = self._starts[key] = [FIXED64.pack(ts_ms * 1_000_000), value]
        else:
            if p.monotonic and value < state[1]:
                state[0] = FIXED64.pack(ts_ms * 1_000_000)
            if not math.isnan(value):
                state[1] = value
        return state[0]

    def _io_point(self, p: _Point, rate: float, ts_ms: int, *, ended: bool = False
                  ) -> tuple[_Point, bytes]:
        """The ``hw.gpu.io`` point of a PCIe rate point (see the module); ``ended``: its
        series ends here (``cycle``)."""
        key = (p.resource, p.attributes)
        io = self._io.get(key)
        if io is None:
            if len(self._io) > self._max:  # bounded like the start times
                self._io.clear()
            io = self._io[key] = _Integral(FIXED64.pack(ts_ms * 1_000_000), ts_ms, self._cycles)
        else:
            step = ts_ms - io.ts_ms
            after_last = io.cycle == self._cycles - 1  # not absent from the last cycle
            in_time = step > 0 and (not io.step_ms or step <= _GAP * io.step_ms)
            if after_last and in_time and not ended:
                io.step_ms = step
                if math.isfinite(rate) and rate >= 0:
                    io.total += rate * step / 1000
            io.ts_ms, io.cycle = ts_ms, self._cycles
        point = length_delimited(SUM_DATA_POINTS, p.attributes
                                 + NUMBER_POINT_START_TIME_UNIX_NANO + io.start
                                 + NUMBER_POINT_TIME_UNIX_NANO + FIXED64.pack(ts_ms * 1_000_000)
                                 + (NUMBER_POINT_FLAGS + NO_RECORDED_VALUE if ended
                                    else NUMBER_POINT_AS_DOUBLE + DOUBLE.pack(io.total)))
        return _Point(p.resource, metrics.GPU_IO.name, p.source, p.attributes, True, True), point

    def _drop(self, samples: int) -> None:
        self.dropped[UNENCODABLE] += samples

    def _place(self, name: str, labels: Labels) -> _Point:
        source, part = metrics.histogram_of(name) or (name, "")
        otel = metrics.OTEL.get(source)
        resource: list[tuple[str, str]] = []
        attributes: dict[str, str | int] = dict(otel.attributes) if otel else {}
        bound = None
        for k, v in labels:
            if k in self.resource_labels:
                resource.append((self.resource_labels[k], v))
            elif k == "le" and part:
                bound = float(v)  # not a number: ValueError, the series is unencodable
            elif k == "pid" and v.isascii() and v.isdigit():  # not "²", which int() refuses
                attributes["process.pid"] = int(v)
            else:
                attributes[metrics.POINT_LABELS.get(k, k)] = v
        if any(k == "gpu_uuid" for k, _ in labels):
            attributes.update(metrics.GPU_ATTRIBUTES)
        attributes_tag = HISTOGRAM_POINT_ATTRIBUTES if part else NUMBER_POINT_ATTRIBUTES
        encoded = b"".join(key_value(k, v, attributes_tag) for k, v in sorted(attributes.items()))
        return _Point(tuple(sorted(resource)), otel.name if otel else name, source, encoded,
                      otel is not None and otel.instrument != "gauge",
                      otel is not None and otel.instrument in ("counter", "histogram"), part,
                      bound)

    def _header(self, p: _Point) -> bytes:
        """Name, description and unit of a Metric, encoded once."""
        head = self._headers.get(p.metric)
        if head is None:
            spec, otel = metrics.BY_NAME.get(p.source), _otel_of(p)
            head = string(METRIC_NAME, p.metric)
            if spec is not None and otel is not None:
                if otel is metrics.GPU_IO:
                    head += string(METRIC_DESCRIPTION, metrics.GPU_IO_HELP)
                elif p.metric not in _SHARED:
                    head += string(METRIC_DESCRIPTION, spec.help)
                head += string(METRIC_UNIT, otel.unit)
            head = self._headers[p.metric] = head
        return head

    def cycle(self, series: Iterable[Series], *, ended: bool = False) -> bytes:
        """One cycle as a whole ExportMetricsServiceRequest. ``ended``: the series end here (a
        clean stop): each point flagged ``NO_RECORDED_VALUE``, its value left out (a histogram's
        counts zero, its bounds kept: VictoriaMetrics skips a histogram point without buckets),
        its start time the series' own."""
        # resource -> OTel metric -> (its first point's placing, encoded points or histograms)
        grouped: dict[Labels, dict[str, tuple[_Point, list[bytes | _Histogram]]]] = {}
        histograms: dict[tuple[Labels, str, bytes], _Histogram] = {}
        self._cycles += 1
        for s in series:
            try:
                p = self._point(s.name, s.labels)
                if p.part:
                    key = (p.resource, p.metric, p.attributes)
                    h = histograms.get(key)
                    if h is None:
                        h = histograms[key] = _Histogram(p.attributes, s.timestamp_ms)
                        grouped.setdefault(p.resource, {}).setdefault(p.metric, (p, []))[1].append(h)
                    h.add(p, 0.0 if ended else s.value)
                    continue
                body = p.attributes
                if p.cumulative:
                    body += NUMBER_POINT_START_TIME_UNIX_NANO + self._start(
                        p, math.nan if ended else s.value, s.timestamp_ms)
                value = (NUMBER_POINT_FLAGS + NO_RECORDED_VALUE if ended
                         else NUMBER_POINT_AS_DOUBLE + DOUBLE.pack(s.value))
                point = length_delimited(NUMBER_DATA_POINTS, body + NUMBER_POINT_TIME_UNIX_NANO
                                         + FIXED64.pack(s.timestamp_ms * 1_000_000) + value)
            except _ENCODING_ERRORS:
                self._drop(1)
                continue
            grouped.setdefault(p.resource, {}).setdefault(p.metric, (p, []))[1].append(point)
            if p.source in metrics.GPU_IO_SOURCES:
                io, point = self._io_point(p, s.value, s.timestamp_ms, ended=ended)
                grouped[p.resource].setdefault(io.metric, (io, []))[1].append(point)
        for (resource, metric, _), h in histograms.items():
            by_metric = grouped[resource]
            points = by_metric[metric][1]
            at = next(i for i, x in enumerate(points) if x is h)
            encoded = self._histogram(resource, metric, h, ended=ended)
            if encoded is not None:
                points[at] = encoded
                continue
            self._drop(h.series)
            del points[at]
            if not points:
                del by_metric[metric]
                if not by_metric:
                    del grouped[resource]
        return b"".join(self._resource_metrics(resource, by_metric)
                        for resource, by_metric in grouped.items())

    def _histogram(self, resource: Labels, metric: str, h: _Histogram, *,
                   ended: bool = False) -> bytes | None:
        """A HistogramDataPoint, or None when it cannot be encoded: every count must be a
        non-negative integer within 64 bits (not NaN, infinite, negative or huge)."""
        counts = [h.count, *(c for _, c in h.buckets)]
        if not all(isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c)
                   and 0 <= c <= UINT64_MAX for c in counts):
            return None
        try:
            h.start = self._start(_Point(resource, metric, "", h.attributes, True, True),
                                  math.nan if ended else h.count, h.ts)
            return length_delimited(HISTOGRAM_DATA_POINTS, h.encode()
                                    + (HISTOGRAM_POINT_FLAGS + NO_RECORDED_VALUE if ended else b""))
        except _ENCODING_ERRORS:  # a timestamp or sum the wire cannot carry
            return None

    def _resource_attributes(self, resource: Labels) -> bytes:
        """The encoded attributes of a resource: the agent's own, the pod's identity from the
        series, and service.instance.id (``<namespace>/<pod>``, else the host name)."""
        found = self._resources.get(resource)
        if found is None:
            if len(self._resources) > self._max:
                self._resources.clear()
            attrs = dict((*self.resource, *resource))
            namespace, pod = (attrs.get(k, "") for k in self._pod_keys)
            instance = (f"{namespace}/{pod}" if namespace else pod) if pod else self._host
            if instance:
                attrs.setdefault("service.instance.id", instance)
            found = self._resources[resource] = b"".join(
                key_value(k, v) for k, v in sorted(attrs.items()))
        return found

    def _resource_metrics(self, resource: Labels,
                          by_metric: dict[str, tuple[_Point, list[bytes | _Histogram]]]) -> bytes:
        attrs = self._resource_attributes(resource)
        encoded = b"".join(length_delimited(SCOPE_METRICS_METRICS, self._metric(first, points))
                           for first, points in by_metric.values())
        scope_metrics = length_delimited(SCOPE_METRICS_SCOPE, self.scope) + encoded
        return length_delimited(REQUEST_RESOURCE_METRICS,
                                length_delimited(RESOURCE_METRICS_RESOURCE, attrs)
                                + length_delimited(RESOURCE_METRICS_SCOPE_METRICS, scope_metrics))

    def _metric(self, first: _Point, points: list[bytes | _Histogram]) -> bytes:
        otel = _otel_of(first)
        data = b"".join(p for p in points if isinstance(p, bytes))  # histograms encoded by now
        instrument = otel.instrument if otel is not None else "gauge"
        if instrument == "gauge":
            body = length_delimited(METRIC_GAUGE, data)
        elif instrument == "histogram":
            body = length_delimited(METRIC_HISTOGRAM, data + HISTOGRAM_AGGREGATION_TEMPORALITY
                                    + varint(CUMULATIVE))
        else:
            monotonic = _TRUE if instrument == "counter" else _FALSE
            body = length_delimited(METRIC_SUM, data + SUM_AGGREGATION_TEMPORALITY + varint(CUMULATIVE)
                                    + SUM_IS_MONOTONIC + monotonic)
        return self._header(first) + body


class _Histogram:
    """The _bucket, _sum and _count series of one histogram in one cycle, gathered."""

    __slots__ = ("attributes", "buckets", "count", "series", "start", "sum", "ts")

    def __init__(self, attributes: bytes, ts: int) -> None:
        self.attributes = attributes
        self.ts = ts
        self.buckets: list[tuple[float, float]] = []  # (le, cumulative count)
        self.sum = 0.0
        self.count = 0.0
        self.series = 0  # how many series it gathers (what is dropped if it cannot be encoded)
        self.start = b""

    def add(self, p: _Point, value: float) -> None:
        self.series += 1
        if p.part == "_bucket" and p.bound is not None:
            self.buckets.append((p.bound, value))
        elif p.part == "_sum":
            self.sum = value
        elif p.part == "_count":
            self.count = value

    def encode(self) -> bytes:
        """A HistogramDataPoint: Prometheus' cumulative buckets become per-bucket counts; the
        +Inf bucket is the count minus the last finite bound's cumulative count. Its counts were
        checked (``Encoder._start_of_histogram``)."""
        finite = sorted(b for b in self.buckets if b[0] != float("inf"))
        counts, previous = [], 0
        for _, cumulative in finite:
            counts.append(int(cumulative) - previous)
            previous = int(cumulative)
        counts.append(int(self.count) - previous)
        return (self.attributes
                + HISTOGRAM_POINT_START_TIME_UNIX_NANO + self.start
                + HISTOGRAM_POINT_TIME_UNIX_NANO + FIXED64.pack(self.ts * 1_000_000)
                + HISTOGRAM_POINT_COUNT + FIXED64.pack(int(self.count))
                + HISTOGRAM_POINT_SUM + DOUBLE.pack(self.sum)
                + length_delimited(HISTOGRAM_POINT_BUCKET_COUNTS,
                                   b"".join(FIXED64.pack(max(0, c)) for c in counts))
                + length_delimited(HISTOGRAM_POINT_EXPLICIT_BOUNDS,
                                   b"".join(DOUBLE.pack(le) for le, _ in finite)))


def compress(payload: bytes) -> bytes:
    """gzip, which every OTLP/HTTP receiver must accept."""
    packer = zlib.compressobj(6, zlib.DEFLATED, 31)
    return packer.compress(payload) + packer.flush()


def decompress(body: bytes) -> bytes:
    return zlib.decompress(body, 31)


# -- answers -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PartialSuccess:
    rejected: int
    message: str


def partial_success(body: bytes) -> PartialSuccess | None:
    """The ``partial_success`` of an ExportMetricsServiceResponse, when the receiver said one
    (points rejected, or a warning in the message); None for a full success or an answer that
    is not such a response."""
    try:
        for number, value in fields(body):
            if number == RESPONSE_PARTIAL_SUCCESS and isinstance(value, bytes):
                rejected, message = 0, ""
                for n, v in fields(value):
                    if n == PARTIAL_SUCCESS_REJECTED_DATA_POINTS and isinstance(v, int):
                        rejected = int64(v)
                    elif n == PARTIAL_SUCCESS_ERROR_MESSAGE and isinstance(v, bytes):
                        message = v.decode("utf-8", "replace")
                if rejected or message:
                    return PartialSuccess(rejected, message)
    except ValueError:
        return None
    return None


def status_message(body: bytes) -> str:
    """What the google.rpc.Status an OTLP receiver answers a failure with says: its message, else
    its code; never the binary body as text."""
    code, message = 0, ""
    try:
        for number, value in fields(body):
            if number == STATUS_CODE and isinstance(value, int):
                code = int64(value)
            elif number == STATUS_MESSAGE and isinstance(value, bytes):
                message = value.decode("utf-8", "replace")
    except ValueError:
        return f"({len(body)} bytes of protobuf that are not a google.rpc.Status)"
    if message:
        return message
    if code:
        return f"google.rpc.Status code {code}, no message"
    return "(no message)"
