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


# Raw views of the filled arrays: one struct.iter_unpack instead of a ctypes wrapper object per
# element and field. FieldValue: fieldId, scopeId, timestamp, latencyUsec, valueType, nvmlReturn,
# value (8 bytes, read as an unsigned 64-bit integer: uiVal is its low half, little-endian).
FIELD_VALUE = struct.Struct("<IIqqIIQ")
# GpmMetric: metricId, nvmlReturn, value, then the metricInfo pointers (skipped).
GPM_METRIC = struct.Struct(f"<IId{ctypes.sizeof(MetricInfo)}x")
GPM_METRICS_OFFSET = GpmMetricsGet.metrics.offset


def check(ret: int) -> None:
    if ret != pynvml.NVML_SUCCESS:
        raise pynvml.NVMLError(ret)


_fn = pynvml._nvmlGetFunctionPointer


class PreparedCalls:
    """One GPU's hot-path calls, with out-parameters allocated once."""

    def __init__(
        self,
        handle: Any,
        *,
        memory: str | None,
        fields: Sequence[int | tuple[int, int]],
        gpm_metrics: Sequence[int],
    ) -> None:
        self.handle = handle
        self.memory_version = memory
        if memory == "v2":
            self._mem: MemoryV2 | MemoryV1 = MemoryV2(version=pynvml.nvmlMemory_v2)
            self._mem_fn = _fn("nvmlDeviceGetMemoryInfo_v2")
        elif memory == "v1":
            self._mem = MemoryV1()
            self._mem_fn = _fn("nvmlDeviceGetMemoryInfo")
        self._mem_ref = ctypes.byref(self._mem) if memory else None
        self._util = Utilization()
        self._util_ref = ctypes.byref(self._util)
        self.fields = (FieldValue * len(fields))()
        for slot, field in zip(self.fields, fields, strict=True):
            slot.fieldId, slot.scopeId = field if isinstance(field, tuple) else (field, 0)
        self._fields_ref = ctypes.byref(self.fields)
        self._fields_view = memoryview(self.fields).cast("B")
        self._nfields = ctypes.c_int32(len(fields))
        self.gpm = GpmMetricsGet(version=pynvml.NVML_GPM_METRICS_GET_VERSION,
                                 numMetrics=len(gpm_metrics))
        for i, metric in enumerate(gpm_metrics):
            self.gpm.metrics[i].metricId = metric
        self._gpm_ref = ctypes.byref(self.gpm)
        end = GPM_METRICS_OFFSET + GPM_METRIC.size * len(gpm_metrics)
        self._gpm_view = memoryview(self.gpm).cast("B")[GPM_METRICS_OFFSET:end]

    def memory(self) -> MemoryV2 | MemoryV1:
        check(self._mem_fn(self.handle, self._mem_ref))
        return self._mem

    def utilization(self) -> Utilization:
        check(_fn("nvmlDeviceGetUtilizationRates")(self.handle, self._util_ref))
        return self._util

    def field_values(self) -> list[tuple[int, int, int, int, int, int, int]]:
        check(_fn("nvmlDeviceGetFieldValues")(self.handle, self._nfields, self._fields_ref))
        return list(FIELD_VALUE.iter_unpack(self._fields_view))

    def gpm_sample(self, sample: Any, parent: Any = None, gpu_instance_id: int | None = None) -> bool:
        if parent is None:
            check(_fn("nvmlGpmSampleGet")(self.handle, sample))
        else:
            check(_fn("nvmlGpmMigSampleGet")(parent, gpu_instance_id, sample))
        return True

    def gpm_metrics(self, first: int, second: int) -> list[tuple[int, int, float]]:
        """(metricId, nvmlReturn, value) averaged between two samples given by address."""
        self.gpm.sample1 = first
        self.gpm.sample2 = second
        check(_fn("nvmlGpmMetricsGet")(self._gpm_ref))
        return list(GPM_METRIC.iter_unpack(self._gpm_view))


def address_of(pointer: Any) -> int:
    return ctypes.cast(pointer, ctypes.c_void_p).value or 0
