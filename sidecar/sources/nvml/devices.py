"""The GPUs NVML shows: opening each (identity, capabilities, MIG instances) and finding a lost
one again.

A GPU is known by its UUID, never by its index or slot: NVML keeps UUIDs stable across a reset,
so a lost GPU is re-opened by UUID, and a lost MIG instance through its parent by UUID, whatever
slot it is in after a re-partition.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pynvml
import structlog

from sidecar.samples import GpuIdentity
from sidecar.sources.nvml.capabilities import (
    MIG_PARENT_ONLY,
    NO_NVLINK,
    Capabilities,
    detect,
    detect_mig,
    try_nvml,
)
from sidecar.sources.nvml.errors import Failures
from sidecar.sources.nvml.health import NO_C2C
from sidecar.sources.nvml.reading import Handles, ReadState, alloc_gpm_samples, gpm_request
from sidecar.sources.nvml.timed import nvml

log = structlog.get_logger("sidecar.nvml")

ARCHITECTURES = {
    pynvml.NVML_DEVICE_ARCH_KEPLER: "kepler",
    pynvml.NVML_DEVICE_ARCH_MAXWELL: "maxwell",
    pynvml.NVML_DEVICE_ARCH_PASCAL: "pascal",
    pynvml.NVML_DEVICE_ARCH_VOLTA: "volta",
    pynvml.NVML_DEVICE_ARCH_TURING: "turing",
    pynvml.NVML_DEVICE_ARCH_AMPERE: "ampere",
    pynvml.NVML_DEVICE_ARCH_ADA: "ada",
    pynvml.NVML_DEVICE_ARCH_HOPPER: "hopper",
    getattr(pynvml, "NVML_DEVICE_ARCH_BLACKWELL", 10): "blackwell",
}


@dataclass(slots=True)
class Device:
    """One opened GPU or MIG instance: what it is and can give (fixed at open), how to address
    it (changes when it is re-opened) and what its next reading needs."""

    identity: GpuIdentity
    caps: Capabilities
    handles: Handles
    state: ReadState
    failures: Failures
    mig_slot: int | None = None  # MIG: its index under the parent, tried first on re-opening
    lost_since: float | None = None
    retry_at: float = 0.0

    def free(self) -> None:
        for sample in self.state.gpm_samples:
            with contextlib.suppress(pynvml.NVMLError):
                nvml.nvmlGpmSampleFree(sample)
        self.state.gpm_samples = ()


def open_gpu(handle: Any, index: int, *, pcie_peak: float | None, interval_s: float,
             errors: Counter[str]) -> list[Device]:
    """The GPU at ``index`` and, in MIG mode, its instances; each reports once what it lacks."""
    identity = GpuIdentity(
        uuid=nvml.nvmlDeviceGetUUID(handle),
        name=nvml.nvmlDeviceGetName(handle),
        index=str(index),
        pci_bus_id=_bus_id(handle),
        architecture=ARCHITECTURES.get(
            try_nvml(lambda: nvml.nvmlDeviceGetArchitecture(handle), -1), "unknown"),
    )
    caps = detect(handle, uuid=identity.uuid, pcie_peak=pcie_peak, interval_s=interval_s)
    gpu = _device(identity, caps, Handles(device=handle), errors)
    devices = [gpu]
    mig_mode = try_nvml(lambda: nvml.nvmlDeviceGetMigMode(handle), [0, 0])
    if mig_mode[0] == 1:
        devices += _open_migs(gpu, errors)
    _report(gpu)
    return devices


def _open_migs(parent: Device, errors: Counter[str]) -> list[Device]:
    out: list[Device] = []
    parent_handle = parent.handles.device
    slots = try_nvml(lambda: nvml.nvmlDeviceGetMaxMigDeviceCount(parent_handle), 0)
    for slot in range(slots):
        try:
            handle = nvml.nvmlDeviceGetMigDeviceHandleByIndex(parent_handle, slot)
        except pynvml.NVMLError:
            continue  # empty slot
        identity = GpuIdentity(
            uuid=nvml.nvmlDeviceGetUUID(handle),
            name=nvml.nvmlDeviceGetName(handle),
            index=f"{parent.identity.index}/{slot}",
            pci_bus_id=parent.identity.pci_bus_id,
            architecture=parent.identity.architecture,
            parent_uuid=parent.identity.uuid,
        )
        handles = Handles(device=handle, parent=parent_handle,
                          gpu_instance_id=nvml.nvmlDeviceGetGpuInstanceId(handle))
        mig = _device(identity, detect_mig(handle, parent.caps), handles, errors, mig_slot=slot)
        _report(mig)
        out.append(mig)
    return out


def _device(identity: GpuIdentity, caps: Capabilities, handles: Handles, errors: Counter[str],
            *, mig_slot: int | None = None) -> Device:
    return Device(identity=identity, caps=caps, handles=handles,
                  state=ReadState(gpm_samples=alloc_gpm_samples(caps),
                                  gpm_request=gpm_request(caps)),
                  failures=Failures(identity.uuid, errors), mig_slot=mig_slot)


def reopen(dev: Device) -> Handles:
    """The handles of a lost GPU that answers again, found by its UUID; NVMLError while it
    does not (or, for a MIG instance, after a re-partition that removed it)."""
    if not dev.handles.is_mig:
        handle = nvml.nvmlDeviceGetHandleByUUID(dev.identity.uuid)
        nvml.nvmlDeviceGetUUID(handle)  # answers, not only listed
        return Handles(device=handle)
    parent = nvml.nvmlDeviceGetHandleByUUID(dev.identity.parent_uuid)
    handle = _find_mig(parent, dev)
    return Handles(device=handle, parent=parent,
                   gpu_instance_id=nvml.nvmlDeviceGetGpuInstanceId(handle))


def _find_mig(parent: Any, dev: Device) -> Any:
    """The instance's handle under its parent, by UUID: its old slot first, then every slot."""
    slots = try_nvml(lambda: nvml.nvmlDeviceGetMaxMigDeviceCount(parent), 0)
    for slot in dict.fromkeys([dev.mig_slot, *range(slots)]):
        try:
            handle = nvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, slot)
            if nvml.nvmlDeviceGetUUID(handle) == dev.identity.uuid:
                dev.mig_slot = slot
                return handle
        except pynvml.NVMLError:
            continue
    raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)  # re-partitioned: gone for now


EXPECTED_ABSENCES = frozenset({NO_C2C, NO_NVLINK, MIG_PARENT_ONLY})
"""Absences that describe the hardware (no C2C on a GPU that is not a Grace one, no NVLink on a
PCIe card, a MIG instance's GPU-wide figures): nothing to act on, so at debug, where they do not
push the live table's first frame off a terminal. `probe` lists them all the same."""


def _report(dev: Device) -> None:
    """Once per GPU at open: what it cannot give and why; the unexpected at info, the rest at
    debug (``EXPECTED_ABSENCES``)."""
    absent = dict(sorted(dev.caps.absent.items()))
    expected = {name: why for name, why in absent.items() if why in EXPECTED_ABSENCES}
    unexpected = {name: why for name, why in absent.items() if name not in expected}
    if unexpected:
        log.info("gpu_metrics_absent", gpu_uuid=dev.identity.uuid, gpu_name=dev.identity.name,
                 absent=unexpected)
    if expected:
        log.debug("gpu_metrics_absent_by_design", gpu_uuid=dev.identity.uuid,
                  gpu_name=dev.identity.name, absent=expected)


def _bus_id(handle: Any) -> str:
    raw = try_nvml(lambda: nvml.nvmlDeviceGetPciInfo(handle).busId, b"")
    return raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
