"""The documentation follows the code: docs/metrics.md is generated from the table the code uses
and must be current; the README stays a five-minute read (its two commands first, then a short
tour and links) and the reference lives in docs/, where every link and anchor resolves, every
README section that moved is found, and the lists that mirror the code (scenarios, verdicts,
the real-GPU check's steps) are complete."""

from __future__ import annotations

import ast
import dataclasses
import re
import shlex
from pathlib import Path

import pytest

from sidecar import alert_rules
from sidecar.judge.rules import PRECEDENCE
from sidecar.metrics import METRICS
from sidecar.simulate.scenarios import SCENARIOS
from sidecar.thresholds import THRESHOLDS
from sidecar.views.reference import render_markdown
from tests.conftest import ROOT

README = ROOT / "README.md"
DOCS = ROOT / "docs"
MARKDOWN = [README, *sorted(DOCS.glob("*.md"))]
MAIN_JOB = ("python3 -m venv .venv && .venv/bin/pip install -q . && "
            ".venv/bin/gpu-sidecar run --simulate healthy --interval 2")
TEST_COMMAND = "bash scripts/test"
# the README's reference sections before issue #27, by the document they moved to
MOVED = {
    "configuration.md": ["Running it", "Simulated GPUs", "Options, logs and exit codes",
                         "Which GPUs", "Pod identity", "Pushing to receivers",
                         "The agent's own health", "Batch Jobs: the run summary",
                         "OpenTelemetry (OTLP/HTTP)",
                         "The serving engine's figures: `--engine-metrics-url`",
                         "What the running agent knows: `gpu-sidecar status`",
                         "Checking a configuration: `--dry-run`",
                         "Scraping: `--metrics-listen ADDR`"],
    "deployment.md": ["The image and the manifests", "Adding it to an existing Deployment",
                      "GPU visibility: the choices", "Alerts and dashboard"],
    "client.md": ["Installing", "The app socket", "Publishing from the model server: `sidecar.client`",
                  "Injected, no code change"],
    "diagnose.md": ["Diagnose: which layer explains the latency"],
    "how-it-reads-the-gpu.md": ["How it reads the GPU"],
    "development.md": ["Development"],
    "gpu-check.md": ["Checking gpu-sidecar on a real GPU"],
}
# the features the README lists beside the links: each has a section in docs/configuration.md
FEATURES = ("--engine-metrics-url", "gpu-sidecar status", "--dry-run", "--metrics-listen")


def test_metrics_reference_is_up_to_date():
    committed = (ROOT / "docs" / "metrics.md").read_text()
    assert committed == render_markdown(), (
        "docs/metrics.md is stale: run `python -m sidecar.views.reference > docs/metrics.md`"
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


# -- helpers -------------------------------------------------------------------------------------

def prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code spans: what a link may appear in."""
    text = re.sub(r"^```.*?^```[^\n]*$", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def headings(text: str) -> list[str]:
    """The headings of a Markdown text, outside code blocks, as written."""
    text = re.sub(r"^```.*?^```[^\n]*$", "", text, flags=re.M | re.S)
    return [m[2].strip() for m in re.finditer(r"^(#{1,6})\s+(.*)$", text, re.M)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, lower case, punctuation dropped (hyphens and
    underscores stay), each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in headings(path.read_text()):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    return re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", prose(path.read_text()))


def sh_blocks(text: str) -> list[str]:
    return [m.strip() for m in re.findall(r"^```sh\n(.*?)^```", text, re.M | re.S)]


# -- the README ------------------------------------------------------------------------------------

def test_the_readme_is_a_five_minute_read():
    size = len(README.read_bytes())
    assert size <= 12 * 1024, f"README.md is {size} bytes: move reference text into docs/"


def test_the_readmes_first_two_commands_are_the_main_job_and_the_tests():
    blocks = sh_blocks(README.read_text())
    assert blocks[:2] == [MAIN_JOB, TEST_COMMAND], blocks[:2]
    assert "healthy" in SCENARIOS  # the main job's simulated node, on a machine without a GPU
    assert (ROOT / "scripts" / "test").is_file()


def test_the_readme_deploys_in_three_steps_and_links_every_document():
    readme = README.read_text()
    steps = readme[readme.index("## Deploy in three steps"):]
    steps = steps[:steps.index("\n## ", 1)]
    assert re.findall(r"^(\d)\. ", steps, re.M) == ["1", "2", "3"]
    assert "kubectl apply -k k8s/overlays/quickstart" in steps
    assert (ROOT / "k8s" / "overlays" / "quickstart" / "kustomization.yaml").is_file()
    linked = {(README.parent / target.split("#")[0]).resolve() for target in links(README)}
    unlinked = [p.name for p in DOCS.glob("*.md") if p.resolve() not in linked]
    assert unlinked == [], f"README.md links none of {unlinked}"


def test_the_readme_explains_the_rule_it_started_from_and_shows_a_simulated_frame():
    readme = README.read_text()
    assert "the seed" not in readme.lower()  # the write-up is explained, never named so
    assert "utilization alone lies" in readme and "low SM occupancy and" in readme
    frames = re.findall(r"```text\n(gpu-sidecar \S+  SIMULATED .*?)```", readme, re.S)
    assert len(frames) == 2, "the captured healthy table and one frame of a troubled node"
    assert "low-occupancy" in readme and "compute: occ" in frames[1]


# -- every document -----------------------------------------------------------------------------

@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(path):
    broken = []
    for target in links(path):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor in {dest.name}")
    assert broken == []


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_nothing_points_outside_the_repository_or_at_an_index_that_lacks_the_package(path):
    text = path.read_text()
    assert "shared/" not in text, "shared/ is not in the repository"
    # every pip install names a path, a wheel or a URL: no index has gpu-sidecar(-client)
    for m in re.finditer(r"pip install ([^`\n]*)", text):
        command = re.split(r"\s(?:#|&&|;|\|)\s?", m[1])[0]
        try:
            words = shlex.split(command)
        except ValueError:
            words = command.split()
        skip = False
        for word in words:
            if skip:
                skip = False
            elif word in ("--target", "-t", "-r", "--requirement", "-c", "--constraint"):
                skip = True
            elif not word.startswith("-"):
                assert "/" in word or word.startswith(".") or " @ " in word, (path.name, m[0])


@pytest.mark.parametrize(("doc", "sections"), MOVED.items())
def test_every_section_the_readme_gave_up_is_in_docs(doc, sections):
    found = headings((DOCS / doc).read_text())
    assert [s for s in sections if s not in found] == []


def test_each_feature_the_readme_lists_has_its_section_in_the_configuration_reference():
    readme = README.read_text()
    found = headings((DOCS / "configuration.md").read_text())
    for feature in FEATURES:
        assert any(feature in h for h in found), feature
        assert feature in readme, feature
    assert not any("to be completed" in h for h in found)


# -- lists that mirror the code ---------------------------------------------------------------------

def test_every_simulated_scenario_has_a_row():
    text = (DOCS / "configuration.md").read_text()
    rows = set(re.findall(r"^\| `([a-z0-9-]+)` \|", text, re.M))
    assert [s for s in SCENARIOS if s not in rows] == []


def test_every_verdict_has_a_row_and_the_precedence_is_the_codes():
    text = (DOCS / "diagnose.md").read_text()
    rows = re.findall(r"^\| `([a-z0-9-]+)` \|", text, re.M)
    assert [k for k in PRECEDENCE if k not in rows] == []
    assert [r for r in rows if r in PRECEDENCE] == list(PRECEDENCE)  # the table in that order
    said = text[text.index("in this order:"):]
    said = said[:said.index("(")]
    assert re.findall(r"`([a-z0-9-]+)`", said) == list(PRECEDENCE)


def test_the_verdict_table_is_rendered_from_the_rules():
    """The table and its precedence sentence are the rules' (``doc_when``, ``doc_todo``, in
    ``RULES`` order) with the thresholds of ``sidecar/thresholds.py``: a changed threshold
    changes its row."""
    text = (DOCS / "diagnose.md").read_text()
    assert alert_rules.diagnose_doc(text) == text, \
        "docs/diagnose.md's verdict table is stale: run `python -m sidecar.alert_rules .`"
    changed = alert_rules.diagnose_doc(
        text, dataclasses.replace(THRESHOLDS, pcie_util_ratio=0.65, queue_share_ratio=0.6))
    row = next(line for line in changed.splitlines() if line.startswith("| `pcie` |"))
    assert "TX or RX > 65 % of the link maximum" in row
    assert "the engine's queue time at least 60 % of it" in changed


def test_the_gpu_check_page_lists_every_step_of_the_script():
    script = ROOT / "bench" / "gpu_check.py"
    doc = ast.get_docstring(ast.parse(script.read_text())) or ""
    steps = re.findall(r"^(\d+)\. ", doc, re.M)
    page = (DOCS / "gpu-check.md").read_text()
    assert steps and re.findall(r"^(\d+)\. \*\*", page, re.M) == steps
    assert "bench/gpu_check.py" in page


# a section named in prose beside a link or as "see *X* below": [doc.md](doc.md), *Heading*
SECTION_REFERENCE = re.compile(
    r"\]\((?P<file>[\w./-]+\.md)\)\s*,\s*[*\"](?P<linked>[^*\"\n]+)[*\"]"
    r"|see \*(?P<here>[^*\n]+)\* (?:below|above)")


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_section_named_in_prose_exists(path):
    """A section named in words, not by an anchor (``[metrics.md](metrics.md), "run"``, or
    ``see *Heading* below``), is the start of one of that document's headings: a renamed
    heading is found here as an anchor would be by the link test."""
    missing = []
    for m in SECTION_REFERENCE.finditer(path.read_text()):
        dest = (path.parent / m["file"]).resolve() if m["file"] else path
        name = (m["linked"] or m["here"]).strip()
        if dest.suffix == ".md" and not any(
                h.lower().startswith(name.lower()) for h in headings(dest.read_text())):
            missing.append(f"{name!r} in {dest.name}")
    assert missing == []


def test_the_development_page_names_every_benchmark():
    text = (DOCS / "development.md").read_text()
    missing = [p.name for p in sorted((ROOT / "bench").glob("*.py")) if f"`{p.name}`" not in text]
    assert missing == [], f"docs/development.md does not name {missing}"


# -- the window, its buckets and the current verdict: the code's constants -------------------------

def gpu_verdict_row() -> str:
    return next(line for line in (DOCS / "metrics.md").read_text().splitlines()
                if line.startswith("| `gpu_verdict` |"))


def test_the_window_its_buckets_and_the_current_verdict_are_said_as_the_code_has_them():
    """The agent's window (``recent.WINDOW_S``), its bucket (``recent.BUCKET_S``), what
    ``gpu_verdict`` covers (``recent.CURRENT_S``) and how long an ended kind is sent at 0
    (``agent.VERDICT_GONE_S``), wherever docs/diagnose.md, docs/metrics.md and the map say them
    (the docs once said 10-second buckets and "the last minute")."""
    from sidecar.agent import VERDICT_GONE_S
    from sidecar.recent import BUCKET_S, CURRENT_S, WINDOW_S

    diagnose = prose((DOCS / "diagnose.md").read_text())
    architecture = prose((DOCS / "architecture.md").read_text())
    assert re.findall(r"keeps the last \*\*(\d+) minutes\*\*", diagnose) == [f"{WINDOW_S / 60:g}"]
    assert f"the last {WINDOW_S / 60:g} minutes as {BUCKET_S:g}-second buckets" in architecture
    for text in (diagnose, architecture, prose((DOCS / "metrics.md").read_text())):
        for said in re.findall(r"(\d+)[- ]s(?:econd)?\s+buckets?", text):
            assert float(said) == BUCKET_S, said
    assert re.findall(r"each GPU's verdict over the agent's last (\d+) s", diagnose) == [
        f"{CURRENT_S:g}"]
    row = gpu_verdict_row()
    assert re.findall(r"over the agent's last (\d+) s", row) == [f"{CURRENT_S:g}"], row
    assert re.findall(r"the verdict in the last (\d+) minutes", row) == [
        f"{VERDICT_GONE_S / 60:g}"], row
    assert "last minute" not in row


def test_the_throttled_rows_power_cap_share_is_the_scenarios():
    """The share the throttled scenario's power cap holds the clocks (its counters measure it
    over every whole period); a short `diagnose` reads it within test_scenario_figures'
    rounding."""
    from sidecar.simulate.scenarios import POWER_CAP_SHARE

    row = next(line for line in (DOCS / "configuration.md").read_text().splitlines()
               if line.startswith("| `throttled` |"))
    assert re.findall(r"the power cap (\d+) % of the time", row) == [f"{100 * POWER_CAP_SHARE:g}"]


def test_the_hardware_fault_rows_findings_are_diagnoses_at_the_default_interval_and_a_short_one(
        tmp_path):
    """docs/configuration.md: GPU 1 `gpu-lost` with its Xid 79 as the second finding
    (`hardware-fault`), GPU 2 `hardware-fault`, exit 1, at the default interval as at 0.5 s."""
    import subprocess
    import sys

    row = next(line for line in (DOCS / "configuration.md").read_text().splitlines()
               if line.startswith("| `hardware-fault` |"))
    assert "`gpu-lost` on GPU 1, its Xid 79 x2 the second finding (`hardware-fault`), at any " \
           "interval; `hardware-fault` on GPU 2 (1)" in row
    runs = {args: subprocess.Popen(
        [sys.executable, "-m", "sidecar", "diagnose", "--simulate", "hardware-fault", *args,
         "--socket", str(tmp_path / f"{i}.sock")], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, cwd=ROOT)
        for i, args in enumerate([("--duration", "10"),  # the default interval, 5 s
                                  ("--duration", "5", "--interval", "0.5")])}
    for args, proc in runs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 1, (args, out, err[-2000:])
        gpus = {int(m[1]): m[2] for m in re.finditer(r"^GPU (\d+) (.*?)(?=^GPU |\Z)", out,
                                                     re.M | re.S)}
        assert re.search(r"verdict: gpu-lost", gpus[1]), (args, out)
        assert re.search(r"2\. health: Xid 79 \(fallen off the bus\) x2", gpus[1]), (args, out)
        assert re.search(r"verdict: hardware-fault", gpus[2]), (args, out)
