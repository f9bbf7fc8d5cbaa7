"""The deployment kit, each part checked with the real tool: hadolint, kubectl kustomize with
kubernetes-validate, promtool, and a real VictoriaMetrics for every dashboard query."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import requests
import yaml

from sidecar import alert_rules, config
from sidecar.judge.rules import RULES
from sidecar.metrics import BY_NAME
from sidecar.sources.engine.families import ENGINES
from sidecar.thresholds import THRESHOLDS
from tests.conftest import ROOT
from tests.receivers import Agent, VictoriaMetrics, need, running
from tests.waiting import until

K8S = ROOT / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir())
KUBERNETES_VERSION = "1.35.0"


def run(*args: str, cwd: Path = ROOT, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, cwd=cwd, input=input, timeout=120)


# -- Dockerfile --------------------------------------------------------------------------------

def test_dockerfile_passes_hadolint():
    proc = run(need("hadolint"), "Dockerfile")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_follows_the_rules_for_a_gpu_sidecar_image():
    text = (ROOT / "Dockerfile").read_text()
    froms = re.findall(r"^FROM\s+(\S+)", text, re.M)
    assert len(froms) >= 2 and all("slim" in f and "alpine" not in f for f in froms)
    assert re.search(r"^USER\s+65532", text, re.M)
    assert re.search(r'^ENTRYPOINT\s+\["gpu-sidecar", "run"\]', text, re.M)  # exec form: PID 1
    assert not re.search(r"^HEALTHCHECK", text, re.M)
    assert "NVIDIA_DRIVER_CAPABILITIES=utility" in text
    assert not re.search(r"^\s*(ENV|ARG).*NVIDIA_VISIBLE_DEVICES", text, re.M)


# -- Kubernetes --------------------------------------------------------------------------------

TARGETS = ["base", *[f"overlays/{o}" for o in OVERLAYS]]
DEFAULT_TARGETS = [t for t in TARGETS if t != "overlays/scrape"]  # scrape: opt-in, on quickstart
WORKLOADS = ("Deployment", "StatefulSet", "Job")


@functools.cache
def _kustomize(path: Path) -> str:
    proc = run(need("kubectl"), "kustomize", str(path))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def render(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(_kustomize(path)) if d]


def validate(docs: list[dict]) -> subprocess.CompletedProcess:
    return run(need("kubernetes-validate"), "--strict", "--quiet", "-k", KUBERNETES_VERSION, "-",
               input=yaml.safe_dump_all(docs))


def sidecar_of(doc: dict, where: str = "initContainers") -> dict:
    spec = doc["spec"]["template"]["spec"]
    found = [c for c in spec.get(where, []) if c["name"] == "gpu-sidecar"]
    assert len(found) == 1, f"{doc['kind']}/{doc['metadata']['name']}: no gpu-sidecar in {where}"
    return found[0]


def the_sidecar(doc: dict) -> dict:
    """gpu-sidecar, native (an init container) or not (overlays/legacy)."""
    spec = doc["spec"]["template"]["spec"]
    (found,) = [c for c in spec.get("initContainers", []) + spec["containers"]
                if c["name"] == "gpu-sidecar"]
    return found


def apps_of(doc: dict) -> list[dict]:
    return [c for c in doc["spec"]["template"]["spec"]["containers"] if c["name"] != "gpu-sidecar"]


def workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] in WORKLOADS]


def environment(container: dict, docs: list[dict]) -> dict[str, object]:
    """The container's environment as the kubelet builds it: the ConfigMaps of envFrom in order
    (a later one wins for a key in both), then env, which wins over all; a valueFrom stays as
    written. A ConfigMap referenced but not rendered must be optional."""
    maps = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    out: dict[str, object] = {}
    for source in container.get("envFrom", []):
        ref = source["configMapRef"]
        if ref["name"] in maps:
            out.update(maps[ref["name"]])
        else:
            assert ref.get("optional") is True, f"{ref['name']} is neither rendered nor optional"
    for e in container.get("env", []):
        out[e["name"]] = e["value"] if "value" in e else e["valueFrom"]
    return out


def agent_env(doc: dict, docs: list[dict]) -> dict[str, object]:
    return environment(the_sidecar(doc), docs)


def copy_of_k8s(tmp_path: Path) -> Path:
    """A copy of k8s/ to edit as a user would; kustomize paths stay inside it."""
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    return copy


def edited(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} is not one line of {path}"
    path.write_text(text.replace(old, new))


@pytest.mark.parametrize("target", TARGETS)
def test_every_kustomization_renders_and_validates_strictly(target):
    docs = render(K8S / target)
    proc = validate(docs)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for doc in workloads(docs):
        native = target != "overlays/legacy"
        c = sidecar_of(doc, "initContainers" if native else "containers")
        assert c.get("restartPolicy") == ("Always" if native else None)
        sc = c["securityContext"]
        assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
        assert "startupProbe" in c and "readinessProbe" not in c
        assert c["resources"]["requests"] and c["resources"]["limits"]
        env = {e["name"]: e for e in c["env"]}
        assert env["GPU_SIDECAR_POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert env["GPU_SIDECAR_NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
        pod = doc["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] > int(env["GPU_SIDECAR_SHUTDOWN_TIMEOUT"]["value"])
        volumes = {v["name"] for v in pod["volumes"]}
        assert {"gpu-sidecar-run", "gpu-sidecar-spool"} <= volumes
        for app in apps_of(doc):  # the app sees the socket
            assert any(m["name"] == "gpu-sidecar-run" for m in app.get("volumeMounts", []))
        # every variable, from env or from a ConfigMap, names an option the agent has
        from sidecar.config import OPTION_BY_NAME

        seen = environment(c, docs)
        options = {k.removeprefix("GPU_SIDECAR_").lower() for k in seen if k.startswith("GPU_SIDECAR_")}
        assert options <= set(OPTION_BY_NAME), options - set(OPTION_BY_NAME)


def test_strict_validation_is_not_vacuous():
    docs = render(K8S / "base")
    workloads(docs)[0]["spec"]["template"]["spec"]["initContainers"][0]["restartPolicyy"] = "Always"
    assert validate(docs).returncode != 0


def test_base_has_a_deployment_and_a_job_and_the_job_can_complete():
    docs = render(K8S / "base")
    assert {d["kind"] for d in workloads(docs)} == {"Deployment", "Job"}
    # and nothing else but the component's defaults for the agent
    assert [d["metadata"]["name"] for d in docs if d["kind"] not in WORKLOADS] == \
        [next(d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap")]
    job = next(d for d in docs if d["kind"] == "Job")
    assert sidecar_of(job)["restartPolicy"] == "Always"  # a native sidecar does not block completion


def test_overlays_configure_what_they_say():
    docs = render(K8S / "overlays/remote-write-victoriametrics")
    for workload in workloads(docs):
        rw = agent_env(workload, docs)
        assert rw["GPU_SIDECAR_REMOTE_WRITE_URL"].endswith("/api/v1/write")
        assert "GPU_SIDECAR_BEARER_TOKEN_FILE" not in rw  # only when asked for: see below
    docs = render(K8S / "overlays/pushgateway")
    for workload in workloads(docs):
        pg = agent_env(workload, docs)
        assert pg["GPU_SIDECAR_PUSHGATEWAY_URL"].endswith(":9091")
        if workload["kind"] == "Job":  # grouped by the Job, kept at exit for its run summary
            assert "GPU_SIDECAR_PUSHGATEWAY_DELETE_ON_EXIT" not in pg
            assert pg["GPU_SIDECAR_BATCH_JOB"]["fieldRef"]["fieldPath"] == \
                "metadata.labels['batch.kubernetes.io/job-name']"
        else:  # a Deployment's pod group goes with the pod
            assert pg["GPU_SIDECAR_PUSHGATEWAY_DELETE_ON_EXIT"] == "true"
            assert "GPU_SIDECAR_BATCH_JOB" not in pg
    docs = render(K8S / "overlays/nvml-node-gpus")
    for workload in workloads(docs):
        nv = agent_env(workload, docs)
        assert nv["NVIDIA_VISIBLE_DEVICES"] == "all" and nv["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
        assert nv["GPU_SIDECAR_NO_NVML"] == "false" and nv["GPU_SIDECAR_GPUS"] == "announced"
        assert workload["spec"]["template"]["spec"]["runtimeClassName"] == "nvidia"
    assert "SECURITY CAVEAT" in (K8S / "overlays/nvml-node-gpus/kustomization.yaml").read_text()
    assert "SECURITY CAVEAT" in (K8S / "components/nvml-node-gpus/kustomization.yaml").read_text()
    docs = render(K8S / "overlays/otlp")
    for workload in workloads(docs):  # the Job too: it is configured alike
        otlp = agent_env(workload, docs)
        assert otlp["GPU_SIDECAR_OTLP_URL"].endswith(":4318/v1/metrics")
        assert "GPU_SIDECAR_POD_NAME" in otlp  # the resource's k8s.pod.name, from the base
    legacy = render(K8S / "overlays/legacy")
    assert {d["kind"] for d in workloads(legacy)} == {"Deployment"}
    assert "What is lost" in (K8S / "overlays/legacy/kustomization.yaml").read_text()


# -- the quick start: all three layers, the receiver in one line, no Secret ---------------------

QUICKSTART = K8S / "overlays/quickstart"
RECEIVER_LINE = re.compile(r"^\s+- (GPU_SIDECAR_(?:REMOTE_WRITE|OTLP|PUSHGATEWAY)_URL=\S+)$", re.M)


def test_the_quickstart_sidecar_reads_nvml_without_taking_a_gpu_from_the_app():
    docs = render(QUICKSTART)
    assert {d["kind"] for d in workloads(docs)} == {"Deployment", "Job"}
    for doc in workloads(docs):
        env = agent_env(doc, docs)
        assert env["GPU_SIDECAR_NO_NVML"] == "false"  # compute and IO layers from NVML
        # management access to the node's GPUs through the NVIDIA runtime, no compute
        assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
        assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
        assert doc["spec"]["template"]["spec"]["runtimeClassName"] == "nvidia"
        assert env["GPU_SIDECAR_GPUS"] == "announced"  # exported: only the app's GPUs
        resources = sidecar_of(doc)["resources"]
        assert not any("nvidia.com" in k for part in resources.values() for k in part)
        (app,) = apps_of(doc)  # the app keeps its device-plugin GPU
        assert app["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert "GPU_SIDECAR_INJECT" not in env  # the memory layer: the injected publisher
    assert "SECURITY CAVEAT" in (K8S / "components/nvml-node-gpus/kustomization.yaml").read_text()


def test_the_quickstart_receiver_is_one_line_of_its_kustomization(tmp_path):
    text = (QUICKSTART / "kustomization.yaml").read_text()
    (line,) = RECEIVER_LINE.findall(text)
    name, url = line.split("=", 1)
    docs = render(QUICKSTART)
    for doc in workloads(docs):
        sidecar = sidecar_of(doc)
        assert environment(sidecar, docs)[name] == url
        assert name not in {e["name"] for e in sidecar["env"]}  # from the ConfigMap, not a patch
    # the user edits that line and the image, and nothing else
    copy = copy_of_k8s(tmp_path)
    quickstart = copy / "overlays/quickstart/kustomization.yaml"
    edited(quickstart, line, f"{name}=https://vm.example.net/api/v1/write")
    edited(quickstart, "newName: ghcr.io/gpu-sidecar/gpu-sidecar", "newName: registry.example.net/gs")
    edited(quickstart, 'newTag: "0.1.0"', 'newTag: "7.7"')
    docs = render(copy / "overlays/quickstart")
    for doc in workloads(docs):
        assert environment(sidecar_of(doc), docs)[name] == "https://vm.example.net/api/v1/write"
        assert sidecar_of(doc)["image"] == "registry.example.net/gs:7.7"


@pytest.mark.parametrize("target", TARGETS)
def test_no_kustomization_needs_a_secret_that_may_not_exist(target):
    docs = render(K8S / target)
    for doc in workloads(docs):
        pod = doc["spec"]["template"]["spec"]
        for volume in pod.get("volumes", []):
            if "secret" in volume:
                assert volume["secret"].get("optional") is True, volume["name"]
            for source in volume.get("projected", {}).get("sources", []):
                assert "secret" not in source or source["secret"].get("optional") is True
        for c in pod["containers"] + pod.get("initContainers", []):
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                assert ref is None or ref.get("optional") is True, (c["name"], e["name"])
            for source in c.get("envFrom", []):
                assert "secretRef" not in source or source["secretRef"].get("optional") is True
    assert not [d for d in docs if d["kind"] == "Secret"]


def test_remote_write_authenticates_with_the_secret_only_once_asked_to(tmp_path):
    overlay = K8S / "overlays/remote-write-victoriametrics"
    text = (overlay / "kustomization.yaml").read_text()
    (secret,) = re.findall(r"kubectl create secret generic (\S+) --from-literal=(\w+)=", text)
    copy = copy_of_k8s(tmp_path)
    line = re.search(r"^(\s+)# (- GPU_SIDECAR_BEARER_TOKEN_FILE=\S+)$", text, re.M)
    edited(copy / "overlays/remote-write-victoriametrics/kustomization.yaml", line.group(0),
           line.group(1) + line.group(2))  # uncommented, as the comment says
    docs = render(copy / "overlays/remote-write-victoriametrics")
    for doc in workloads(docs):
        token_file = environment(sidecar_of(doc), docs)["GPU_SIDECAR_BEARER_TOKEN_FILE"]
        (volume,) = [v for v in doc["spec"]["template"]["spec"]["volumes"] if "secret" in v]
        assert volume["secret"]["secretName"] == secret[0]
        (mount,) = [m for m in sidecar_of(doc)["volumeMounts"] if m["name"] == volume["name"]]
        assert token_file == f"{mount['mountPath']}/{secret[1]}" and mount["readOnly"] is True


@pytest.mark.parametrize("target", TARGETS)
def test_every_series_is_labelled_with_the_app_container_whose_gpus_they_are(target):
    docs = render(K8S / target)
    for doc in workloads(docs):
        env = {e["name"]: e.get("value") for e in the_sidecar(doc)["env"]}
        assert env["GPU_SIDECAR_POD_CONTAINER"] == apps_of(doc)[0]["name"]


def test_the_container_label_follows_a_renamed_app_container(tmp_path):
    copy = copy_of_k8s(tmp_path)
    edited(copy / "base/inference-deployment.yaml", "- name: server", "- name: vllm")
    docs = render(copy / "overlays/quickstart")
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    assert environment(sidecar_of(deployment), docs)["GPU_SIDECAR_POD_CONTAINER"] == "vllm"


HEARTBEAT_STALE_FLOOR_S = 30  # `gpu-sidecar status --alive`: stale past max(3 x interval, 30 s)


@pytest.mark.parametrize("target", TARGETS)
def test_the_liveness_probe_restarts_only_an_agent_stuck_for_90_seconds(target):
    docs = render(K8S / target)
    for doc in workloads(docs):
        c = the_sidecar(doc)
        probe = c["livenessProbe"]
        assert probe["exec"]["command"] == ["gpu-sidecar", "status", "--alive"]
        assert c["startupProbe"]["exec"]["command"] == ["test", "-S", "/run/gpu-sidecar/app.sock"]
        interval = float(environment(c, docs).get("GPU_SIDECAR_INTERVAL", 5))
        stale = max(3 * interval, HEARTBEAT_STALE_FLOOR_S)
        period, failures = probe["periodSeconds"], probe["failureThreshold"]
        # after the last cycle: stale, then `failures` failed probes in a row, the first of them
        # anywhere from at once to one period later
        assert stale + (failures - 1) * period >= 90
        assert stale + failures * period <= 180  # but a stuck agent does get restarted
        # from start-up (liveness begins once the startupProbe passed), before any heartbeat
        assert probe.get("initialDelaySeconds", 0) + (failures - 1) * period >= 90
        assert probe["timeoutSeconds"] >= 5  # a second interpreter, under the container's CPU limit


def test_the_liveness_probe_runs_a_command_the_agent_has():
    proc = run(sys.executable, "-m", "sidecar", "status", "--help")
    assert proc.returncode == 0 and "--alive" in proc.stdout, proc.stdout + proc.stderr


# -- scraping: an opt-in overlay and a PodMonitor ----------------------------------------------

def test_only_the_scrape_overlay_serves_metrics_and_the_podmonitor_finds_it():
    monitor = yaml.safe_load((K8S / "monitoring/podmonitor.yaml").read_text())
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["kind"] == "PodMonitor"
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["honorLabels"] is True  # the agent's container label, not the scrape's
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    selector = monitor["spec"]["selector"]["matchLabels"]
    docs, quickstart = render(K8S / "overlays/scrape"), render(QUICKSTART)
    for doc in workloads(docs):
        labels = doc["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items()
        assert not selector.items() <= doc["spec"].get("selector", {}).get("matchLabels", {}).items()
        sidecar = sidecar_of(doc)
        (port,) = [p for p in sidecar["ports"] if p["name"] == endpoint["port"]]
        listen = environment(sidecar, docs)["GPU_SIDECAR_METRICS_LISTEN"]
        assert listen == f"0.0.0.0:{port['containerPort']}"
        (pushing,) = [d for d in workloads(quickstart)
                      if (d["kind"], d["metadata"]["name"]) == (doc["kind"], doc["metadata"]["name"])]
        assert environment(sidecar, docs)["GPU_SIDECAR_REMOTE_WRITE_URL"] == \
            agent_env(pushing, quickstart)["GPU_SIDECAR_REMOTE_WRITE_URL"]  # and still pushes
    for target in DEFAULT_TARGETS:  # off by default
        docs = render(K8S / target)
        for doc in workloads(docs):
            c = the_sidecar(doc)
            assert "GPU_SIDECAR_METRICS_LISTEN" not in environment(c, docs) and "ports" not in c
            assert not selector.items() <= doc["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.parametrize("version", ["1.34.0", "1.35.0"])
def test_dra_overlay_validates_strictly_from_the_first_release_with_resource_v1(version):
    docs = render(K8S / "overlays/dra")
    proc = run(need("kubernetes-validate"), "--strict", "--quiet", "-k", version, "-",
               input=yaml.safe_dump_all(docs))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    template = next(d for d in docs if d["kind"] == "ResourceClaimTemplate")
    template["spec"]["spec"]["devices"]["requests"][0]["exactly"]["countt"] = 1
    proc = run(need("kubernetes-validate"), "--strict", "--quiet", "-k", version, "-",
               input=yaml.safe_dump_all(docs))
    assert proc.returncode != 0, "the claim template must be validated too"


def test_dra_overlay_gives_the_app_and_the_sidecar_the_same_claim_and_nothing_more():
    docs = render(K8S / "overlays/dra")
    templates = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ResourceClaimTemplate"}
    assert templates["pod-gpus"]["apiVersion"] == "resource.k8s.io/v1"
    request = templates["pod-gpus"]["spec"]["spec"]["devices"]["requests"][0]["exactly"]
    assert request["deviceClassName"] == "gpu.nvidia.com"
    assert {d["kind"] for d in workloads(docs)} == {"Deployment", "Job"}
    for doc in workloads(docs):
        pod = doc["spec"]["template"]["spec"]
        claims = {c["name"]: c for c in pod["resourceClaims"]}
        assert claims == {"gpus": {"name": "gpus", "resourceClaimTemplateName": "pod-gpus"}}
        containers = pod["containers"] + pod.get("initContainers", [])
        users = {c["name"] for c in containers
                 if {"name": "gpus"} in c.get("resources", {}).get("claims", [])}
        app = pod["containers"][0]["name"]
        assert users == {app, "gpu-sidecar"}, doc["metadata"]["name"]
        for c in containers:  # nothing widens GPU visibility beyond the claim
            resources = c.get("resources", {})
            assert not any("nvidia.com" in k for part in ("limits", "requests")
                           for k in resources.get(part, {})), c["name"]
            assert not [k for k in environment(c, docs) if k.startswith("NVIDIA_VISIBLE")]
            sc = c.get("securityContext", {})
            assert not sc.get("privileged") and "add" not in sc.get("capabilities", {})
            assert not any(m["mountPath"].startswith("/dev") for m in c.get("volumeMounts", []))
        assert not any("hostPath" in v for v in pod["volumes"])
        env = environment(sidecar_of(doc), docs)
        assert env["GPU_SIDECAR_NO_NVML"] == "false" and env["GPU_SIDECAR_GPUS"] == "visible"


# -- alerts ------------------------------------------------------------------------------------

ALERTS = ROOT / "deploy" / "alerts"


def test_alert_rules_pass_promtool_check_and_unit_tests():
    promtool = need("promtool")
    check = run(promtool, "check", "rules", "gpu-sidecar.rules.yml", cwd=ALERTS)
    assert check.returncode == 0, check.stdout + check.stderr
    tests = run(promtool, "test", "rules", "gpu-sidecar.tests.yml", cwd=ALERTS)
    assert tests.returncode == 0, tests.stdout + tests.stderr
    assert "SUCCESS" in tests.stdout


def test_rule_files_are_rendered_from_the_one_set_of_thresholds():
    assert (ROOT / alert_rules.RULES_FILE).read_text() == alert_rules.rules(), \
        "regenerate with: python -m sidecar.alert_rules"
    assert (ROOT / alert_rules.OPERATOR_FILE).read_text() == alert_rules.prometheus_rule()


def test_the_promtool_cases_are_rendered_from_the_rules():
    """The committed cases are the rules' own (``alert_tests``, in precedence order) and those
    of the alerts that are no verdict's: the file promtool runs above is what the rules hold."""
    assert (ROOT / alert_rules.TESTS_FILE).read_text() == alert_rules.tests(), \
        "regenerate with: python -m sidecar.alert_rules ."
    names = [c["name"] for c in yaml.safe_load(alert_rules.tests())["tests"]]
    of_rules = [c["name"] for r in RULES if r.alert_tests for c in yaml.safe_load(r.alert_tests)]
    assert of_rules and names[:len(of_rules)] == of_rules


@pytest.mark.parametrize("r", [r for r in RULES if r.alerts], ids=lambda r: r.kind)
def test_every_alert_of_a_rule_is_named_by_its_own_cases(r):
    """A verdict's alert comes with its promtool cases in its own rule: one that no case of
    ``alert_tests`` names is untested (the whole file's cases would not say whose they are)."""
    defined = re.findall(r"^      - alert: (\w+)$", r.alerts, re.M)
    named = set(re.findall(r"^ +alertname: (\w+)$", r.alert_tests, re.M))
    assert defined and [a for a in defined if a not in named] == []


def rule(rules: dict, name: str) -> dict:
    return next(r for g in rules["groups"] for r in g["rules"] if r.get("alert") == name)


def test_a_threshold_changed_in_thresholds_py_changes_the_rules_promtool_runs(tmp_path):
    changed = dataclasses.replace(THRESHOLDS, pcie_util_ratio=0.65, p99_latency_s=0.4)
    (tmp_path / "deploy" / "alerts").mkdir(parents=True)
    (tmp_path / "k8s" / "monitoring").mkdir(parents=True)
    alert_rules.write(tmp_path, changed)
    rules = yaml.safe_load((tmp_path / alert_rules.RULES_FILE).read_text())
    assert rule(rules, "GPUPCIeSaturated")["expr"].rstrip().endswith(") > 0.65")
    assert "more than 65 % of the PCIe link" in rule(rules, "GPUPCIeSaturated")["annotations"][
        "description"]
    assert rule(rules, "GPULowOccupancyAndSlowRequests")["expr"].count(") > 0.4\n") == 2
    shipped = yaml.safe_load((ALERTS / "gpu-sidecar.rules.yml").read_text())
    assert rule(shipped, "GPUPCIeSaturated")["expr"].rstrip().endswith(") > 0.8")
    check = run(need("promtool"), "check", "rules", str(tmp_path / alert_rules.RULES_FILE))
    assert check.returncode == 0, check.stdout + check.stderr
    operator = yaml.safe_load((tmp_path / alert_rules.OPERATOR_FILE).read_text())
    assert operator["spec"] == rules


def test_prometheusrule_carries_exactly_the_plain_rules():
    plain = yaml.safe_load((ALERTS / "gpu-sidecar.rules.yml").read_text())
    crd = yaml.safe_load((K8S / "monitoring" / "prometheusrule.yaml").read_text())
    assert crd["kind"] == "PrometheusRule" and crd["apiVersion"] == "monitoring.coreos.com/v1"
    assert crd["spec"] == plain


def metric_names(expr: str) -> set[str]:
    names = set(re.findall(r"\b((?:gpu|inference)_[a-z0-9_]+)", expr))
    out = set()
    for n in names:
        for suffix in ("_bucket", "_count", "_sum"):
            if n.startswith("inference_") and n.endswith(suffix):
                n = n.removesuffix(suffix)
        out.add(n)
    return out


def test_rules_and_dashboard_use_only_metrics_the_agent_produces():
    rules = yaml.safe_load((ALERTS / "gpu-sidecar.rules.yml").read_text())
    exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    exprs += [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]
    labels = {"gpu_uuid", "gpu_name", "gpu_index"}
    used = set().union(*(metric_names(e) for e in exprs)) - labels
    # {__name__=~"gpu_pcie_(tx|rx)_..."} is checked by its expansions
    used |= {"gpu_pcie_tx_bandwidth_util_ratio", "gpu_pcie_rx_bandwidth_util_ratio"}
    unknown = {n for n in used if n not in BY_NAME and not n.endswith("_")}
    assert not unknown, unknown


# -- dashboard ---------------------------------------------------------------------------------

def dashboard() -> dict:
    return json.loads((ROOT / "deploy" / "grafana" / "gpu-sidecar-dashboard.json").read_text())


def substitute(expr: str) -> str:
    return (expr.replace("$__rate_interval", "1m").replace("$__range", "1h")
            .replace("$namespace", "ml")
            .replace("$pod", "llm-0").replace("$gpu", ".*"))


def test_dashboard_is_importable_and_has_the_promised_rows_and_variables():
    d = dashboard()
    rows = [p["title"] for p in d["panels"] if p["type"] == "row"]
    assert rows == ["Why", "Compute", "Memory", "IO", "Health", "App latency", "Serving engine",
                    "Agent health", "Batch runs"]
    names = [v["name"] for v in d["templating"]["list"]]
    assert {"namespace", "pod", "gpu"} <= set(names)
    assert d["uid"] and d["schemaVersion"] >= 36
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))


def test_every_dashboard_query_returns_data_from_a_real_victoriametrics(tmp_path):
    vm = VictoriaMetrics(tmp_path).start()
    with running(vm):
        agent = Agent(["--simulate", "healthy", "--interval", "0.5", "--push-interval", "1",
                       "--remote-write-url", vm.write_url, "--spool-dir", str(tmp_path / "sp"),
                       "--pod-namespace", "ml", "--pod-name", "llm-0", "--node-name", "n1",
                       "--batch-job", "nightly-eval"])  # and a run summary for "Batch runs"
        agent.start()
        # and a Grace Hopper node beside it, for the NVLink-C2C panels (absent elsewhere)
        grace = Agent(["--simulate", "grace-hopper", "--interval", "0.5", "--push-interval", "1",
                       "--remote-write-url", vm.write_url, "--spool-dir", str(tmp_path / "sp2"),
                       "--pod-namespace", "ml", "--pod-name", "llm-0", "--node-name", "n2"])
        grace.start()
        # and a pod whose serving engine (simulated vLLM) is read, for the engine row
        engine = Agent(["--simulate", "kv-cache-full", "--interval", "0.5", "--push-interval",
                        "1", "--remote-write-url", vm.write_url, "--spool-dir",
                        str(tmp_path / "sp3"), "--pod-namespace", "ml", "--pod-name", "llm-0",
                        "--node-name", "n3"])
        engine.start()
        # the data the panels judge: every series they need (but the run summary's, printed by
        # the last cycle; "or on() vector(0)" needs none) in two cycles at least, and 12
        # cycles for rates and increases
        queried = {name for panel in dashboard()["panels"] for target in panel.get("targets", [])
                   if "vector(0)" not in target["expr"]
                   for name in re.findall(r"([a-z_][a-z0-9_]*)\{", target["expr"])
                   if not name.startswith("gpu_run_")}

        def missing() -> set[str]:
            # as printed: a rare figure is pushed once, then when it changes or every minute
            seen = Counter(name for name, _ in {(n, ts) for a in (agent, grace, engine)
                                                for n, _, ts, _ in a.recorded()})
            return {name for name in queried if seen[name] < 2}

        until(lambda: (min(agent.cycles(), grace.cycles(), engine.cycles()) >= 12
                       and not missing())
              or any(a.proc.poll() is not None for a in (agent, grace, engine)),
              interval=0.2, what=lambda: f"12 cycles with every queried series (at "
                                         f"{agent.cycles()}; missing {sorted(missing())})")
        assert agent.stop() == 0 and grace.stop() == 0 and engine.stop() == 0
        vm.settled(len(agent.sampled()) + len(grace.sampled()) + len(engine.sampled()))
        failures = []
        # series first written in the agent's last cycle (the run summary) can take VictoriaMetrics
        # a few seconds to index for queries, after /api/v1/export already shows them
        deadline = time.monotonic() + 15
        # asked at the last cycle of the agent that stopped first: the clean stops' staleness
        # markers, 1 ms after each agent's last cycle, end its series (as a dashboard shows a
        # stopped pod: nothing after its stop)
        at = min(max(ts for _, _, ts, _ in a.sampled()) for a in (agent, grace, engine)) / 1000
        for panel in dashboard()["panels"]:
            for target in panel.get("targets", []):
                expr = substitute(target["expr"])
                while True:
                    r = requests.get(f"{vm.base}/api/v1/query", params={"query": expr,
                                                                        "time": f"{at:.3f}"},
                                     timeout=30)
                    r.raise_for_status()
                    if r.json()["data"]["result"] or time.monotonic() > deadline:
                        break
                    time.sleep(0.5)
                if not r.json()["data"]["result"]:
                    failures.append(f"{panel['title']}: {expr}")
        assert not failures, "queries without data:\n" + "\n".join(failures)
        for var in dashboard()["templating"]["list"]:
            if var["type"] != "query":
                continue
            m = re.match(r"label_values\((.*),\s*(\w+)\)$", var["query"]["query"])
            series, label = substitute(m.group(1)), m.group(2)
            r = requests.get(f"{vm.base}/api/v1/label/{label}/values",
                             params={"match[]": series}, timeout=30)
            assert r.json()["data"], var["name"]


# -- the injected publisher: what the component gives the app containers ------------------------

COMPONENT = K8S / "components" / "gpu-sidecar"
APP_WORKLOADS = """\
apiVersion: apps/v1
kind: Deployment
metadata: {name: server}
spec:
  selector: {matchLabels: {app: server}}
  template:
    metadata: {labels: {app: server}}
    spec:
      containers:
        - name: server
          image: ghcr.io/example/vllm:1.0
          args: ["--model", "m"]
          env:
            - {name: HF_HOME, value: /models}
            - {name: PYTHONPATH, value: /app/lib:/app/plugins}
          resources: {limits: {nvidia.com/gpu: "2"}}
          volumeMounts:
            - {name: models, mountPath: /models}
        - name: tokenizer
          image: ghcr.io/example/tokenizer:1.0
      volumes:
        - {name: models, emptyDir: {}}
---
apiVersion: apps/v1
kind: StatefulSet
metadata: {name: shard}
spec:
  serviceName: shard
  selector: {matchLabels: {app: shard}}
  template:
    metadata: {labels: {app: shard}}
    spec:
      containers:
        - {name: shard, image: ghcr.io/example/shard:1.0}
---
apiVersion: batch/v1
kind: Job
metadata: {name: embed}
spec:
  template:
    spec:
      restartPolicy: Never
      containers:
        - {name: worker, image: ghcr.io/example/embed:1.0, command: ["python", "embed.py"]}
"""


def _render_with_component(tmp_path: Path, more: str = "") -> tuple[list[dict], list[dict]]:
    (tmp_path / "workloads.yaml").write_text(APP_WORKLOADS)
    component = os.path.relpath(COMPONENT, tmp_path)  # kustomize takes no absolute root
    (tmp_path / "kustomization.yaml").write_text(
        f"resources: [workloads.yaml]\ncomponents: [{component}]\n{more}")
    return [d for d in yaml.safe_load_all(APP_WORKLOADS) if d], render(tmp_path)


def _sidecar_env(doc: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in sidecar_of(doc)["env"]}


def test_the_component_gives_each_app_container_only_environment_and_a_read_only_mount(tmp_path):
    sources, docs = _render_with_component(tmp_path)
    assert validate(docs).returncode == 0, validate(docs).stdout
    # no Pod; the one ConfigMap is the agent's defaults
    assert sorted(d["kind"] for d in docs) == ["ConfigMap", "Deployment", "Job", "StatefulSet"]
    by_name = {d["metadata"]["name"]: d for d in docs}
    for source in sources:
        doc = by_name[source["metadata"]["name"]]
        sidecar = _sidecar_env(doc)
        inject_dir, sock = sidecar["GPU_SIDECAR_INJECT_DIR"], sidecar["GPU_SIDECAR_SOCKET"]
        assert os.path.dirname(inject_dir) == os.path.dirname(sock)  # in the socket volume
        before = source["spec"]["template"]["spec"]["containers"]
        after = doc["spec"]["template"]["spec"]["containers"]
        assert [c["name"] for c in after] == [c["name"] for c in before]
        for old, new in zip(before, after, strict=True):
            strip = ("env", "volumeMounts")
            assert {k: v for k, v in new.items() if k not in strip} == \
                {k: v for k, v in old.items() if k not in strip}, new["name"]
            env = {e["name"]: e["value"] for e in new["env"]}
            own = {e["name"]: e["value"] for e in old.get("env", [])}
            assert {k: v for k, v in env.items() if k not in ("PYTHONPATH", "GPU_SIDECAR_SOCKET")} \
                == {k: v for k, v in own.items() if k != "PYTHONPATH"}
            assert env["GPU_SIDECAR_SOCKET"] == sock
            # the container's own PYTHONPATH keeps its entries, after the placed directory;
            # where it had none, the directory alone: never an empty entry
            assert env["PYTHONPATH"] == (f"{inject_dir}:{own['PYTHONPATH']}"
                                         if "PYTHONPATH" in own else inject_dir)
            mounts = {m["name"]: m for m in new["volumeMounts"]}
            assert mounts["gpu-sidecar-run"] == {"name": "gpu-sidecar-run", "readOnly": True,
                                                 "mountPath": os.path.dirname(sock)}
            assert {k: v for k, v in mounts.items() if k != "gpu-sidecar-run"} == \
                {m["name"]: m for m in old.get("volumeMounts", [])}


def test_the_component_takes_the_agent_options_from_a_configmap_beside_it(tmp_path):
    """The README's way: the receiver (and any option) in a configMapGenerator next to the
    workloads; a key there wins over the component's default for it."""
    _, docs = _render_with_component(tmp_path, """\
configMapGenerator:
  - name: gpu-sidecar-config
    literals:
      - GPU_SIDECAR_REMOTE_WRITE_URL=http://vm.example.net:8428/api/v1/write
      - GPU_SIDECAR_NO_NVML=false
""")
    assert validate(docs).returncode == 0, validate(docs).stdout
    defaults = next(d for d in docs if d["metadata"]["name"].startswith("gpu-sidecar-defaults"))
    assert defaults["data"]["GPU_SIDECAR_NO_NVML"] == "true"
    for doc in workloads(docs):
        env = environment(sidecar_of(doc), docs)
        assert env["GPU_SIDECAR_REMOTE_WRITE_URL"] == "http://vm.example.net:8428/api/v1/write"
        assert env["GPU_SIDECAR_NO_NVML"] == "false"
        assert env["GPU_SIDECAR_LOG_FORMAT"] == defaults["data"]["GPU_SIDECAR_LOG_FORMAT"]


def _interpreters() -> list[str]:
    """Every CPython the machine offers the tests: this one, the system's and pyenv's."""
    found = {os.path.realpath(sys.executable): sys.executable}
    for pattern in ("/usr/bin/python3.*", "/usr/local/bin/python3.*",
                    str(Path.home() / ".pyenv" / "versions" / "*" / "bin" / "python3.*")):
        for path in sorted(Path("/").glob(pattern.lstrip("/"))):
            if re.fullmatch(r"python3\.\d+", path.name) and os.access(path, os.X_OK):
                found.setdefault(os.path.realpath(path), str(path))
    return sorted(found.values())


PATH_REPORT = """\
import json, os, sys
print(json.dumps({"path": sys.path, "version": list(sys.version_info[:2])}))
"""


def _start_in(cwd: Path, python: str, pythonpath: str, script: Path) -> tuple[int, str, str]:
    proc = subprocess.run([python, str(script)], capture_output=True, text=True, timeout=60,
                          cwd=cwd, env={"PATH": os.environ["PATH"], "PYTHONPATH": pythonpath})
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.parametrize("python", _interpreters())
def test_every_python_starts_with_the_component_s_pythonpath_in_a_deleted_working_directory(
        tmp_path, python):
    """An empty PYTHONPATH entry kills Python >= 3.11 started in a deleted working directory
    ("Fatal Python error: error evaluating path") and puts the working directory on sys.path
    elsewhere: each rendered value starts every Python, from a real deleted directory, and its
    sys.path holds neither '' nor the working directory."""
    (tmp_path / "k8s").mkdir()
    _, docs = _render_with_component(tmp_path / "k8s")
    values = {app["env"][i]["value"] for doc in workloads(docs) for app in apps_of(doc)
              for i, e in enumerate(app["env"]) if e["name"] == "PYTHONPATH"}
    assert len(values) == 2  # a container with its own PYTHONPATH, and one without
    script = tmp_path / "report" / "path_report.py"
    script.parent.mkdir()
    script.write_text(PATH_REPORT)
    for value in sorted(values):
        assert "" not in value.split(":"), value
        gone = tmp_path / "gone"
        gone.mkdir()
        code = ("import os, subprocess, sys\n"  # a child started from a directory deleted under it
                f"os.chdir({str(gone)!r}); os.rmdir({str(gone)!r})\n"
                "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
                "sys.stdout.write(p.stdout); sys.stderr.write(p.stderr); sys.exit(p.returncode)\n")
        proc = subprocess.run([sys.executable, "-c", code, python, str(script)],
                              capture_output=True, text=True, timeout=60,
                              env={"PATH": os.environ["PATH"], "PYTHONPATH": value})
        assert not gone.exists()
        assert proc.returncode == 0, f"{python} with PYTHONPATH={value}: {proc.stderr}"
        report = json.loads(proc.stdout)
        assert "" not in report["path"] and value.split(":")[0] in report["path"]
        # and in a working directory that exists: it is not on sys.path either
        here = tmp_path / "here"
        here.mkdir(exist_ok=True)
        rc, out, err = _start_in(here, python, value, script)
        assert rc == 0, err
        path = json.loads(out)["path"]
        assert "" not in path and str(here) not in path, path


def test_the_component_leaves_the_app_s_volumes_walked_once_not_at_every_start(tmp_path):
    """fsGroup re-owns every volume of the pod that supports it; OnRootMismatch walks one only
    when its top directory is not already so (docs/deployment.md)."""
    _, docs = _render_with_component(tmp_path)
    for doc in workloads(docs):
        context = doc["spec"]["template"]["spec"]["securityContext"]
        assert context == {"fsGroup": 65532, "fsGroupChangePolicy": "OnRootMismatch"}
    text = " ".join((ROOT / "docs" / "deployment.md").read_text().split())
    assert "`fsGroupChangePolicy: OnRootMismatch`" in text and "large model volume" in text
    assert "every volume of the pod, the app's too" in text  # said where a user reads it


@pytest.mark.parametrize("target", TARGETS)
def test_every_kustomization_gives_its_apps_the_injected_publisher_and_the_agent_none(target):
    docs = render(K8S / target)
    for doc in workloads(docs):
        sidecar = the_sidecar(doc)
        env = environment(sidecar, docs)
        assert "PYTHONPATH" not in env and "GPU_SIDECAR_INJECT" not in env
        (own,) = [m for m in sidecar["volumeMounts"] if m["name"] == "gpu-sidecar-run"]
        assert not own.get("readOnly")  # the agent writes there: socket and placed files
        apps = [c for c in doc["spec"]["template"]["spec"]["containers"]
                if c["name"] != "gpu-sidecar"]
        assert apps
        for app in apps:
            app_env = {e["name"]: e.get("value") for e in app["env"]}
            assert app_env["PYTHONPATH"].split(":")[0] == env["GPU_SIDECAR_INJECT_DIR"]
            assert app_env["GPU_SIDECAR_SOCKET"] == env["GPU_SIDECAR_SOCKET"]
            (mount,) = [m for m in app["volumeMounts"] if m["name"] == "gpu-sidecar-run"]
            assert mount["readOnly"] is True


def test_the_component_names_the_one_variable_to_set_for_each_engines_default_port():
    text = (ROOT / "k8s" / "components" / "gpu-sidecar" / "kustomization.yaml").read_text()
    for engine in ENGINES:
        line = f"GPU_SIDECAR_ENGINE_METRICS_URL={engine.default_url}"
        assert line in text, engine.name
        # and the agent takes the line as written
        variable, _, value = line.partition("=")
        assert config.build("run", config_args(), env={variable: value}).engine_metrics_url == \
            (engine.default_url,)


def config_args():
    import argparse

    parser = argparse.ArgumentParser()
    config.add_arguments(parser, "run")
    return parser.parse_args([])
