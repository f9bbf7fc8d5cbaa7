"""Defaults once (issue #22): a constructor that has a default for something the command line
configures takes it from ``Config``, so the value the agent runs with, the one a caller that
omits the argument gets, and the one ``--help`` shows cannot drift apart."""

from __future__ import annotations

import ast
import inspect
import re

import pytest

from sidecar import config, urls
from sidecar.config import RETRY_AFTER_CAP_S, Config
from sidecar.simulate.app import SimulatedApp
from sidecar.sinks import IDLE_WAIT_S, answers, pushgateway, spooled
from sidecar.sinks.http import Http
from sidecar.sinks.pushgateway import PushgatewaySink
from sidecar.sinks.remote_write import RemoteWriteSink
from sidecar.sinks.spooled import SpooledSink
from sidecar.sources.app_socket import AppState
from sidecar.sources.nvml.source import NvmlSource
from tests.conftest import ROOT

# (constructor, its parameter, the Config field it defaults to)
DEFAULTED = [
    (SpooledSink, "push_interval_s", "push_interval"),
    (SpooledSink, "max_batch_samples", "batch_max_samples"),
    (RemoteWriteSink, "push_interval_s", "push_interval"),
    (RemoteWriteSink, "max_batch_samples", "batch_max_samples"),
    (PushgatewaySink, "push_interval_s", "push_interval"),
    (PushgatewaySink, "job", "pushgateway_job"),
    (AppState, "stale_after_s", "app_stale_after"),
    (AppState, "max_processes", "app_max_processes"),
    (AppState, "max_gpus", "app_max_gpus"),
    (AppState, "max_buckets", "app_max_buckets"),
    (AppState, "max_message_bytes", "app_max_message_bytes"),
    (NvmlSource, "lost_retry_s", "gpu_retry_interval"),
    (NvmlSource, "interval_s", "interval"),
    (SimulatedApp, "interval_s", "interval"),
]


@pytest.mark.parametrize(("cls", "param", "field"), DEFAULTED,
                         ids=[f"{c.__name__}.{p}" for c, p, _ in DEFAULTED])
def test_a_constructor_default_is_the_config_s(cls, param, field):
    default = inspect.signature(cls).parameters[param].default
    assert default is not inspect.Parameter.empty, f"{cls.__name__}({param}=...) lost its default"
    assert default == getattr(Config, field) == config.DEFAULTS[field], (
        f"{cls.__name__}({param}={default!r}) differs from Config.{field}")
    assert type(default) is type(getattr(Config, field))


# what the command line says about reaching the receivers: read off the Config by the HTTP layer
RECEIVER_OPTIONS = ("push_timeout", "retry_max_backoff", "bearer_token_file", "basic_auth_user",
                    "basic_auth_password_file", "ca_file", "cert_file", "key_file",
                    "insecure_skip_verify", "header")


def test_the_http_layer_declares_none_of_config_s_receiver_options():
    """No copy of the receivers' options with defaults of its own (issue #45): ``Http`` takes
    the ``Config`` itself; its own parameters are only a client's timeout (``None``:
    --push-timeout) and answer bound, and the sinks take none of those options either."""
    assert set(RECEIVER_OPTIONS) <= set(Config.__dataclass_fields__)
    params = inspect.signature(Http).parameters
    assert list(params) == ["cfg", "timeout_s", "max_answer_bytes"]
    assert params["timeout_s"].default is None
    cfg = Config(push_timeout=3.5, header=(("X-Scope-OrgID", "t1"),))
    client = Http(cfg)
    assert client.cfg is cfg and client.timeout_s == 3.5
    assert client.headers()["X-Scope-OrgID"] == "t1"
    copied = {"timeout_s", "max_backoff_s", "headers", *RECEIVER_OPTIONS}
    tree = ast.parse((ROOT / "sidecar" / "sinks" / "http.py").read_text())
    fields = {f"{node.name}.{item.target.id}" for node in ast.walk(tree)
              if isinstance(node, ast.ClassDef) for item in node.body
              if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
              and item.target.id in copied}
    assert fields == set(), "http.py declares receiver options again"
    for cls in (SpooledSink, RemoteWriteSink, PushgatewaySink):
        assert not copied & set(inspect.signature(cls).parameters), cls.__name__


def test_the_retry_after_cap_is_one_constant_the_help_shows():
    assert answers.Policy.__dataclass_fields__["retry_after_cap_s"].default == RETRY_AFTER_CAP_S
    assert answers.REMOTE_WRITE.retry_after_cap_s == answers.OTLP.retry_after_cap_s == RETRY_AFTER_CAP_S
    text = config.help_text(config.OPTION_BY_NAME["retry_max_backoff"])
    assert f"honoured up to {config.shown_default(RETRY_AFTER_CAP_S)}." in text, text


def test_the_sinks_share_one_idle_wait():
    assert spooled.IDLE_WAIT_S is pushgateway.IDLE_WAIT_S is IDLE_WAIT_S
    for path in (ROOT / "sidecar" / "sinks").glob("*.py"):
        if path.name != "__init__.py":
            assert not re.search(r"^IDLE_WAIT_S\s*=", path.read_text(), re.M), path.name


def test_the_default_ports_are_written_only_in_urls():
    """443 and 80 live in ``sidecar.urls.DEFAULT_PORTS``; the sender asks ``effective_port``."""
    assert urls.DEFAULT_PORTS == {"http": 80, "https": 443}
    hits = [f"{p.relative_to(ROOT)}:{n}" for p in (ROOT / "sidecar").rglob("*.py")
            if p.name != "urls.py"
            for n, line in enumerate(p.read_text().splitlines(), 1)
            if re.search(r"\b443\b|\belse 80\b", line)]
    assert hits == []
