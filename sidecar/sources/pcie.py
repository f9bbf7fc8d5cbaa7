"""PCIe link arithmetic and cumulative-counter rates.

Plain functions: nothing here needs state beyond its arguments, and keeping them apart from NVML
lets the tests check them against numbers worked out by hand.
"""

from __future__ import annotations

# Per-lane, per-direction payload bandwidth in bytes/s after line encoding. The seed hard-coded
# one generation; the device tells us its own, so every generation NVML can report is here.
#   gen 1/2: 2.5/5 GT/s with 8b/10b; gen 3/4/5: 8/16/32 GT/s with 128b/130b;
#   gen 6: 64 GT/s PAM4 with FLIT framing (242 payload bytes of 256).
LANE_BYTES_PER_SECOND: dict[int, float] = {
    1: 2.5e9 * 8 / 10 / 8,
    2: 5.0e9 * 8 / 10 / 8,
    3: 8.0e9 * 128 / 130 / 8,
    4: 16.0e9 * 128 / 130 / 8,
    5: 32.0e9 * 128 / 130 / 8,
    6: 64.0e9 * 242 / 256 / 8,
}


def link_max_bytes_per_second(generation: int, width: int) -> float | None:
    """Per-direction maximum of a link, or None for a generation we do not know."""
    lane = LANE_BYTES_PER_SECOND.get(generation)
    if lane is None or width <= 0:
        return None
    return lane * width


def counter_delta(previous: int, current: int, bits: int) -> int:
    """Increase of a free-running counter of ``bits`` width, across at most one wrap."""
    return (current - previous) % (1 << bits)


def counter_rate(
    previous: int, current: int, seconds: float, bits: int, ceiling: float | None = None
) -> float | None:
    """Rate of a cumulative counter between two readings.

    None when the interval is not positive or the rate exceeds ``ceiling``: a counter that went
    backwards by a reset (driver reload, GPU reset) would otherwise read as one huge wrap.
    """
    if seconds <= 0:
        return None
    rate = counter_delta(previous, current, bits) / seconds
    if ceiling is not None and rate > ceiling:
        return None
    return rate
