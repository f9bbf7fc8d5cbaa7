"""The verdict table of ``docs/diagnose.md`` and the sentence that lists the kinds in precedence
order, rendered from the rules (``sidecar.judge.rules.RULES``: a row per kind, its ``doc_when``
and ``doc_todo``) between two marker comments, so that a new kind, a new order or a changed
threshold reaches the page as it reaches the alert rules. Written by
``python -m sidecar.alert_rules .``, which gives the thresholds' values (``doc_when`` takes the
same ``%(name)s`` as the alert rules); ``tests/test_docs.py`` fails when the committed section
differs.

A renderer beside the others: it reads the rules and is given the values, and imports nothing
above them.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping
from pathlib import Path

from sidecar.judge.rules import RULES

DOC = Path("docs/diagnose.md")
BEGIN = "<!-- generated: python -m sidecar.alert_rules . -->\n"
END = "<!-- end generated -->\n"
_HEAD = "| verdict | layer | when (window) | what to do |\n|---|---|---|---|\n"
_NONE = "| `none` | | nothing crossed a threshold | |\n"
_ORDER = "A GPU's findings are listed, and the table shows the first, in this order: "
# why the kinds stand in that order, and what is never a finding: the words after the list,
# the first of them wrapped with it
_ORDER_WHY_FIRST = "(fix the hardware before tuning"
_ORDER_WHY = """\
the workload; the host links before NVLink between the GPUs, which they feed;
`queueing` is found only where nothing else explains the latency). An idle link
trained down, clocks down on an idle GPU, sync boost alone, a pending row remap, and faults
counted before the window are notes, never findings.
"""


def section(values: Mapping[str, object]) -> str:
    """The generated text: the table (the kinds in precedence order, then ``none``) and the
    paragraph that lists them in that order; ``values``: the thresholds, as
    ``sidecar.alert_rules`` gives them to the alert rules."""
    rows = "".join(f"| `{r.kind}` | {r.layer} | {r.doc_when % values} | {r.doc_todo} |\n"
                   for r in RULES)
    kinds = ", ".join(f"`{r.kind}`" for r in RULES)
    order = textwrap.fill(f"{_ORDER}{kinds} {_ORDER_WHY_FIRST}", 100,
                          break_on_hyphens=False, break_long_words=False)
    return _HEAD + rows + _NONE + "\n" + order + "\n" + _ORDER_WHY


def updated(text: str, values: Mapping[str, object]) -> str:
    """``text`` (the page) with what lies between the markers rendered afresh."""
    start = text.index(BEGIN) + len(BEGIN)
    end = text.index(END, start)
    return text[:start] + "\n" + section(values) + "\n" + text[end:]
