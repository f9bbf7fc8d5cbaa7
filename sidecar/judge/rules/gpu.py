"""The GPU layer's kind: a GPU that stopped answering NVML."""

from __future__ import annotations

from sidecar.judge.rule import Deciding, Rule, at, stored

LOST = (
    Rule("gpu-lost", "GPU", "LOST", "the GPU stopped answering NVML",
         "check `nvidia-smi` and the kernel log (`dmesg | grep -i xid`: Xid 79 is a GPU fallen "
         "off the bus, 48/63/64/94/95 memory errors); the agent re-opens it every "
         "--gpu-retry-interval s; if it stays lost, drain the node and reset or replace the GPU, "
         "and move the pod's work to its other GPUs",
         found=lambda w, t: w.lost,
         evidence=lambda w, t: f"unreadable in {w.unreadable} of {w.samples + w.unreadable} "
                               "samples, including the last (alert GPUSidecarGPUUnavailable)",
         doc_when="the GPU cannot be read at the end of the window",
         doc_todo="`nvidia-smi`, `dmesg` (Xid 79), drain and reset",
         deciding=Deciding(
             (f"min by (gpu_uuid) (min_over_time({stored('gpu_sidecar_gpu_available')}))",),
             ("gpu_uuid",),
             lambda v, t: "unreadable in the window" if at(v) == 0 else
                          "readable again by the window's end"))
)
