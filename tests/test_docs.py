"""docs/metrics.md is generated from the table the code uses, and must be current."""

from sidecar.metrics import METRICS, render_markdown
from tests.conftest import ROOT


def test_metrics_reference_is_up_to_date():
    committed = (ROOT / "docs" / "metrics.md").read_text()
    assert committed == render_markdown(), (
        "docs/metrics.md is stale: run `python -m sidecar.metrics > docs/metrics.md`"
    )


def test_metric_names_follow_prometheus_conventions():
    for m in METRICS:
        if m.unit == "ratio":
            assert m.name.endswith("_ratio"), m.name
        if m.kind == "counter":
            assert m.name.endswith("_total"), m.name
        if m.unit == "bytes":
            assert m.name.endswith("_bytes"), m.name
        if m.unit == "bytes/s":
            assert m.name.endswith("_bytes_per_second"), m.name
