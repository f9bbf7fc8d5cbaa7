"""One verdict kind, whole: ``Rule`` (its condition, evidence, remedy, threshold in words, alert
rules and their promtool cases, docs row and deciding figure in long-term storage) and
``Deciding``; and the helpers the rules' texts and queries share.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sidecar.judge.window import Window
from sidecar.thresholds import Thresholds


def stored(name: str, *extra: str, pod: bool = False, before: bool = False) -> str:
    """A series in a ``Deciding`` query, as a placeholder the fleet fills in with the --select
    matchers and the window's range (``sidecar.commands.fleet``); ``extra`` ``CRITICAL``
    narrows it to the critical Xids of the thresholds, ``pod`` keeps only the pod's labels (the
    engine's series have no GPU); ``before``: the 5 minutes before the window instead (a
    look-back: whether the series existed when the window began)."""
    scope = "pod" if pod else ("before" if before else "gpu")
    return f"@@SEL:{name}:{'|'.join(extra)}:{scope}@@"


def either(a: str, b: str) -> str:
    """The larger of two per-GPU window means (RX and TX), in one query: the two are told
    apart by a label of their own so the ``or`` keeps both."""
    return (f'max by (gpu_uuid) (label_replace(avg_over_time({stored(a)}), "d", "1", "", "") or '
            f'label_replace(avg_over_time({stored(b)}), "d", "2", "", ""))')


def at(values: Sequence[float | None], i: int = 0) -> float | None:
    return values[i] if len(values) > i else None


def count(v: float | None) -> str:
    return "absent" if v is None else f"{v:.0f}"


def whole(v: float | None) -> str:
    return "?" if v is None else f"{v:.0f}"


@dataclass(frozen=True)
class Deciding:
    """A kind's deciding figure in long-term storage: what ``gpu-sidecar fleet`` prints beside a
    GPU with that verdict. PromQL aggregates over the window (their series written with
    ``stored``), the labels their answers are keyed by, and how the values read."""

    queries: tuple[str, ...]
    by: tuple[str, ...]  # ("gpu_uuid",), or ("namespace", "pod") for the engine's
    text: Callable[[Sequence[float | None], Thresholds], str]


@dataclass(frozen=True)
class Rule:
    """One verdict kind, whole: where it stands (``RULES`` is in precedence order), its layer,
    table cell and title, when it holds on a window (``found``, against a threshold of
    ``sidecar.thresholds``), the figures behind it (``evidence``), what to do (``remedy``), its
    threshold in words (the head of diagnose's report), its alert rules (PromQL with the
    thresholds as ``%(name)s``, rendered by ``sidecar.alert_rules``) with their promtool cases
    (``alert_tests``: every alert of ``alerts`` is named by one of them), its row in
    docs/diagnose.md's verdict table (``doc_when``, ``doc_todo``; rendered by the same command,
    the thresholds in ``doc_when`` as in ``alerts``), and its deciding figure in long-term
    storage (``deciding``: what ``gpu-sidecar fleet`` prints beside the GPU).
    ``alone``: judged only where no rule before it found anything (queueing: any other finding
    explains why requests wait).

    ``evidence`` returns the text, or (cell, text, remedy) where the finding's cell and remedy
    follow the figures (throttled: by the reasons that held the clocks)."""

    kind: str
    layer: str  # GPU, health, IO, engine, memory, compute
    cell: str  # the live table's verdict column
    title: str
    remedy: str
    found: Callable[[Window, Thresholds], bool]
    evidence: Callable[[Window, Thresholds], str | tuple[str, str, str]]
    threshold: Callable[[Thresholds], str] | None = None  # None: no threshold (a lost GPU)
    alerts: str = ""  # alert rules in the group of its layer ("" : none of its own)
    alert_tests: str = ""  # promtool cases of ``alerts`` (YAML, literal): gpu-sidecar.tests.yml
    doc_when: str = ""  # docs/diagnose.md's "when (window)" cell, thresholds as %(name)s
    doc_todo: str = ""  # docs/diagnose.md's "what to do" cell (literal)
    deciding: Deciding | None = None  # fleet's figure (None: the GPU is listed without one)
    alone: bool = False
