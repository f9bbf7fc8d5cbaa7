"""No configured secret shows anywhere (issue #11): configuration errors, --help, the start-up line
and every log line at debug level.

Secrets are random and go where users put them: URL user-info (percent-encoded, as a URL holds
them, and unencoded, as users paste them), header values, secret files, the environment, and
pasted where a file path belongs. Each check looks for the raw and the encoded form and for any
six characters of the raw one, so that a half-masked secret fails too.
"""

from __future__ import annotations

import json
import socket
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, urlsplit

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar import cli
from sidecar.config import Config, ConfigError, build, describe
from tests.conftest import ROOT, run_cli
from tests.receivers import Agent, running
from tests.waiting import until

WINDOW = 6  # this many characters of a secret in a row count as a leak
URL = "http://vm.example:8428/api/v1/write"

# what a password or token holds: letters, digits and the punctuation a URL needs percent-encoded
# ('%' included). Not ',' (it separates list items) and not whitespace (values are stripped).
SECRET_ALPHABET = string.ascii_letters + string.digits + "-._~!$&'()*+;=:@/?#[]%^"


def windows(text: str) -> set[str]:
    return {text[i:i + WINDOW] for i in range(len(text) - WINDOW + 1)}


# Six characters in a row of the agent's own text (its names, defaults and messages, all in its
# source) or of this module's fixed inputs (URLs, header names), made only of the secrets'
# alphabet. A secret holding one of them could not be told from the text around it, and
# Hypothesis draws such strings on purpose (it mixes in constants of the code under test: a
# "secret" '00namesp' was "leaked" by the key pod_namespace): they are never drawn.
OWN_TEXT = frozenset(
    w for path in [*(ROOT / "sidecar").rglob("*.py"), Path(__file__)]
    for w in windows(path.read_text()) if not w.strip(SECRET_ALPHABET))
SECRETS = st.text(SECRET_ALPHABET, min_size=8, max_size=40).filter(
    lambda s: any(c.isalpha() for c in s) and any(c.isdigit() for c in s)
    and windows(s).isdisjoint(OWN_TEXT))


def leaks(secret: str, text: str) -> list[str]:
    """The forms of ``secret`` found in ``text``: whole (raw or percent-encoded) or in part."""
    forms = {secret, quote(secret, safe="")}
    forms |= windows(secret)
    return sorted(f for f in forms if f in text)


def enc(secret: str) -> str:
    return quote(secret, safe="")


@dataclass(frozen=True)
class Case:
    """A refused configuration: flags and environment made from the secret and a directory of
    secret files; ``says`` is what the error must name so that the user can fix it."""

    name: str
    says: str
    argv: Callable[[str, Path], list[str]]
    env: Callable[[str, Path], dict[str, str]] = field(default=lambda s, d: {})


def secret_files(secret: str, directory: Path) -> Path:
    """token, password and key files holding ``secret``; a CA and a certificate without."""
    for name in ("token", "password", "key.pem"):
        (directory / name).write_text(secret + "\n")
    for name in ("ca.pem", "cert.pem"):
        (directory / name).write_text("-----BEGIN CERTIFICATE-----\n")
    return directory


def with_secrets(s: str, d: Path) -> list[str]:
    """A valid receiver URL and header, both carrying the secret."""
    return ["--remote-write-url", f"http://alice:{enc(s)}@vm.example:8428/api/v1/write",
            "--header", f"X-Api-Key={s}"]


def rw(url: str) -> Callable[[str, Path], list[str]]:
    """--remote-write-url with ``url`` formatted with the encoded secret {e} or the raw one {s}."""
    return lambda s, d: ["--remote-write-url", url.format(e=enc(s), s=s)]


CASES = [
    # URLs with credentials, broken in every way a URL breaks
    Case("bad scheme", "does not start with http:// or https://",
         rw("ftp://alice:{e}@vm.example:8428/api/v1/write")),
    Case("bad scheme, password not encoded", "--remote-write-url",
         rw("ftp://alice:{s}@vm.example/api")),
    Case("bad scheme, token as user", "http://", rw("ftp://{e}@vm.example/api/v1/write")),
    Case("no scheme", "http://", rw("alice:{e}@vm.example:8428/api/v1/write")),
    Case("port not a number", "port", rw("http://alice:{e}@vm.example:84x28/api/v1/write")),
    Case("port out of range", "port", rw("http://alice:{e}@vm.example:99999/api/v1/write")),
    Case("port zero", "port 0", rw("http://alice:{e}@vm.example:0/api/v1/write")),
    Case("space in host", "host", rw("http://alice:{e}@vm example:8428/api/v1/write")),
    Case("no host", "no host", rw("http://alice:{e}@/api/v1/write")),
    Case("bracketed host not an IP", "cannot be read as a URL",
         rw("http://alice:{e}@[vm.example]:8428/api/v1/write")),
    Case("token in the query", "http://", rw("ftp://vm.example/api/v1/write?X-License-Key={e}")),
    Case("second URL of two broken", "URL 2 of 2",
         lambda s, d: ["--remote-write-url", URL, "--remote-write-url", f"ftp://a:{enc(s)}@vm2/"]),
    Case("same receiver twice", "the same receiver",
         lambda s, d: ["--remote-write-url", f"http://alice:{enc(s)}@vm.example:80/api/v1/write",
                       "--remote-write-url", "http://VM.example/api/v1/write"]),
    Case("same receiver twice, from the environment", "GPU_SIDECAR_REMOTE_WRITE_URL",
         lambda s, d: [], lambda s, d: {"GPU_SIDECAR_REMOTE_WRITE_URL":
                                        f"http://a:{enc(s)}@vm.example/w,http://b:{enc(s)}@vm.example/w"}),
    Case("broken URL from the environment", "GPU_SIDECAR_REMOTE_WRITE_URL",
         lambda s, d: [], lambda s, d: {"GPU_SIDECAR_REMOTE_WRITE_URL":
                                        f"http://alice:{enc(s)}@vm.example:84x28/api/v1/write"}),
    Case("broken Pushgateway URL", "--pushgateway-url",
         lambda s, d: ["--pushgateway-url", f"pgw://alice:{enc(s)}@pgw:9091"]),
    Case("broken Pushgateway URL from the environment", "GPU_SIDECAR_PUSHGATEWAY_URL",
         lambda s, d: [], lambda s, d: {"GPU_SIDECAR_PUSHGATEWAY_URL": f"http://alice:{enc(s)}@pgw:x"}),
    # headers: the value is the secret
    Case("header written NAME: VALUE", "--header", lambda s, d: ["--header", f"X-Api-Key: {s}"]),
    Case("header NAME: VALUE with '=' in the value", "--header",
         lambda s, d: ["--header", f"Authorization: Bearer {s}="]),
    Case("good header, then a broken item", "item 2",
         lambda s, d: ["--header", f"X-Api-Key={s}", "--header", "broken"]),
    Case("broken header from the environment", "GPU_SIDECAR_HEADER",
         lambda s, d: [], lambda s, d: {"GPU_SIDECAR_HEADER": f"Authorization: Bearer {s}"}),
    Case("good header, another option broken", "--interval",
         lambda s, d: ["--header", f"X-Api-Key={s}", "--interval", "0"]),
    Case("good header in the environment, URL broken", "http://",
         rw("ftp://vm.example/api/v1/write"), lambda s, d: {"GPU_SIDECAR_HEADER": f"X-Api-Key={s}"}),
    Case("broken extra label", "--extra-label", lambda s, d: ["--extra-label", f"cluster: {s}"]),
    Case("reserved extra label", "may not set job", lambda s, d: ["--extra-label", f"job={s}"]),
    # a secret where its file belongs, or a password in the user name
    Case("token pasted as the token file", "not the secret itself",
         lambda s, d: ["--bearer-token-file", f"k{s}"]),
    Case("password pasted as the password file", "not the secret itself",
         lambda s, d: ["--basic-auth-user", "alice", "--basic-auth-password-file", f"k{s}"]),
    Case("key pasted as the key file", "not the secret itself",
         lambda s, d: ["--cert-file", str(d / "cert.pem"), "--key-file", f"k{s}"]),
    Case("token pasted in the environment", "GPU_SIDECAR_BEARER_TOKEN_FILE",
         lambda s, d: [], lambda s, d: {"GPU_SIDECAR_BEARER_TOKEN_FILE": f"k{s}"}),
    Case("user:password as the user", "--basic-auth-password-file",
         lambda s, d: ["--basic-auth-user", f"alice:{s}"]),
    # options that contradict each other, every secret configured and valid
    Case("bearer token and basic auth", "not both",
         lambda s, d: [*with_secrets(s, d), "--bearer-token-file", str(d / "token"),
                       "--basic-auth-user", "alice", "--basic-auth-password-file", str(d / "password")]),
    Case("password without user", "needs --basic-auth-user",
         lambda s, d: [*with_secrets(s, d), "--basic-auth-password-file", str(d / "password")]),
    Case("key without certificate", "needs --cert-file",
         lambda s, d: [*with_secrets(s, d), "--key-file", str(d / "key.pem")]),
    Case("CA and skip-verify", "contradict",
         lambda s, d: [*with_secrets(s, d), "--ca-file", str(d / "ca.pem"), "--insecure-skip-verify"]),
    Case("--once with receivers", "--once", lambda s, d: ["--once", *with_secrets(s, d)]),
    Case("delete-on-exit without Pushgateway", "--pushgateway-delete-on-exit",
         lambda s, d: ["--pushgateway-delete-on-exit", *with_secrets(s, d)]),
    Case("misspelt header variable", "GPU_SIDECAR_HEADERS",
         lambda s, d: [], lambda s, d: {"GPU_SIDECAR_HEADERS": f"X-Api-Key={s}"}),
    Case("misspelt URL variable", "GPU_SIDECAR_REMOTE_WRITE",
         lambda s, d: [], lambda s, d: {"GPU_SIDECAR_REMOTE_WRITE": f"http://a:{enc(s)}@vm/w"}),
]


def refusal(argv: list[str], env: dict[str, str]) -> str:
    """The ConfigError of ``gpu-sidecar run ARGV`` with ``env`` as the environment."""
    args = cli._parser().parse_args(["run", *argv])
    with pytest.raises(ConfigError) as err:
        build("run", args, env)
    return str(err.value)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("secrets")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@settings(max_examples=25, deadline=None)
@given(secret=SECRETS)
def test_a_refused_configuration_names_the_problem_but_never_a_secret(case: Case, secret: str,
                                                                       files: Path) -> None:
    d = secret_files(secret, files)
    message = refusal(case.argv(secret, d), case.env(secret, d))
    assert case.says in message
    assert not leaks(secret, message), message


@settings(max_examples=200, deadline=None)
@given(secret=SECRETS)
def test_an_unencoded_password_is_refused_unseen_or_taken_whole(secret: str) -> None:
    """'/', '?', '#', '@' or '[' unencoded move part of a password into host, port or path, where
    a half-parsed URL would later be logged. Either the URL is refused without showing it, or the
    password is exactly the secret and the start-up line hides it."""
    url = f"http://alice:{secret}@vm.example:8428/api/v1/write"
    args = cli._parser().parse_args(["run", "--remote-write-url", url])
    try:
        config = build("run", args, {})
    except ConfigError as exc:
        assert not leaks(secret, str(exc)), str(exc)
        return
    assert urlsplit(url).password == secret
    shown = json.dumps(describe(config), default=str)
    assert not leaks(secret, shown), shown


@settings(max_examples=50, deadline=None)
@given(secret=SECRETS, user=st.sampled_from(["alice", "t0ken"]))
def test_the_start_up_description_of_a_valid_configuration_shows_no_secret(
        secret: str, user: str, files: Path) -> None:
    d = secret_files(secret, files)
    argv = ["--remote-write-url", f"http://{user}:{enc(secret)}@vm.example:8428/api/v1/write",
            "--remote-write-url", f"https://{enc(secret)}@mimir.example/api/v1/push",
            "--pushgateway-url", f"http://bob:{enc(secret)}@pgw.example:9091",
            "--header", f"X-Api-Key={secret}", "--header", f"X-Scope-OrgID=t-{secret}",
            "--basic-auth-user", "alice", "--basic-auth-password-file", str(d / "password"),
            "--cert-file", str(d / "cert.pem"), "--key-file", str(d / "key.pem")]
    config: Config = build("run", cli._parser().parse_args(["run", *argv]), {})
    shown = json.dumps(describe(config), default=str)
    assert "vm.example:8428" in shown and "X-Scope-OrgID" in shown
    assert not leaks(secret, shown), shown


# --- as a user runs it: subprocesses, a few examples each ------------------------------------

TERMINAL_CASES = [c for c in CASES if c.name in (
    "bad scheme", "broken URL from the environment", "same receiver twice, from the environment",
    "broken header from the environment", "good header in the environment, URL broken",
    "token pasted in the environment", "misspelt header variable")]


@pytest.mark.parametrize("case", TERMINAL_CASES, ids=lambda c: c.name)
@settings(max_examples=2, deadline=None)
@given(secret=SECRETS)
def test_a_refused_start_shows_no_secret_on_stdout_or_stderr_at_debug_level(
        case: Case, secret: str, files: Path) -> None:
    d = secret_files(secret, files)
    proc = run_cli("run", "--log-level", "debug", "--log-format", "json", *case.argv(secret, d),
                   env=case.env(secret, d))
    assert proc.returncode == 2, proc.stderr
    assert "configuration error" in proc.stderr and case.says in proc.stderr
    assert not leaks(secret, proc.stdout + proc.stderr), proc.stderr


def test_a_misspelt_flag_is_refused_without_quoting_its_value() -> None:
    secret = "hdr-S3cr3t-5150"
    for argv in (["--heder", f"X-Api-Key={secret}"], [f"--push={secret}"]):
        proc = run_cli("run", *argv)
        assert proc.returncode == 2
        assert not leaks(secret, proc.stdout + proc.stderr), proc.stderr


def closed_port() -> int:
    """A 127.0.0.1 port nothing listens on: every push is refused at connect."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("auth", ["bearer", "basic"])
def test_help_the_start_up_line_and_every_log_line_show_no_secret(auth: str, tmp_path: Path) -> None:
    """Extends tests/test_delivery.py's 401 run: debug level, JSON logs, a receiver that refuses
    connections, a Pushgateway too, a second header, secrets that need percent-encoding."""
    secrets = {"url": "u/Rl:9xQ#w@7k", "pgw": "pG?8vT&z2m", "hdr": "hD-4qK7wZ1",
               "tenant": "tN-6yB3jX8", "file": "fL-2cV9nM5"}
    for name in ("token", "password"):
        (tmp_path / name).write_text(secrets["file"] + "\n")
    creds = (["--bearer-token-file", str(tmp_path / "token")] if auth == "bearer" else
             ["--basic-auth-user", "alice", "--basic-auth-password-file", str(tmp_path / "password")])
    port = closed_port()
    agent = Agent(["--simulate", "healthy", "--interval", "0.2", "--push-interval", "0.2",
                   "--log-level", "debug", "--spool-dir", str(tmp_path / "spool"),
                   "--shutdown-timeout", "1", *creds,
                   "--remote-write-url",
                   f"http://alice:{enc(secrets['url'])}@127.0.0.1:{port}/api/v1/write",
                   "--pushgateway-url", f"http://bob:{enc(secrets['pgw'])}@127.0.0.1:{port}",
                   "--header", f"X-Api-Key={secrets['hdr']}",
                   "--header", f"X-Scope-OrgID={secrets['tenant']}"])
    with running(agent):
        agent.start()
        # both sinks' error paths ran (each logs its URL, redacted), and the agent went on
        until(lambda: (agent.logged("push_failing") and agent.logged("pushgateway_failing"))
              or agent.proc.poll() is not None,
              what="push_failing and pushgateway_failing logged")
        agent.more_cycles(2, "after both sinks failed")
        assert agent.stop() == 0, "".join(agent.err)[-2000:]
    events = agent.events()
    starting = next(e for e in events if e["event"] == "starting")
    assert starting["config"]["header"] == ["X-Api-Key", "X-Scope-OrgID"]
    assert any(e["event"].endswith("_failing") for e in events)  # the error paths did run
    help_text = run_cli("run", "--help", env={
        "GPU_SIDECAR_HEADER": f"X-Api-Key={secrets['hdr']}",
        "GPU_SIDECAR_REMOTE_WRITE_URL": f"http://a:{enc(secrets['url'])}@vm/w"}).stdout
    output = "".join(agent.out) + "".join(agent.err) + help_text
    for secret in secrets.values():
        assert not leaks(secret, output), (secret, leaks(secret, output))
