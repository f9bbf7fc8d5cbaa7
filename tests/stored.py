"""Series written straight into a real store's remote-write path, with timestamps of our choice
(the past included): for the onset test, the fleet tests and bench/bench_fleet.py. Built with
the agent's own encoder (``sidecar.wire.remote_write``), so the store parses what it parses from
an agent. VictoriaMetrics takes any timestamp within its retention; Prometheus refuses samples
older than its head block, so backfills go to VictoriaMetrics."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import requests

from sidecar.wire.remote_write import compress
from tests.write_requests import GroupedEncoder

SeriesKey = tuple[str, tuple[tuple[str, str], ...]]
HEADERS = {"Content-Type": "application/x-protobuf", "Content-Encoding": "snappy",
           "X-Prometheus-Remote-Write-Version": "0.1.0"}
BUCKETS = ("0.05", "0.1", "0.25", "0.5", "1.0", "2.5", "+Inf")


def push(url: str, series: Mapping[SeriesKey, list[tuple[int, float]]],
         per_request: int = 2000) -> int:
    """Every sample of ``series`` to the remote-write ``url``, ``per_request`` series a request;
    the number of samples sent. Raises on any answer but 2xx."""
    encoder = GroupedEncoder()
    keys = list(series)
    sent = 0
    with requests.Session() as session:
        for i in range(0, len(keys), per_request):
            part = {k: series[k] for k in keys[i:i + per_request]}
            body = compress(encoder.write_request(part))
            r = session.post(url, data=body, headers=HEADERS, timeout=60)
            r.raise_for_status()
            sent += sum(len(v) for v in part.values())
    return sent


def gpu_labels(uuid: str, index: int, namespace: str, pod: str, node: str,
               name: str = "Synthetic NVIDIA H100") -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"gpu_uuid": uuid, "gpu_index": str(index), "gpu_name": name,
                         "namespace": namespace, "pod": pod, "node": node}.items()))


def latency_buckets(requests_per_cycle: float, slow_share: float
                    ) -> Mapping[str, float]:
    """One cycle's increase of a latency histogram: ``slow_share`` of the requests over 1 s."""
    fast = requests_per_cycle * (1 - slow_share)
    out, total = {}, 0.0
    for le in BUCKETS:
        if le == "0.1":
            total += fast
        if le == "2.5":
            total += requests_per_cycle - fast
        out[le] = total
    return out


def add_gpu(series: dict[SeriesKey, list[tuple[int, float]]], labels: tuple[tuple[str, str], ...],
            times_ms: Iterable[int], figures: Mapping[str, object]) -> None:
    """A GPU's series over ``times_ms``: each figure a constant, or a function of the time (ms)
    giving the value; ``latency`` gives (requests a cycle, slow share) and is accumulated into
    ``inference_request_duration_seconds_bucket``; counters (``_total``) are given as totals."""
    cumulative = dict.fromkeys(BUCKETS, 0.0)
    for ts in times_ms:
        for name, spec in figures.items():
            value = spec(ts) if callable(spec) else spec
            if name == "latency":
                for le, inc in latency_buckets(*value).items():  # type: ignore[misc]
                    cumulative[le] += inc
                    key = ("inference_request_duration_seconds_bucket",
                           tuple(sorted((*labels, ("le", le)))))
                    series.setdefault(key, []).append((ts, cumulative[le]))
                continue
            series.setdefault((name, labels), []).append((ts, float(value)))  # type: ignore[arg-type]


# a synthetic fleet: which verdict each GPU has, in turn, and the figures that make it so
FLEET_KINDS = ("none", "none", "none", "pcie", "fragmentation", "none", "kv-cache", "none",
               "low-occupancy", "throttled")


def fleet_series(n: int, start_ms: int, end_ms: int, step_ms: int, *, namespace: str = "fleet",
                 verdicts: bool = True, first: int = 0
                 ) -> tuple[dict[SeriesKey, list[tuple[int, float]]], dict[str, str]]:
    """``n`` GPUs, two a pod, as their agents would store them over [start, end): each GPU's
    verdict (``gpu_verdict``, from ``FLEET_KINDS`` in turn; left out with ``verdicts=False``, as
    an agent of an older release stores them) and the figures behind it; ``first``: the number
    of the first GPU, to build a large fleet in parts. Returns the series and each GPU's UUID ->
    verdict."""
    series: dict[SeriesKey, list[tuple[int, float]]] = {}
    expected: dict[str, str] = {}
    times = range(start_ms, end_ms, step_ms)
    for i in range(first, first + n):
        kind = FLEET_KINDS[i % len(FLEET_KINDS)]
        uuid = f"GPU-{namespace[:4].ljust(4, '0').encode().hex()}-0000-4000-8000-{i:012d}"
        pod, node = f"{namespace}-pod-{i // 2}", f"node-{i // 8}"
        labels = gpu_labels(uuid, i % 2, namespace, pod, node)
        expected[uuid] = kind
        figures: dict[str, object] = {
            "gpu_sidecar_gpu_available": 1, "gpu_utilization_ratio": 0.95,
            "gpu_sm_occupancy_ratio": 0.12 if kind == "low-occupancy" else 0.55,
            "gpu_pcie_rx_bandwidth_util_ratio": 0.93 if kind == "pcie" else 0.2,
            "gpu_pcie_tx_bandwidth_util_ratio": 0.1,
            "gpu_memory_fragmentation_ratio": 0.72 if kind == "fragmentation" else 0.1,
            "gpu_allocator_reserved_bytes": 30 * 2**30,
            "gpu_sm_clock_hertz": 1.1e9 if kind == "throttled" else 1.98e9,
            "gpu_sm_clock_max_hertz": 1.98e9,
            "latency": (20.0, 0.1 if kind == "low-occupancy" else 0.0)}
        if verdicts:
            figures["gpu_verdict"] = 1
            labels_v = tuple(sorted((*labels, ("verdict", kind))))
            add_gpu(series, labels, times, {k: v for k, v in figures.items()
                                            if k != "gpu_verdict"})
            for ts in times:
                series.setdefault(("gpu_verdict", labels_v), []).append((ts, 1.0))
        else:
            add_gpu(series, labels, times, figures)
        if kind == "kv-cache":
            engine = tuple(sorted({"namespace": namespace, "pod": pod, "node": node,
                                   "engine": "vllm", "endpoint": "127.0.0.1:8000",
                                   "model": "m"}.items()))
            for ts in times:
                series.setdefault(("engine_kv_cache_usage_ratio", engine), []).append((ts, 0.97))
    return series, expected
