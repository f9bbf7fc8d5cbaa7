"""From an engine's exposition text to our engine figures: pure functions, no I/O.

The answer is read as a stream of lines, never as one text: the body is decompressed chunk by
chunk where the engine compressed it although the agent asked it not to (never beyond
``--engine-metrics-max-bytes`` decoded), cut into lines of at most ``MAX_LINE_BYTES``, and each
line is judged on its own bytes as it comes. A line that is no sample of the text format (HTML,
JSON, bytes) ends the read at once as ``Malformed`` (a text that is partly garbage is not
trusted in part); a line of a family ``families.py`` does not read is dropped undecoded, its
metric name only looked at; the lines of the families read, for at most ``MAX_MODELS`` models and
at most ``MAX_SAMPLES`` samples, go straight on to ``prometheus_client``'s text parser, whose
errors refuse the whole read. So what one read holds is bounded by construction, whatever the
engine sends: a chunk, a line, and the samples kept, never a decoded text or a list of its lines
(the cost measured in ``bench/bench_engine.py``). A series given twice in one text (two scrapes
joined by a proxy, an exporter's bug) refuses the whole text: summing them would forward figures
that the engine never said.

The families are then mapped per model: the labels an engine adds beyond the model (vLLM's
engine-core index, SGLang's ranks, Triton's model version, a finish reason) are summed over, the
KV-cache usage taking the fullest core instead. Where an engine spells one model two ways (Dynamo's
frontend lower-cases it on its request series, not on its model gauges), the model is joined
case-insensitively and forwarded as the engine registered it (``Engine.model_spellings``).
"""

from __future__ import annotations

import itertools
import math
import re
import zlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_fd_to_metric_families

from sidecar.samples import LatencyHistogram
from sidecar.sources.engine.families import ENGINES, Engine, Family, source_names

MAX_MODELS = 16  # models per endpoint: beyond, the rest are left out and said
MAX_BUCKETS = 64  # buckets per histogram: a family with more is left out and said
MAX_MODEL_CHARS = 128  # a longer model name is cut to this (a label on every engine series)
# samples of the families read, per text (after the models beyond MAX_MODELS are dropped): the
# parsed samples are what a read holds (about 0.5 KiB each, prometheus_client's objects of the
# family being parsed included). vLLM's read families are about 90 samples per model name and
# engine core (a server names one model; 8 data-parallel cores: 720), so this leaves room for
# 16 models on 5 cores; a text with more is refused (too_large) rather than parsed
MAX_SAMPLES = 8192
MAX_LINE_BYTES = 64 << 10  # a longer line is no exporter's: the text is refused (malformed)
CHUNK_BYTES = 16 << 10  # what is decompressed, and cut into lines, at a time
_MAX_PREFIXES = 32  # metric-name prefixes kept to say what another program's text holds
_MAX_NAMES = 4096  # metric names remembered per read (as of a family read or not)
_KNOWN = source_names()
_PARTS = ("_bucket", "_sum", "_count", "_total", "_created")
_TAKE_MAX = frozenset({"engine_kv_cache_usage_ratio"})
# a sample line of the text format 0.0.4 (which the agent asks for: no quoted names): a metric
# name, its labels if any, then a value; the name and the labels are matched possessively, so
# that "ab" (a name and no value) or "name{...}" (no value) is no sample
_SAMPLE = re.compile(rb'[ \t]*+([a-zA-Z_:][a-zA-Z0-9_:]*+)'
                     rb'(?:[ \t]*+\{(?:[^"}]|"(?:[^"\\]|\\.)*+")*+\}[ \t]*+|[ \t]++)[^ \t{]')
# the label that names the model, in any engine's text (vLLM and SGLang: model_name; Triton:
# model): lines of models beyond MAX_MODELS are dropped before parsing, so a text of hundreds of
# models costs a scan, not a parse
_MODEL = re.compile(r'[{,]\s*(?:model_name|model)="((?:[^"\\]|\\.)*)"')
_MODEL_LABELS = ("model_name", "model")
_ENCODINGS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS,
              "deflate": 32 + zlib.MAX_WBITS}  # deflate: zlib-wrapped (or gzip), as HTTP says


class Malformed(ValueError):
    """The text is not the Prometheus text format."""


class TooLarge(ValueError):
    """The answer is larger than what a read may hold: decoded beyond the byte bound, or more
    samples of the families read than ``MAX_SAMPLES``."""


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


def decoded(body: bytes, encoding: str = "", limit: int = 0) -> Iterator[bytes]:
    """The answer's body in chunks, decompressed where its ``Content-Encoding`` says gzip or
    deflate (the agent asks for none, but a proxy or an engine may compress anyway), never
    beyond ``limit`` decoded bytes (0: the body's own size): a gzip answer of 2 MB that would
    inflate to 2 GiB costs a chunk at a time and ends as ``TooLarge`` at the bound."""
    limit = limit or len(body)
    coding = encoding.strip().lower()
    if coding in ("", "identity"):
        if len(body) > limit:
            raise TooLarge(f"the answer is longer than {limit} bytes (--engine-metrics-max-bytes)")
        for at in range(0, len(body), CHUNK_BYTES):
            yield body[at:at + CHUNK_BYTES]
        return
    wbits = _ENCODINGS.get(coding)
    if wbits is None:
        raise Malformed(f"the answer is encoded as {encoding[:40]!r}, which the agent does not "
                        "decode: serve it uncompressed (or gzip)")
    inflate, fresh, total = zlib.decompressobj(wbits), True, 0
    try:
        for at in range(0, len(body), CHUNK_BYTES):
            data, out = body[at:at + CHUNK_BYTES], b""
            # on while input is left, or the last output filled its chunk (more may be pending)
            while data or len(out) == CHUNK_BYTES:
                out, fresh = inflate.decompress(data, CHUNK_BYTES), False
                total += len(out)
                if total > limit:
                    raise TooLarge(f"the {coding} answer inflates beyond {limit} bytes "
                                   f"(--engine-metrics-max-bytes; {len(body)} bytes sent): "
                                   "not read further")
                if out:
                    yield out
                if inflate.eof:  # a gzip body may hold several members, one after the other
                    data = inflate.unused_data
                    inflate, fresh, out = zlib.decompressobj(wbits), True, b""
                else:
                    data = inflate.unconsumed_tail
    except zlib.error as exc:
        raise Malformed(f"the answer is not valid {coding}: {exc}") from None
    if not fresh and not inflate.eof:
        raise Malformed(f"the {coding} answer is cut before its end")


def _lines(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """The lines of a stream of chunks (split at \\n only: a label may hold U+2028), one chunk's
    at a time; a line longer than ``MAX_LINE_BYTES`` is ``Malformed``."""
    rest = b""
    for chunk in chunks:
        lines = chunk.split(b"\n")  # at most CHUNK_BYTES + 1 of them, the empty ones shared
        lines[0] = rest + lines[0]
        rest = lines.pop()
        if len(rest) > MAX_LINE_BYTES or (lines and len(lines[0]) > MAX_LINE_BYTES):
            raise Malformed(f"a line is longer than {MAX_LINE_BYTES} bytes: no exporter's")
        yield from lines
    if rest:
        yield rest


@dataclass(slots=True)
class _Scan:
    """What the line filter saw beside the lines it kept (filled as the lines stream)."""

    prefixes: set[str] = field(default_factory=set)
    models: set[str] = field(default_factory=set)
    too_many_models: bool = False
    samples: int = 0
    # metric name -> whether it is of a family read: a text repeats few names on many lines
    names: dict[bytes, bool] = field(default_factory=dict)


def relevant(chunks: Iterable[bytes], scan: _Scan) -> Iterator[str]:
    """The lines of the families we read (each with its \\n, for ``prometheus_client``), as
    they stream; ``scan`` collects every metric-name prefix seen (to recognise an engine that
    exposes none of them, or tell a text of another program) and whether lines of models beyond
    ``MAX_MODELS`` were left out. A line that is no sample of the text format makes the whole
    text ``Malformed`` there and then; more than ``MAX_SAMPLES`` kept is ``TooLarge``."""
    for number, line in enumerate(_lines(chunks), 1):
        if not line:
            continue
        line = line.removesuffix(b"\r")
        stripped = line.lstrip()
        if stripped.startswith(b"#"):
            words = line.split(None, 3)
            if (len(words) >= 3 and line.startswith(b"#") and words[1] in (b"HELP", b"TYPE")
                    and _family_of(words[2].decode("ascii", "replace"))):
                yield line.decode("utf-8", "replace") + "\n"
            continue
        if not stripped:
            continue
        sample = _SAMPLE.match(line)
        if sample is None:  # every line is checked, not only the kept ones
            raise Malformed(f"line {number} is not a sample of the text format")
        name = sample.group(1)
        known = scan.names.get(name)
        if known is None:
            text_name = name.decode("ascii")
            if len(scan.prefixes) < _MAX_PREFIXES:
                scan.prefixes.add(_prefix(text_name)[:40])
            known = _family_of(text_name) is not None
            if len(scan.names) < _MAX_NAMES:
                scan.names[name] = known
        if not known:
            continue
        text = line.decode("utf-8", "replace")
        model = _MODEL.search(text)
        if model is not None and model.group(1) not in scan.models:
            if len(scan.models) >= MAX_MODELS:
                scan.too_many_models = True
                continue
            scan.models.add(model.group(1))
        scan.samples += 1
        if scan.samples > MAX_SAMPLES:
            raise TooLarge(f"more than {MAX_SAMPLES} samples of the families read (line "
                           f"{number}): not parsed")
        yield text + "\n"


def _prefix(name: str) -> str:
    for engine in ENGINES:
        if name.startswith(engine.prefix):
            return engine.prefix
    return name.split(":", 1)[0] + ":" if ":" in name else name.split("_", 1)[0] + "_"


Labels = tuple[tuple[str, str], ...]
Samples = dict[str, list[tuple[Labels, float]]]


def samples_of(lines: Iterable[str]) -> Samples:
    """Sample name -> (labels, value) of every sample of the lines, parsed by prometheus_client
    as they stream; the labels sorted, a model name cut to ``MAX_MODEL_CHARS`` as it is
    forwarded (one tuple per sample, which also says whether the series came before). A series
    given twice is ``Malformed``: which of the two is the engine's figure cannot be told, and
    their sum is neither."""
    out: Samples = {}
    seen: set[tuple[str, Labels]] = set()
    # the parser makes new strings for every sample's label names and values: one copy each is
    # kept (a text repeats them on every line), so what is held is mostly the values
    strings: dict[str, str] = {}
    try:
        for family in text_fd_to_metric_families(lines):  # type: ignore[arg-type]
            for s in family.samples:
                labels = tuple(sorted(
                    (strings.setdefault(k, k),
                     strings.setdefault(v, v)[:MAX_MODEL_CHARS] if k in _MODEL_LABELS
                     else strings.setdefault(v, v))
                    for k, v in s.labels.items()))
                if (s.name, labels) in seen:
                    shown = ",".join(f'{k}="{v[:40]}"' for k, v in labels)
                    raise Malformed(f"the series {s.name}{{{shown}}} is given twice in one "
                                    "text (two scrapes joined, or an exporter's bug): no "
                                    "figure of it can be trusted")
                seen.add((s.name, labels))
                out.setdefault(s.name, []).append((labels, float(s.value)))
    except (TooLarge, Malformed):
        raise
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        raise Malformed(str(exc)[:200] or type(exc).__name__) from None
    return out


def _rows(samples: Samples, name: str) -> Iterator[tuple[dict[str, str], float]]:
    """A sample name's rows with their labels as a dict (made one at a time)."""
    for labels, value in samples.get(name, ()):
        yield dict(labels), value


def recognise(samples: Samples) -> Engine | None:
    """The engine with the most of our figures in the text."""
    best, best_n = None, 0
    for engine in ENGINES:
        n = sum(1 for fams in engine.figures.values() if any(_present(f, samples) for f in fams))
        if n > best_n:
            best, best_n = engine, n
    return best


def _present(fam: Family, samples: Samples) -> bool:
    if fam.kind == "histogram_sum":
        return f"{fam.name}_sum" in samples
    if fam.kind == "histogram":
        return f"{fam.name}_bucket" in samples or f"{fam.name}_count" in samples
    return fam.name in samples or f"{fam.name}_total" in samples


def figures_of(chunks: Iterable[bytes]) -> tuple[EngineFigures | None, set[str]]:
    """The engine's figures in the text streamed as ``chunks`` (``decoded``'s; None: no engine
    we know), and the metric-name prefixes seen."""
    scan = _Scan()
    samples = samples_of(relevant(chunks, scan))
    engine = recognise(samples)
    if engine is None:
        return None, scan.prefixes
    figures = map_engine(engine, samples)
    if scan.too_many_models and "too_many_models" not in figures.left_out:
        figures = EngineFigures(engine=figures.engine, figures=figures.figures,
                                left_out=(*figures.left_out, "too_many_models"))
    return figures, scan.prefixes


def map_engine(engine: Engine, samples: Samples) -> EngineFigures:
    figures: dict[str, Mapping[str, LatencyHistogram | float]] = {}
    left_out: list[str] = []
    models: set[str] = set()
    spell = _spellings(engine, samples)
    for ours, fams in engine.figures.items():
        fam = next((f for f in fams if _present(f, samples)), None)
        if fam is None:
            continue
        by_model: Mapping[str, LatencyHistogram | float]
        if fam.kind == "histogram":
            by_model = _histograms(fam, samples, engine.model_label, spell)
            if any(len(h.bounds) > MAX_BUCKETS for h in by_model.values()):
                left_out.append(f"too_many_buckets:{fam.name}")
                continue
        elif fam.kind == "microsecond_counter":
            by_model = _sums_and_counts(fam, samples, engine)
        elif fam.kind == "histogram_sum":  # its _sum: a counter of seconds
            by_model = _numbers(Family(name=f"{fam.name}_sum", kind="counter", versions="",
                                       scale=fam.scale), samples, engine, take_max=False,
                                spell=spell)
        else:
            by_model = _numbers(fam, samples, engine, take_max=ours in _TAKE_MAX, spell=spell)
        models.update(by_model)
        figures[ours] = by_model
    if len(models) > MAX_MODELS:
        keep = set(sorted(models)[:MAX_MODELS])
        figures = {k: {m: v for m, v in by.items() if m in keep} for k, by in figures.items()}
        left_out.append("too_many_models")
    return EngineFigures(engine=engine.name, figures=figures, left_out=tuple(left_out))


def _spellings(engine: Engine, samples: Samples) -> dict[str, str]:
    """The model names as the engine registered them (its ``model_spellings`` families' model
    label), by their case-folded form: the key that joins its other series to them."""
    out: dict[str, str] = {}
    if engine.model_label is None:
        return out
    for name in engine.model_spellings:
        for labels, _ in samples.get(name, ()):
            model = dict(labels).get(engine.model_label)
            if model:
                out.setdefault(model.casefold(), model)
    return out


def _model(labels: Mapping[str, str], model_label: str | None,
           spell: Mapping[str, str] | None = None) -> str:
    model = labels.get(model_label, "")[:MAX_MODEL_CHARS] if model_label else ""
    return spell.get(model.casefold(), model) if spell else model


def _numbers(fam: Family, samples: Samples, engine: Engine, *,
             take_max: bool, spell: Mapping[str, str] | None = None) -> dict[str, float]:
    """A gauge or counter per model: the largest within a replica, summed over replicas (or
    the largest of all where ``take_max``)."""
    rows = _rows(samples, f"{fam.name}_total" if f"{fam.name}_total" in samples else fam.name)
    per_replica: dict[tuple[str, tuple[str, ...]], float] = {}
    for labels, value in rows:
        if not math.isfinite(value):
            continue
        m = _model(labels, engine.model_label, spell)
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


def _histograms(fam: Family, samples: Samples, model_label: str | None,
                spell: Mapping[str, str] | None = None) -> dict[str, LatencyHistogram]:
    buckets: dict[str, dict[float, float]] = {}
    sums: dict[str, float] = {}
    bad: set[str] = set()  # models whose buckets cannot be a histogram
    for labels, value in _rows(samples, f"{fam.name}_bucket"):
        le, m = labels.get("le"), _model(labels, model_label, spell)
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
    for labels, value in _rows(samples, f"{fam.name}_sum"):
        m = _model(labels, model_label, spell)
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
