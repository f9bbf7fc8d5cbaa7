"""The seed's sketch translated to pynvml and prometheus_client, as written there: the baseline
the benchmarks compare the agent with. Only pynvml and prometheus_client are imported, so a
process that runs just this loop weighs what the seed's exporter would."""

from __future__ import annotations

from collections.abc import Callable

import pynvml
from prometheus_client import CollectorRegistry, Gauge


class NullSink:
    """A sink that drops everything: for timing the agent's own cycle."""

    name = "null"

    def start(self) -> None:
        pass

    def emit(self, series: object) -> None:
        pass

    def close(self, deadline: float) -> bool:
        return True

    def telemetry(self, ts: int, labels: object) -> list:
        return []


def naive_loop(registry: CollectorRegistry | None = None) -> Callable[[], None]:
    """A function that reads every GPU through pynvml, serially, and sets 6 gauges per GPU."""
    registry = registry if registry is not None else CollectorRegistry()
    labels = ["gpu", "uuid", "name"]
    g_used = Gauge("gpu_memory_used_bytes", "", labels, registry=registry)
    g_total = Gauge("gpu_memory_total_bytes", "", labels, registry=registry)
    g_util = Gauge("gpu_utilization_ratio", "", labels, registry=registry)
    g_tx = Gauge("gpu_pcie_tx_bytes_per_second", "", labels, registry=registry)
    g_rx = Gauge("gpu_pcie_rx_bytes_per_second", "", labels, registry=registry)
    g_ratio = Gauge("gpu_pcie_rx_bandwidth_util_ratio", "", labels, registry=registry)

    def cycle() -> None:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            util = pynvml.nvmlDeviceGetUtilizationRates(h)
            tx = pynvml.nvmlDeviceGetPcieThroughput(h, pynvml.NVML_PCIE_UTIL_TX_BYTES)
            rx = pynvml.nvmlDeviceGetPcieThroughput(h, pynvml.NVML_PCIE_UTIL_RX_BYTES)
            gen = pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h)
            width = pynvml.nvmlDeviceGetCurrPcieLinkWidth(h)
            lv = (str(i), uuid, name)
            g_used.labels(*lv).set(mem.used)
            g_total.labels(*lv).set(mem.total)
            g_util.labels(*lv).set(util.gpu / 100)
            g_tx.labels(*lv).set(tx * 1024)
            g_rx.labels(*lv).set(rx * 1024)
            g_ratio.labels(*lv).set(rx * 1024 / (gen * 2e9 * width))

    return cycle
