"""Defaults once: every default lives in ``Config`` (or the protocol constant it names), and
``--help`` is generated from it, so the help cannot show a value the agent does not use."""

from __future__ import annotations

import re
from dataclasses import fields
from urllib.parse import urlsplit

import pytest

from sidecar import protocol, urls
from sidecar.config import OPTION_BY_NAME, OPTIONS, Config
from sidecar.option_values import urls as receiver_urls
from tests.conftest import run_cli

DEFAULTS = {f.name: f.default for f in fields(Config)}


def _has_default(name: str) -> bool:
    """Options whose default is a value (not 'unset', 'off' or empty)."""
    return DEFAULTS[name] not in (None, False, "", ())


def _written(value: object) -> str:
    """How a default reads on the command line: 5, not 5.0."""
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _help_blocks(command: str) -> dict[str, str]:
    """Each option's --help entry, on one line (COLUMNS: no wrapping inside a value)."""
    proc = run_cli(command, "--help", env={"COLUMNS": "2000"})
    assert proc.returncode == 0, proc.stderr
    blocks: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in proc.stdout.splitlines():
        m = re.match(r"  (--[a-z0-9-]+)(?=\s|$)", line)
        if m:
            current = blocks.setdefault(m.group(1), [])
        elif line.startswith("  -") or not line.startswith(" "):
            current = None
        if current is not None:
            current.append(line.strip())
    return {flag: " ".join(lines) for flag, lines in blocks.items()}


@pytest.mark.parametrize("command", ["run", "probe", "diagnose"])
def test_every_help_line_shows_the_config_default_and_the_variable(command):
    blocks = _help_blocks(command)
    for opt in OPTIONS:
        if command not in opt.commands:
            assert opt.flag not in blocks
            continue
        text = blocks[opt.flag]
        assert text.endswith(f"[env {opt.env}]"), (opt.flag, text)
        if _has_default(opt.name):
            assert f"default {_written(DEFAULTS[opt.name])}" in text, (opt.flag, text)
        assert "{" not in text.replace("{run,diagnose,probe}", ""), (opt.flag, text)


def test_byte_sizes_are_shown_in_mib_too():
    blocks = _help_blocks("run")
    for name in ("spool_max_bytes", "spool_memory_max_bytes"):
        mib = DEFAULTS[name] / (1 << 20)
        assert f"default {DEFAULTS[name]} = {_written(mib)} MiB" in blocks[OPTION_BY_NAME[name].flag]


@pytest.mark.parametrize("opt", OPTIONS, ids=lambda o: o.name)
def test_no_help_text_writes_a_default_of_its_own(opt):
    """A value is in Config only: the help text has the placeholder, never the figure."""
    if _has_default(opt.name):
        assert "{default}" in opt.help, f"{opt.flag}: its help should say 'default {{default}}'"
    else:
        assert "{default}" not in opt.help and "{default_mib}" not in opt.help
    value = _written(DEFAULTS[opt.name])
    literal = re.search(rf"default:? {re.escape(value)}\b", opt.help) if _has_default(opt.name) \
        else None
    assert literal is None, f"{opt.flag} writes its default {value!r} a second time"
    assert not re.search(r"default:? \d", opt.help), f"{opt.flag} writes a number as its default"


def test_the_app_socket_defaults_are_the_protocol_s():
    """The client (which imports only the protocol) and the agent read one variable and one path."""
    assert OPTION_BY_NAME["socket"].env == protocol.SOCKET_ENV == "GPU_SIDECAR_SOCKET"
    assert DEFAULTS["socket"] == protocol.DEFAULT_SOCKET_PATH
    assert DEFAULTS["app_max_buckets"] == protocol.MAX_BUCKETS
    assert DEFAULTS["app_max_message_bytes"] == protocol.MAX_MESSAGE_BYTES
    assert all(o.env.startswith(protocol.ENV_PREFIX) for o in OPTIONS)


def test_a_url_s_default_port_is_the_same_for_the_sink_label_and_the_duplicate_check():
    assert urls.host_port("https://vm.example/api/v1/write") == "vm.example:443"
    assert urls.host_port("http://vm.example/api/v1/write") == "vm.example:80"
    assert urls.effective_port(urlsplit("http://vm.example:8428/")) == 8428
    for scheme, port in urls.DEFAULT_PORTS.items():
        with pytest.raises(ValueError, match="names the receiver of URL 1 again"):
            receiver_urls(f"{scheme}://vm.example/api/v1/write,{scheme}://VM.example:{port}/api/v1/write")
    assert receiver_urls("http://vm.example:443/w,https://vm.example/w")  # two receivers
