"""Prepared NVML calls for the per-cycle hot path.

pynvml's wrappers allocate a fresh out-structure on every call and its structures route every
field access through Python-level ``__getattribute__``/``__setattr__`` hooks; at a handful of
calls per GPU per cycle that is most of the agent's CPU time. Here each GPU gets its
out-parameters once, and the C functions are taken from pynvml's own function table
(``_nvmlGetFunctionPointer``, which reads ``pynvml.nvmlLib``), so the library boundary is the
same one pynvml uses. The structures below mirror pynvml's field for field; a test checks their
sizes and offsets against pynvml's definitions.

Capability detection and every cold path keep using pynvml's public wrappers.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence
from typing import Any

import pynvml


class MemoryV2(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint), ("total", ctypes.c_ulonglong),
                ("reserved", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong),
                ("used", ctypes.c_ulonglong)]


class MemoryV1(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong),
                ("used", ctypes.c_ulonglong)]


class Utilization(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


class Value(ctypes.Union):
    _fields_ = [("dVal", ctypes.c_double), ("uiVal", ctypes.c_uint), ("ulVal", ctypes.c_ulong),
                ("ullVal", ctypes.c_ulonglong), ("sllVal", ctypes.c_longlong),
                ("siVal", ctypes.c_int), ("usVal", ctypes.c_ushort)]


class FieldValue(ctypes.Structure):
    _fields_ = [("fieldId", ctypes.c_uint32), ("scopeId", ctypes.c_uint32),
                ("timestamp", ctypes.c_int64), ("latencyUsec", ctypes.c_int64),
                ("valueType", ctypes.c_uint), ("nvmlReturn", ctypes.c_uint), ("value", Value)]


class MetricInfo(ctypes.Structure):
    _fields_ = [("shortName", ctypes.c_char_p), ("longName", ctypes.c_char_p),
                ("unit", ctypes.c_char_p)]


class GpmMetric(ctypes.Structure):
    _fields_ = [("metricId", ctypes.c_uint), ("nvmlReturn", ctypes.c_uint),
                ("value", ctypes.c_double), ("metricInfo", MetricInfo)]


class GpmMetricsGet(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint), ("numMetrics", ctypes.c_uint),
                ("sample1", ctypes.c_void_p), ("sample2", ctypes.c_void_p),
                ("metrics", GpmMetric * pynvml.NVML_GPM_METRIC_MAX)]


# Raw views of the filled arrays, one precompiled struct per GPU: a single ``unpack_from`` instead
# of a ctypes wrapper object per element and field.
# FieldValue: fieldId, scopeId, timestamp, latencyUsec (24 bytes, skipped), then valueType,
# nvmlReturn and the 8-byte value read as an unsigned 64-bit integer (uiVal is its low half).
FIELD_VALUE_READ = "24xIIQ"
# GpmMetric: metricId (ours, skipped), nvmlReturn, value, then the metricInfo pointers (skipped).
GPM_METRIC_READ = f"4xId{ctypes.sizeof(MetricInfo)}x"
GPM_METRICS_OFFSET = GpmMetricsGet.metrics.offset


_fn = pynvml._nvmlGetFunctionPointer


class PreparedCalls:
    """One GPU's hot-path calls: C function pointers resolved and out-parameters allocated once.

    The calls return NVML's status code rather than raising, and the results are read straight
    from the out-structures (``mem``, ``util``) or through ``field_values()``/``gpm_values()``,
    which return flat tuples: (valueType, nvmlReturn, raw value) per field and (nvmlReturn,
    value) per GPM metric, in the order the fields and metrics were given."""

    def __init__(
        self,
        handle: Any,
        *,
        memory: str | None,
        utilization: bool,
        replay_call: bool = False,
        fields: Sequence[int | tuple[int, int]],
        gpm_metrics: Sequence[int],
        gpm_samples: Sequence[Any] = (),
        gpm_mig: bool = False,
    ) -> None:
        self.handle = handle
        self.mem_v2 = memory == "v2"
        self.mem: MemoryV2 | MemoryV1 | None = None
        self.mem_fn = None
        if memory == "v2":
            self.mem = MemoryV2(version=pynvml.nvmlMemory_v2)
            self.mem_fn = _fn("nvmlDeviceGetMemoryInfo_v2")
        elif memory == "v1":
            self.mem = MemoryV1()
            self.mem_fn = _fn("nvmlDeviceGetMemoryInfo")
        self.mem_ref = ctypes.byref(self.mem) if self.mem is not None else None
        self.util = Utilization()
        self.util_ref = ctypes.byref(self.util)
        self.util_fn = _fn("nvmlDeviceGetUtilizationRates") if utilization else None
        self.replay = ctypes.c_uint()
        self.replay_ref = ctypes.byref(self.replay)
        self.replay_fn = _fn("nvmlDeviceGetPcieReplayCounter") if replay_call else None

        self.fields = (FieldValue * len(fields))()
        for slot, field in zip(self.fields, fields, strict=True):
            slot.fieldId, slot.scopeId = field if isinstance(field, tuple) else (field, 0)
        self.fields_ref = ctypes.byref(self.fields)
        self.nfields = ctypes.c_int32(len(fields))
        self.fields_fn = _fn("nvmlDeviceGetFieldValues") if fields else None
        self._fields_read = struct.Struct("<" + FIELD_VALUE_READ * len(fields)).unpack_from
        self._fields_view = memoryview(self.fields).cast("B")

        # two requests, one per order of the two samples the agent alternates between, so a
        # cycle picks one instead of writing sample pointers into a ctypes structure: request 0
        # averages from sample 0 to sample 1, request 1 from sample 1 to sample 0
        self.gpm = [GpmMetricsGet(version=pynvml.NVML_GPM_METRICS_GET_VERSION,
                                  numMetrics=len(gpm_metrics)) for _ in range(2)]
        addresses = [address_of(sample) for sample in gpm_samples]
        for request, order in zip(self.gpm, (addresses, addresses[::-1]), strict=True):
            for i, metric in enumerate(gpm_metrics):
                request.metrics[i].metricId = metric
            if order:
                request.sample1, request.sample2 = order
        self.gpm_refs = [ctypes.byref(request) for request in self.gpm]
        self.gpm_sample_fn = self.gpm_metrics_fn = None
        if gpm_metrics:
            self.gpm_sample_fn = _fn("nvmlGpmMigSampleGet" if gpm_mig else "nvmlGpmSampleGet")
            self.gpm_metrics_fn = _fn("nvmlGpmMetricsGet")
        self._gpm_read = struct.Struct("<" + GPM_METRIC_READ * len(gpm_metrics)).unpack_from
        self._gpm_views = [memoryview(request).cast("B")[GPM_METRICS_OFFSET:]
                           for request in self.gpm]

    def field_values(self) -> tuple[int, ...]:
        """(valueType, nvmlReturn, raw) per field, flat, as the last call left them."""
        return self._fields_read(self._fields_view)

    def gpm_values(self, request: int) -> tuple[int | float, ...]:
        """(nvmlReturn, value) per metric, flat, as the last call on ``request`` left them."""
        return self._gpm_read(self._gpm_views[request])


def address_of(pointer: Any) -> int:
    return ctypes.cast(pointer, ctypes.c_void_p).value or 0
