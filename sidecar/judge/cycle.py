"""The agent's cycle into figures: each GPU's ``Figures`` taken from the samples the agent read,
with no round trip through the series it exports.

The values are those the series carry by construction (``samples.sample_values`` and
``samples.app_values`` make both), so the running agent judges exactly what it exports;
``tests/test_judge_cycle.py`` holds the two equal for every scenario. The serving engine's
figures are the pod's, as its source gives them (series without a GPU), combined as the store
path combines them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from sidecar.judge.figures import Figures
from sidecar.judge.series import engine_figures, figures_with_engine, shared_bounds
from sidecar.judge.table_figures import FIELD_OF
from sidecar.samples import GpuIdentity, GpuSample, Series, app_values, sample_values

_INF = float("inf")


def figures_of_cycle(
    samples: Iterable[GpuSample], available: Mapping[str, bool], *,
    identity: Mapping[str, GpuIdentity], lost_xids: Mapping[str, tuple[tuple[int, int], ...]],
    engine: Iterable[Series] = (),
) -> dict[str, Figures]:
    """Each selected GPU of one cycle, by UUID: the read ones (``samples``) in their order, then
    those that could not be read (``available`` False), with their Xid counts as the watcher
    still has them (``lost_xids``: 79, fallen off the bus)."""
    rows: dict[str, dict[str, object]] = {}
    for sample in samples:
        rows[sample.identity.uuid] = _row(sample)
    for uuid, ok in available.items():
        if ok or uuid in rows:
            continue
        who = identity[uuid]
        row: dict[str, object] = {"uuid": uuid, "name": who.name, "index": who.index,
                                  "available": False}
        if xids := lost_xids.get(uuid):
            row["xids"] = tuple(sorted((code, float(n)) for code, n in xids))
        rows[uuid] = row
    return figures_with_engine(rows, engine_figures(engine))


def _row(sample: GpuSample) -> dict[str, object]:
    who = sample.identity
    row: dict[str, object] = {"uuid": who.uuid, "name": who.name, "index": who.index}
    for name, value in sample_values(sample).items():
        if (figure := FIELD_OF.get(name)) is not None:
            row[figure] = float(value)
    app = sample.app
    for name, given in app_values(app):
        if given is not None and (figure := FIELD_OF.get(name)) is not None:
            row[figure] = float(given)
    if app.latency is not None:
        hist = app.latency
        row["latency"] = (shared_bounds((*map(float, hist.bounds), _INF)),
                          tuple(float(c) for c in hist.counts))
    if sample.xids:
        row["xids"] = tuple(sorted((code, float(n)) for code, n in sample.xids))
    return row
