"""The links of the metric table (PCIe, and every link whose maximum and shares it declares),
as probe, the report's IO lines and the live table's link columns show them.

A link is what ``sidecar.metrics.TABLE`` declares for it: its rates
(``gpu_LINK_tx|rx_bytes_per_second``), its maximum, whose ``link=`` names it, and the shares
that divide each rate by that maximum (``ratio_of=``). Derived here, once, so that a link added
to the table reaches every view that shows links with no edit to the view.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sidecar import metrics

if TYPE_CHECKING:
    from sidecar.judge.figures import Figures

# PCIe's rates, share and maximum have columns and lines of their own in the views (beside its
# link as trained, its replays): the views show every other link from here
PCIE = "pcie"


@dataclass(frozen=True)
class Rate:
    """One direction of a link: where the sample's layers hold its rate (probe reads a reading)
    and the verdict's ``Figures`` fields of the rate and of its share of the maximum (the report
    and the table read a window); a field the table does not declare is empty."""

    direction: str  # TX, RX
    layer: str  # the sample's layer (io, health) ...
    field: str  # ... and its field
    figure: str  # the rate's Figures field
    share: str  # the share's Figures field


@dataclass(frozen=True)
class Link:
    """A link as the metric table declares it; its names from its maximum's ``link=`` (its key
    in capitals where the table names none)."""

    key: str  # the series' link: gpu_KEY_tx_bytes_per_second (pcie, c2c)
    name: str  # as probe and the report write it (``link=``'s first name)
    short: str  # the live table's columns: SHORT%, SHORT GB/s
    rates: tuple[Rate, ...]  # in the table's order
    maximum: tuple[str, str]  # (layer, field) of the maximum the shares divide by
    maximum_figure: str  # its Figures field

    @property
    def received_first(self) -> tuple[Rate, ...]:
        """RX before TX, the order of PCIe's columns and of the report's lines."""
        return tuple(sorted(self.rates, key=lambda r: r.direction != "RX"))

    @property
    def judged(self) -> bool:
        """Whether the verdict's figures carry it (each rate, share and the maximum declare
        ``figure=``): what the report and the table need to show it."""
        return bool(self.maximum_figure) and all(r.figure and r.share for r in self.rates)

    def present(self, figures: Figures) -> bool:
        """Whether a GPU's figures have the link: its maximum or a rate read."""
        return any(getattr(figures, name, None) is not None
                   for name in (self.maximum_figure, *(r.figure for r in self.rates)) if name)


def links_of(table: Iterable[metrics.MetricSpec] | None = None) -> tuple[Link, ...]:
    """The links of ``table`` (the metric table's by default), in its order. A rate's link
    maximum is the first share that divides it; a later one (PCIe's link as trained now) is
    another view of the same rate, which the views show with PCIe's own lines."""
    entries = tuple(metrics.TABLE if table is None else table)
    spec = {m.name: m for m in entries}
    found: dict[str, Link] = {}
    placed: set[str] = set()
    for share in entries:
        if share.ratio_of is None:
            continue
        rate, maximum = (spec[name] for name in share.ratio_of)
        if not (rate.field and maximum.field) or rate.name in placed:
            continue
        placed.add(rate.name)
        key, _, direction = rate.name.removeprefix("gpu_").removesuffix(
            "_bytes_per_second").rpartition("_")
        name, short = maximum.link or (key.upper(), key.upper())
        known = found.get(maximum.name)
        rates = (*(known.rates if known else ()),
                 Rate(direction.upper(), rate.layer, rate.field, rate.figure, share.figure))
        found[maximum.name] = Link(key, name, short, rates, (maximum.layer, maximum.field),
                                   maximum.figure)
    return tuple(found.values())


LINKS = links_of()


def beside_pcie() -> tuple[Link, ...]:
    """The links the report and the table show besides PCIe: every other judged link of
    ``LINKS`` (read when called, so a test may derive them from another table)."""
    return tuple(lk for lk in LINKS if lk.key != PCIE and lk.judged)
