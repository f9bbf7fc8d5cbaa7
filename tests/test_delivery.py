"""HTTP delivery rules: retry or not, Retry-After, credentials from files, nothing secret logged."""

from __future__ import annotations

import base64
import email.utils
import http.server
import os
import signal
import subprocess
import sys
import threading
import time
from typing import ClassVar

import pytest
import requests

from sidecar.sinks.delivery import (
    DATA_REFUSALS,
    Http,
    HttpOptions,
    Refused,
    Response,
    Retryable,
    check,
    parse_retry_after,
    redact,
)
from tests.conftest import ROOT, run_cli
from tests.receivers import FaultProxy


def response(status: int, text: str = "", headers: dict | None = None) -> Response:
    return Response(status, requests.structures.CaseInsensitiveDict(headers or {}), text.encode(),
                    "http://127.0.0.1:9/api/v1/write")


@pytest.mark.parametrize(("status", "kind", "reason"), [
    (500, Retryable, "http_5xx"), (503, Retryable, "http_5xx"), (429, Retryable, "http_429"),
    (400, Refused, None), (401, Refused, None), (404, Refused, None), (413, Refused, None),
    (422, Refused, None), (403, Refused, None),
])
def test_which_answers_are_retried(status, kind, reason):
    with pytest.raises(kind) as err:
        check(response(status, "receiver text"))
    assert "receiver text" in str(err.value)
    if reason:
        assert err.value.reason == reason
    # of the refusals, only answers about the data set a batch aside (and split a merged
    # request); a wrong URL or credentials keep the spool and retry (SpooledSink)
    assert (status in DATA_REFUSALS) == (status in (400, 413, 422))
    check(response(204))
    check(response(200))


def test_404_explains_the_remote_write_receiver_flag():
    with pytest.raises(Refused) as err:
        check(response(404, "404 page not found"))
    assert "--web.enable-remote-write-receiver" in err.value.hint


def test_retry_after_in_seconds_or_as_a_date():
    assert parse_retry_after("7") == 7.0
    future = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert 25 < parse_retry_after(future) <= 30
    assert parse_retry_after("soon") is None and parse_retry_after(None) is None
    with pytest.raises(Retryable) as err:
        check(response(429, headers={"Retry-After": "3"}))
    assert err.value.retry_after == 3.0


def test_urls_are_logged_without_credentials():
    assert redact("https://alice:s3cret@vm.example:8428/api/v1/write") == \
        "https://vm.example:8428/api/v1/write"
    assert redact("http://vm:8428/api/v1/write") == "http://vm:8428/api/v1/write"


class Recorder(http.server.BaseHTTPRequestHandler):
    seen: ClassVar[list[dict]] = []

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        Recorder.seen.append(dict(self.headers))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


class KeepAlive(http.server.BaseHTTPRequestHandler):
    """HTTP/1.1 with kept-alive connections; closes one silently after its first answer when
    told, as a receiver closes idle connections."""

    protocol_version = "HTTP/1.1"
    seen: ClassVar[list[tuple[int, dict]]] = []
    close_after_first: ClassVar[bool] = False

    def do_POST(self) -> None:
        close = KeepAlive.close_after_first  # read before answering: the test changes it after
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        KeepAlive.seen.append((self.client_address[1], dict(self.headers)))
        self.send_response(204)
        self.send_header("Content-Length", "0")
        self.end_headers()
        if close:
            self.close_connection = True  # no "Connection: close": the client cannot know

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def keep_alive_server():
    KeepAlive.seen.clear()
    KeepAlive.close_after_first = False
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), KeepAlive)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_one_connection_is_kept_and_one_the_receiver_closed_is_replaced(keep_alive_server):
    client = Http(HttpOptions())
    url = f"http://{keep_alive_server}/api/v1/write"
    for _ in range(3):
        assert client.request("POST", url, data=b"x").status_code == 204
    assert len({port for port, _ in KeepAlive.seen}) == 1  # kept alive
    KeepAlive.close_after_first = True  # from now on the receiver closes after each answer
    for _ in range(3):  # the kept connection, then a new one each time: never an error
        assert client.request("POST", url, data=b"x").status_code == 204
        time.sleep(0.05)
    assert len({port for port, _ in KeepAlive.seen}) == 3, [p for p, _ in KeepAlive.seen]


def test_credentials_in_the_url_become_basic_auth_and_the_options_win(keep_alive_server, tmp_path):
    url = f"http://bob:s%40cret@{keep_alive_server}/api/v1/write"
    Http(HttpOptions()).request("POST", url, data=b"x")
    password = tmp_path / "password"
    password.write_text("pw\n")
    Http(HttpOptions(basic_auth_user="alice", basic_auth_password_file=str(password))).request(
        "POST", url, data=b"x")
    sent = [headers["Authorization"] for _, headers in KeepAlive.seen]
    assert sent == [f"Basic {base64.b64encode(b'bob:s@cret').decode()}",
                    f"Basic {base64.b64encode(b'alice:pw').decode()}"]
    assert all(headers["Host"] == keep_alive_server for _, headers in KeepAlive.seen)


def test_a_token_http_cannot_carry_is_a_credentials_failure_that_never_quotes_it(
        keep_alive_server, tmp_path):
    token = tmp_path / "token"
    token.write_text("sekrit-token\nsecond line\n")  # a file pasted with more than the token
    client = Http(HttpOptions(bearer_token_file=str(token)))
    with pytest.raises(Retryable) as err:
        client.request("POST", f"http://{keep_alive_server}/api/v1/write", data=b"x")
    assert err.value.reason == "credentials" and "sekrit" not in str(err.value)
    assert err.value.__context__ is None and err.value.__cause__ is None
    assert KeepAlive.seen == []


def test_rotated_bearer_token_is_picked_up_without_restart(tmp_path):
    token = tmp_path / "token"
    token.write_text("first-token\n")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/api/v1/write"
        client = Http(HttpOptions(bearer_token_file=str(token), headers=(("X-Scope-OrgID", "t1"),)))
        client.request("POST", url, data=b"x")
        token.write_text("second-token-longer\n")  # the kubelet swapped the Secret
        client.request("POST", url, data=b"x")
    finally:
        server.shutdown()
        server.server_close()
    assert [h["Authorization"] for h in Recorder.seen[-2:]] == [
        "Bearer first-token", "Bearer second-token-longer"]
    assert Recorder.seen[-1]["X-Scope-OrgID"] == "t1"
    assert Recorder.seen[-1]["User-Agent"].startswith("gpu-sidecar/")


def test_secrets_never_appear_in_logs_errors_or_help(tmp_path):
    token = tmp_path / "token"
    token.write_text("tok-9f8e7d6c5b4a")
    password = tmp_path / "password"
    password.write_text("pw-1a2b3c4d")
    proxy = FaultProxy("http://127.0.0.1:9/", lambda n, body: (401, {}, b"who are you?"))
    try:
        for auth in (["--bearer-token-file", str(token)],
                     ["--basic-auth-user", "alice", "--basic-auth-password-file", str(password)]):
            url = proxy.url.replace("http://", "http://bob:url-secret@")
            text = _run_briefly(url, tmp_path, auth)
            # a 401 keeps the spool and is logged once, with what to fix
            assert text.count("push_refused") == 1 and "authentication failed" in text
            for secret in ("tok-9f8e7d6c5b4a", "pw-1a2b3c4d", "url-secret", "hdr-secret-77"):
                assert secret not in text
    finally:
        proxy.stop()
    help_text = run_cli("run", "--help").stdout
    assert "tok-9f8e7d6c5b4a" not in help_text


def _run_briefly(url: str, tmp_path, auth: list[str]) -> str:
    """All output (stdout and stderr) of a two-second run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_SIDECAR_")}
    env["GPU_SIDECAR_HEADER"] = "X-Api-Key=hdr-secret-77"
    proc = subprocess.Popen(
        [sys.executable, "-m", "sidecar", "run", "--simulate", "healthy", "--interval", "0.2",
         "--push-interval", "0.2", "--remote-write-url", url, "--spool-dir",
         str(tmp_path / "spool"), "--shutdown-timeout", "1", "--stdout", *auth],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env)
    timer = threading.Timer(2.0, proc.send_signal, args=(signal.SIGTERM,))
    timer.start()
    out, _ = proc.communicate(timeout=30)
    timer.cancel()
    assert proc.returncode == 0, out[-2000:]
    return out
