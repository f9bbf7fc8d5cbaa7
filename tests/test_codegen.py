"""The typed records the metric table implies are written out as source (``sidecar.codegen``):
what is committed is what the table renders, so a figure added to the table and not generated
fails here, with the command that fixes it."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest

from sidecar import codegen, metrics
from sidecar.judge.figures import Figures
from sidecar.layers import LAYER_METRICS


@pytest.mark.parametrize("path", sorted(codegen.TARGETS), ids=lambda p: p.name)
def test_the_committed_module_is_what_the_table_renders(path):
    assert path.read_text() == codegen.TARGETS[path](), \
        f"{path.name} is not current: run `python -m sidecar.codegen`"


def test_every_judged_figure_of_the_table_is_a_typed_field():
    names = {f.name for f in fields(Figures)}
    assert {m.figure for m in metrics.TABLE if m.figure} <= names


def test_every_read_figure_of_the_table_is_a_field_of_its_layer():
    declared = {(m.field, m.name) for m in metrics.TABLE if m.field}
    generated = {pair for pairs in LAYER_METRICS.values() for pair in pairs}
    assert generated == declared


def test_a_table_changed_without_generating_is_found(monkeypatch):
    renamed = tuple(replace(m, figure="busy") if m.name == "gpu_utilization_ratio" else m
                    for m in metrics.TABLE)
    monkeypatch.setattr(metrics, "TABLE", renamed)
    target = codegen.ROOT / "judge" / "table_figures.py"
    assert target.read_text() != codegen.render_table_figures()
