"""Link maxima and counter arithmetic, against numbers worked out by hand."""

import pytest

from sidecar.sources.pcie import counter_delta, counter_rate, link_max_bytes_per_second


@pytest.mark.parametrize(
    ("gen", "width", "expected"),
    [
        (1, 1, 250_000_000),                 # 2.5 GT/s * 8/10 / 8 bits
        (2, 8, 4_000_000_000),               # 5 GT/s * 8/10 / 8 * 8 lanes
        (3, 16, 15_753_846_153.846),         # 8 GT/s * 128/130 / 8 * 16
        (4, 16, 31_507_692_307.692),         # A100: ~31.5 GB/s per direction
        (5, 16, 63_015_384_615.385),         # H100/H200: ~63 GB/s per direction
        (6, 16, 121_000_000_000),            # 64 GT/s * 242/256 / 8 * 16
    ],
)
def test_link_maximum_is_generation_rate_times_width(gen, width, expected):
    assert link_max_bytes_per_second(gen, width) == pytest.approx(expected, rel=1e-12)


def test_unknown_generation_or_width_gives_no_maximum():
    assert link_max_bytes_per_second(7, 16) is None
    assert link_max_bytes_per_second(0, 16) is None
    assert link_max_bytes_per_second(5, 0) is None


def test_counter_delta_across_one_wrap():
    assert counter_delta(2**64 - 100, 50, 64) == 150
    assert counter_delta(2**32 - 10, 5, 32) == 15
    assert counter_delta(1000, 1500, 32) == 500


def test_counter_rate_divides_by_interval_and_refuses_implausible_jumps():
    assert counter_rate(0, 10_000, 2.0, 64) == 5000.0
    assert counter_rate(2**64 - 1000, 3000, 4.0, 64) == 1000.0
    # a counter that went backwards by a reset reads as a near-2**64 wrap: refused by the ceiling
    assert counter_rate(5_000_000, 10, 1.0, 64, ceiling=1e12) is None
    assert counter_rate(0, 10, 0.0, 64) is None
