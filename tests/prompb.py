"""Remote-write 1.0 protobuf classes, built at run time from a descriptor (no protoc step).

Not used on the agent's hot path (``sidecar.wire.remote_write`` writes the wire format directly):
the tests decode the agent's output with these, and the benchmark builds its baseline with them.
Requires the ``protobuf`` package.

The field numbers are restated here from prometheus/prompb types.proto and remote.proto, on
purpose not taken from the encoder's named tags: the classes are the independent check of them.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

_F = descriptor_pb2.FieldDescriptorProto


def _build() -> dict[str, Any]:
    fd = descriptor_pb2.FileDescriptorProto(name="gpu_sidecar_prompb.proto", package="prometheus",
                                            syntax="proto3")

    def message(name: str, *fields: tuple[str, int, int, int, str | None]) -> None:
        m = fd.message_type.add(name=name)
        for fname, number, ftype, label, type_name in fields:
            f = m.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                f.type_name = type_name

    rep, opt = _F.LABEL_REPEATED, _F.LABEL_OPTIONAL
    message("Label", ("name", 1, _F.TYPE_STRING, opt, None), ("value", 2, _F.TYPE_STRING, opt, None))
    message("Sample", ("value", 1, _F.TYPE_DOUBLE, opt, None),
            ("timestamp", 2, _F.TYPE_INT64, opt, None))
    message("TimeSeries", ("labels", 1, _F.TYPE_MESSAGE, rep, ".prometheus.Label"),
            ("samples", 2, _F.TYPE_MESSAGE, rep, ".prometheus.Sample"))
    message("WriteRequest", ("timeseries", 1, _F.TYPE_MESSAGE, rep, ".prometheus.TimeSeries"))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"prometheus.{name}"))
            for name in ("Label", "Sample", "TimeSeries", "WriteRequest")}


_CLASSES = _build()
WriteRequest = _CLASSES["WriteRequest"]
TimeSeries = _CLASSES["TimeSeries"]
Label = _CLASSES["Label"]
Sample = _CLASSES["Sample"]
