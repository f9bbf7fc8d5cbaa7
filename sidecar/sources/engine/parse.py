"""From an engine's exposition text to our engine figures: pure functions, no I/O.

The text is first cut down to the lines of the families ``families.py`` reads (a line's metric
name decides, before any parsing), so an engine exposing thousands of series of other families
costs a scan of their lines and nothing more; what is left is parsed by ``prometheus_client``'s
text parser, whose errors refuse the whole read (a text that is partly garbage is not trusted in
part). The families are then mapped per model: the labels an engine adds beyond the model (vLLM's
engine-core index, SGLang's ranks, Triton's model version, a finish reason) are summed over, the
KV-cache usage taking the fullest core instead.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from sidecar.samples import LatencyHistogram
from sidecar.sources.engine.families import ENGINES, Engine, Family, source_names

MAX_MODELS = 16  # models per endpoint: beyond, the rest are left out and said
MAX_BUCKETS = 64  # buckets per histogram: a family with more is left out and said
MAX_MODEL_CHARS = 128  # a longer model name is cut to this (a label on every engine series)
_MAX_PREFIXES = 32  # metric-name prefixes kept to say what another program's text holds
_KNOWN = source_names()
_PARTS = ("_bucket", "_sum", "_count", "_total", "_created")
_TAKE_MAX = frozenset({"engine_kv_cache_usage_ratio"})
# a sample line's metric name (text format 0.0.4, which the agent asks for: no quoted names)
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
# the label that names the model, in any engine's text (vLLM and SGLang: model_name; Triton:
# model): lines of models beyond MAX_MODELS are dropped before parsing, so a text of hundreds of
# models costs a scan, not a parse
_MODEL = re.compile(r'[{,]\s*(?:model_name|model)="((?:[^"\\]|\\.)*)"')


class Malformed(ValueError):
    """The text is not the Prometheus text format."""


@dataclass(frozen=True, slots=True)
class EngineFigures:
    """What one read of one endpoint said, by model ("" when the engine names none)."""

    engine: str
    # figure -> model -> a histogram or a number
    figures: Mapping[str, Mapping[str, LatencyHistogram | float]] = field(default_factory=dict)
    # what was left out and why, for the log: "too_many_models", "too_many_buckets:<family>"
    left_out: tuple[str, ...] = ()

    @property
    def models(self) -> list[str]:
        return sorted({m for by_model in self.figures.values() for m in by_model})


def _family_of(name: str) -> str | None:
    if name in _KNOWN:
        return name
    for part in _PARTS:
        if name.endswith(part) and name[: -len(part)] in _KNOWN:
            return name[: -len(part)]
    return None


def relevant(text: str) -> tuple[str, set[str], bool]:
    """The lines of the families we read, every metric-name prefix seen (to recognise an
    engine that exposes none of them, or tell a text of another program), and whether lines of
    models beyond ``MAX_MODELS`` were left out. A line that is no
    sample of the text format (HTML, JSON, bytes) makes the whole text ``Malformed``."""
    kept: list[str] = []
    prefixes: set[str] = set()
    models: set[str] = set()
    too_many = False
    for number, line in enumerate(text.split("\n"), 1):  # \n only: a label may hold U+2028
        line = line.removesuffix("\r")
        if line.startswith("#"):
            words = line.split(None, 3)
            if len(words) >= 3 and words[1] in ("HELP", "TYPE") and _family_of(words[2]):
                kept.append(line)
            continue
        if not line.strip() or line.lstrip().startswith("#"):  # blank, or an indented comment
            continue
        name = (line.split("{", 1)[0].split(None, 1) or [""])[0]
        if not _NAME.fullmatch(name):  # every line is checked, not only the kept ones
            raise Malformed(f"line {number} is not a sample of the text format")
        if len(prefixes) < _MAX_PREFIXES:
            prefixes.add(_prefix(name)[:40])
        if _family_of(name):
            model = _MODEL.search(line)
            if model is not None and model.group(1) not in models:
                if len(models) >= MAX_MODELS:
                    too_many = True
                    continue
                models.add(model.group(1))
            kept.append(line)
    return "\n".join(kept) + "\n", prefixes, too_many


def _prefix(name: str) -> str:
    for engine in ENGINES:
        if name.startswith(engine.prefix):
            return engine.prefix
    return name.split(":", 1)[0] + ":" if ":" in name else name.split("_", 1)[0] + "_"


Samples = dict[str, list[tuple[dict[str, str], float]]]


def samples_of(text: str) -> Samples:
    """Sample name -> (labels, value) of every sample of the text, parsed by prometheus_client."""
    out: Samples = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        raise Malformed(str(exc)[:200] or type(exc).__name__) from None
    return out


def recognise(samples: Samples) -> Engine | None:
    """The engine with the most of our figures in the text."""
    best, best_n = None, 0
    for engine in ENGINES:
        n = sum(1 for fams in engine.figures.values() if any(_present(f, samples) for f in fams))
        if n > best_n:
            best, best_n = engine, n
    return best


def _present(fam: Family, samples: Samples) -> bool:
    if fam.kind == "histogram":
        return f"{fam.name}_bucket" in samples or f"{fam.name}_count" in samples
    return fam.name in samples or f"{fam.name}_total" in samples


def figures_of(text: str) -> tuple[EngineFigures | None, set[str]]:
    """The engine's figures in ``text`` (None: no engine we know), and the name prefixes seen."""
    kept, prefixes, too_many = relevant(text)
    samples = samples_of(kept)
    engine = recognise(samples)
    if engine is None:
        return None, prefixes
    figures = map_engine(engine, samples)
    if too_many and "too_many_models" not in figures.left_out:
        figures = EngineFigures(engine=figures.engine, figures=figures.figures,
                                left_out=(*figures.left_out, "too_many_models"))
    return figures, prefixes


def map_engine(engine: Engine, samples: Samples) -> EngineFigures:
    figures: dict[str, dict[str, LatencyHistogram | float]] = {}
    left_out: list[str] = []
    models: set[str] = set()
    for ours, fams in engine.figures.items():
        fam = next((f for f in fams if _present(f, samples)), None)
        if fam is None:
            continue
        if fam.kind == "histogram":
            by_model = _histograms(fam, samples, engine.model_label)
            if any(len(h.bounds) > MAX_BUCKETS for h in by_model.values()):
                left_out.append(f"too_many_buckets:{fam.name}")
                continue
        elif fam.kind == "microsecond_counter":
            by_model = _sums_and_counts(fam, samples, engine)
        else:
            by_model = _numbers(fam, samples, engine, take_max=ours in _TAKE_MAX)
        models.update(by_model)
        figures[ours] = by_model  # type: ignore[assignment]
    if len(models) > MAX_MODELS:
        keep = set(sorted(models)[:MAX_MODELS])
        figures = {k: {m: v for m, v in by.items() if m in keep} for k, by in figures.items()}
        left_out.append("too_many_models")
    return EngineFigures(engine=engine.name, figures=figures, left_out=tuple(left_out))


def _model(labels: Mapping[str, str], model_label: str | None) -> str:
    return labels.get(model_label, "")[:MAX_MODEL_CHARS] if model_label else ""


def _numbers(fam: Family, samples: Samples, engine: Engine, *,
             take_max: bool) -> dict[str, float]:
    """A gauge or counter per model: the largest within a replica, summed over replicas (or
    the largest of all where ``take_max``)."""
    rows = samples.get(f"{fam.name}_total") or samples.get(fam.name) or []
    per_replica: dict[tuple[str, tuple[str, ...]], float] = {}
    for labels, value in rows:
        if not math.isfinite(value):
            continue
        m = _model(labels, engine.model_label)
        if fam.kind == "counter" and value < 0:
            continue  # a counter never is
        if engine.replicas is None:
            replica = tuple(sorted(f"{k}={v}" for k, v in labels.items()))
        else:
            replica = tuple(labels.get(k, "") for k in engine.replicas)
        key = (m, replica)
        per_replica[key] = max(per_replica.get(key, value * fam.scale), value * fam.scale)
    out: dict[str, float] = {}
    for (m, _), value in per_replica.items():
        out[m] = max(out[m], value) if take_max and m in out else out.get(m, 0.0) + value
    if take_max:  # the KV cache's share: outside 0..1 it is no share
        out = {m: v for m, v in out.items() if 0.0 <= v <= 1.0}
    return out


def _histograms(fam: Family, samples: Samples, model_label: str | None
                ) -> dict[str, LatencyHistogram]:
    buckets: dict[str, dict[float, float]] = {}
    sums: dict[str, float] = {}
    bad: set[str] = set()  # models whose buckets cannot be a histogram
    for labels, value in samples.get(f"{fam.name}_bucket", ()):
        le, m = labels.get("le"), _model(labels, model_label)
        if le is None:
            continue
        try:
            bound = math.inf if le in ("+Inf", "Inf", "inf") else float(le) * fam.scale
        except ValueError:
            raise Malformed(f"{fam.name}_bucket has le={le[:40]!r}, not a number") from None
        if math.isnan(bound) or bound < 0 or (math.isinf(bound) and le not in ("+Inf", "Inf",
                                                                              "inf")) \
                or not math.isfinite(value) or value < 0:
            bad.add(m)
            continue
        per = buckets.setdefault(m, {})
        per[bound] = per.get(bound, 0.0) + value
    for labels, value in samples.get(f"{fam.name}_sum", ()):
        m = _model(labels, model_label)
        if not math.isfinite(value):
            bad.add(m)
        sums[m] = sums.get(m, 0.0) + value * fam.scale
    out: dict[str, LatencyHistogram] = {}
    for m, per in buckets.items():
        if math.inf not in per or m in bad:
            continue  # not a histogram: every histogram has a +Inf bucket and finite counts
        bounds = tuple(sorted(b for b in per if b != math.inf))
        counts = (*tuple(per[b] for b in bounds), per[math.inf])
        if any(later < earlier for earlier, later in itertools.pairwise(counts)):
            continue  # not cumulative (replicas with other bounds summed): no quantile holds
        out[m] = LatencyHistogram(bounds=bounds, counts=counts, sum_seconds=sums.get(m, 0.0))
    return out


def _sums_and_counts(fam: Family, samples: Samples, engine: Engine
                     ) -> dict[str, LatencyHistogram]:
    """Triton's cumulative durations: a histogram of no bucket but +Inf, whose sum over its
    count is the mean."""
    total = _numbers(fam, samples, engine, take_max=False)
    counts: dict[str, float] = {}
    for name in fam.count:
        for m, n in _numbers(Family(name=name, kind="counter", versions=""), samples,
                             engine, take_max=False).items():
            counts[m] = counts.get(m, 0.0) + n
    return {m: LatencyHistogram(bounds=(), counts=(counts.get(m, 0.0),), sum_seconds=s)
            for m, s in total.items()}
