"""HTTP delivery rules: retry or not, Retry-After, credentials from files, nothing secret logged."""

from __future__ import annotations

import base64
import email.utils
import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import ClassVar

import pytest
import requests
import tenacity

from sidecar.config import Config
from sidecar.sinks.answers import (
    OTLP,
    REMOTE_WRITE,
    Held,
    Refused,
    Response,
    Retryable,
    parse_retry_after,
)
from sidecar.sinks.http import Http
from sidecar.urls import redact_url as redact
from tests.conftest import ROOT, run_cli
from tests.receivers import FaultProxy
from tests.waiting import until


def response(status: int, text: str = "", headers: dict | None = None) -> Response:
    return Response(status, requests.structures.CaseInsensitiveDict(headers or {}), text.encode(),
                    "http://127.0.0.1:9/api/v1/write")


check = REMOTE_WRITE.check


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
    if kind is Refused:
        assert err.value.about_data == (status in (400, 413, 422))
    assert REMOTE_WRITE.data_refusals == OTLP.data_refusals == {400, 413, 422}
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
    client = Http(Config())
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
    Http(Config()).request("POST", url, data=b"x")
    password = tmp_path / "password"
    password.write_text("pw\n")
    Http(Config(basic_auth_user="alice", basic_auth_password_file=str(password))).request(
        "POST", url, data=b"x")
    sent = [headers["Authorization"] for _, headers in KeepAlive.seen]
    assert sent == [f"Basic {base64.b64encode(b'bob:s@cret').decode()}",
                    f"Basic {base64.b64encode(b'alice:pw').decode()}"]
    assert all(headers["Host"] == keep_alive_server for _, headers in KeepAlive.seen)


def test_a_token_http_cannot_carry_is_a_credentials_failure_that_never_quotes_it(
        keep_alive_server, tmp_path):
    token = tmp_path / "token"
    token.write_text("sekrit-token\nsecond line\n")  # a file pasted with more than the token
    client = Http(Config(bearer_token_file=str(token)))
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
        client = Http(Config(bearer_token_file=str(token), header=(("X-Scope-OrgID", "t1"),)))
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


# -- what the policy waits ----------------------------------------------------------------------


def _waited(policy, exc: BaseException, attempt: int, *, initial: float = 0.5, maximum: float = 30.0,
            closing: bool = False) -> float:
    state = tenacity.RetryCallState(retry_object=None, fn=None, args=(), kwargs={})
    state.attempt_number = attempt
    state.set_exception((type(exc), exc, None))
    return policy.wait(initial_s=initial, max_s=maximum, closing=lambda: closing)(state)


@pytest.mark.parametrize("policy", [REMOTE_WRITE, OTLP], ids=["remote_write", "otlp"])
def test_backoff_has_full_jitter_above_a_floor_and_retry_after_lengthens_it_capped(policy):
    network = Retryable("network", "down")
    waits = [_waited(policy, network, attempt) for attempt in range(1, 12) for _ in range(20)]
    assert min(waits) >= 0.5 and max(waits) <= 30.0  # the floor, the longest backoff
    late = [_waited(policy, network, 10) for _ in range(200)]
    assert max(late) - min(late) > 10  # full jitter: anywhere from the floor to the cap
    first = [_waited(policy, network, 1) for _ in range(200)]
    assert min(first) >= 0.5 and max(first) <= 1.0  # jittered from the first retry on...
    assert len({round(w, 3) for w in first}) > 150, "first retries in step"  # ...not clipped
    # Retry-After lengthens the wait, past the longest backoff, up to its own cap...
    assert _waited(policy, Retryable("http_429", "slow", retry_after=120.0), 1) == 120.0
    assert _waited(policy, Retryable("http_429", "slow", retry_after=86_400.0), 1) == \
        policy.retry_after_cap_s == 300.0
    # ...and never shortens it
    assert _waited(policy, Retryable("http_5xx", "busy", retry_after=0.0), 1) >= 0.5
    assert min(_waited(policy, Retryable("http_429", "x", retry_after=1.0), 8, maximum=60.0)
               for _ in range(50)) >= 1.0
    # a refusal that is not about the data waits the longest; closing cuts every wait short
    held = Held(Refused(401, "HTTP 401", "token", about_data=False))
    assert _waited(policy, held, 1) == 30.0
    assert _waited(policy, Retryable("http_429", "x", retry_after=86_400.0), 1, closing=True) == 0.25
    assert _waited(policy, held, 1, closing=True) == 0.25


# -- the wire ---------------------------------------------------------------------------------


class Counting(http.server.BaseHTTPRequestHandler):
    """A receiver that counts what reaches it and answers 204."""

    protocol_version = "HTTP/1.1"
    seen: ClassVar[list[tuple[str, str]]] = []

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        Counting.seen.append((self.command, self.path))
        self.send_response(204)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_POST

    def log_message(self, *args: object) -> None:
        pass


def _serve(handler: type) -> http.server.ThreadingHTTPServer:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_a_308_redirect_is_never_followed(tmp_path):
    Counting.seen.clear()
    elsewhere = _serve(Counting)
    target = f"http://127.0.0.1:{elsewhere.server_address[1]}/api/v1/write?key=moved-secret"

    class Redirecting(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(308)
            self.send_header("Location", target)
            self.send_header("Content-Length", "5")
            self.end_headers()
            self.wfile.write(b"moved")

        def log_message(self, *args: object) -> None:
            pass

    redirecting = _serve(Redirecting)
    token = tmp_path / "token"
    token.write_text("tok-never-sent-elsewhere\n")
    client = Http(Config(bearer_token_file=str(token)))
    url = f"http://127.0.0.1:{redirecting.server_address[1]}/api/v1/write"
    try:
        answer = client.request("POST", url, data=b"batch")
        assert answer.status_code == 308
        with pytest.raises(Retryable) as err:
            client.check(answer)
        time.sleep(0.2)  # time for a follow-up request, were there one
    finally:
        for server in (redirecting, elsewhere):
            server.shutdown()
            server.server_close()
    assert Counting.seen == [], "the redirect was followed"
    assert err.value.reason == "redirect"
    assert f"127.0.0.1:{elsewhere.server_address[1]}/api/v1/write?key=***" in str(err.value)
    assert "moved-secret" not in str(err.value)


class DropsReused(http.server.BaseHTTPRequestHandler):
    """Answers the first request of each connection and keeps it alive; reads any later request
    on it and closes without a byte of an answer, as a receiver does that closed the idle
    connection the instant the request went out. ``fresh_too`` drops first requests as well,
    once the first connection has been served."""

    protocol_version = "HTTP/1.1"
    requests: ClassVar[list[tuple[int, bool]]] = []  # (client port, answered)
    fresh_too: ClassVar[bool] = False

    def setup(self) -> None:
        super().setup()
        self.served = 0

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        answer = self.served == 0 and not (DropsReused.fresh_too and DropsReused.requests)
        self.served += 1
        DropsReused.requests.append((self.client_address[1], answer))
        if not answer:
            self.close_connection = True
            return
        self.send_response(204)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("fresh_too", [False, True], ids=["retried", "only_once"])
def test_a_kept_alive_connection_found_closed_is_retried_once_on_a_new_one(fresh_too):
    DropsReused.requests.clear()
    DropsReused.fresh_too = False
    server = _serve(DropsReused)
    client = Http(Config(push_timeout=5))
    url = f"http://127.0.0.1:{server.server_address[1]}/api/v1/write"
    try:
        assert client.request("POST", url, data=b"one").status_code == 204
        DropsReused.fresh_too = fresh_too
        if fresh_too:  # the new connection drops it too: a failure, not a third try
            with pytest.raises(Retryable) as err:
                client.request("POST", url, data=b"two")
            assert err.value.reason == "network"
        else:
            assert client.request("POST", url, data=b"two").status_code == 204
    finally:
        server.shutdown()
        server.server_close()
    ports = [port for port, _ in DropsReused.requests]
    answered = [ok for _, ok in DropsReused.requests]
    # the first request, the second on the kept connection (dropped), once more on a new one
    assert len(ports) == 3 and ports[0] == ports[1] != ports[2]
    assert answered == [True, False, not fresh_too]


class Trickling(http.server.BaseHTTPRequestHandler):
    """Sends its answer a byte a second: the body (``headers_first``) or all of it."""

    protocol_version = "HTTP/1.1"
    headers_first: ClassVar[bool] = True
    requests: ClassVar[int] = 0

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        Trickling.requests += 1
        body = b"x" * 60
        head = (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: "
                + str(len(body)).encode() + b"\r\n\r\n")
        if Trickling.headers_first:
            self.wfile.write(head)
            self.wfile.flush()
            rest = body
        else:
            rest = head + body
        try:
            for byte in rest:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(1.0)
        except OSError:
            pass
        self.close_connection = True

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("headers_first", [True, False], ids=["trickled_body", "trickled_status"])
def test_push_timeout_bounds_a_trickled_answer(headers_first):
    Trickling.headers_first = headers_first
    server = _serve(Trickling)
    client = Http(Config(push_timeout=1.5))
    url = f"http://127.0.0.1:{server.server_address[1]}/api/v1/write"
    started = time.monotonic()
    try:
        if headers_first:  # a 2xx came: final, whatever happens to its body
            answer = client.request("POST", url, data=b"batch")
            assert answer.status_code == 200 and "--push-timeout" in answer.unread
            assert len(answer.content) < 5
        else:
            with pytest.raises(Retryable) as err:
                client.request("POST", url, data=b"batch")
            assert err.value.reason == "network" and "--push-timeout" in str(err.value)
        took = time.monotonic() - started
    finally:
        server.shutdown()
        server.server_close()
    assert 1.4 < took < 6.0, took  # at the deadline, not at the trickle's end (40 s)


def test_push_timeout_bounds_name_resolution(monkeypatch):
    real = socket.getaddrinfo

    def hanging(host, *args, **kwargs):
        if host == "receiver.example":
            time.sleep(3.0)
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", hanging)
    client = Http(Config(push_timeout=0.5))
    started = time.monotonic()
    with pytest.raises(Retryable) as err:
        client.request("POST", "http://receiver.example:9/api/v1/write", data=b"x")
    assert time.monotonic() - started < 2.5  # the lookup takes 3 s
    assert err.value.reason == "network" and "name resolution" in str(err.value)


def test_a_2xx_whose_body_never_ends_is_final_and_said_once_not_per_push(tmp_path):
    """The batch leaves the spool on the 2xx; the body timing out is logged, never a resend."""
    import structlog

    from sidecar.durability.spool import Spool
    from sidecar.samples import Series
    from sidecar.sinks.remote_write import RemoteWriteSink

    Trickling.headers_first = True
    Trickling.requests = 0
    server = _serve(Trickling)
    spool = Spool(tmp_path / "spool", max_bytes=1 << 20)
    sink = RemoteWriteSink(f"http://127.0.0.1:{server.server_address[1]}/api/v1/write", spool,
                           Config(push_timeout=0.5, retry_max_backoff=0.1),
                           push_interval_s=0.0, initial_backoff_s=0.05)
    try:
        with structlog.testing.capture_logs() as logs:
            sink.start()
            sink.emit([Series("x", (), 1.0, 1_700_000_000_000)])
            until(lambda: sink.samples_pushed == 1, 30, what="the first batch's 2xx")
            # a second batch sent shows the sender moved past the first: it was not resent
            sink.emit([Series("x", (), 2.0, 1_700_000_001_000)])
            until(lambda: sink.samples_pushed == 2, 30, what="the second batch's 2xx")
            assert sink.close(time.monotonic() + 2)
    finally:
        server.shutdown()
        server.server_close()
    assert Trickling.requests == 2 and sink.samples_pushed == 2 and len(spool) == 0
    assert sink.failures["internal"] == 2
    assert [e["event"] for e in logs if e["log_level"] == "error"] == ["answer_unreadable"]


def test_query_values_and_every_secret_are_masked_in_what_a_receiver_echoes(tmp_path):
    password = tmp_path / "password"
    password.write_text("pw-Zq81x\n")
    client = Http(Config(basic_auth_user="alice", basic_auth_password_file=str(password),
                         header=(("X-Api-Key", "hdr-77xq"),)))
    url = "http://u:url-pw-5@127.0.0.1:9/api/v1/write?license=lic-9f8e&tenant=t%2D42x"
    echoed = response(401, "you sent pw-Zq81x hdr-77xq url-pw-5 lic-9f8e t-42x t%2D42x "
                      + base64.b64encode(b"alice:pw-Zq81x").decode())
    echoed = Response(echoed.status_code, echoed.headers, echoed.content, url)
    with pytest.raises(Refused) as err:
        client.check(echoed)
    for secret in ("pw-Zq81x", "hdr-77xq", "url-pw-5", "lic-9f8e", "42x",
                   base64.b64encode(b"alice:pw-Zq81x").decode()):
        assert secret not in str(err.value)


def test_every_http_client_reads_the_receivers_options_off_the_config_itself(tmp_path):
    """No copy of the command line's HTTP options: each sink's client and the store's keep the
    agent's ``Config`` (credentials, headers, TLS read off it); the store sets only its own
    timeout and answer bound, a sink's backoff tops out at --retry-max-backoff."""
    from sidecar import wiring
    from sidecar.sinks.http import ANSWER_MAX_BYTES
    from sidecar.store import ANSWER_MAX_BYTES as QUERY_ANSWER_MAX_BYTES
    from sidecar.store import Store

    cfg = Config(push_timeout=3.5, retry_max_backoff=7.0, basic_auth_user="u",
                 header=(("X-Scope-OrgID", "t1"),), query_url="http://127.0.0.1:9",
                 query_timeout=12.0, remote_write_url=("http://127.0.0.1:9/api/v1/write",),
                 otlp_url=("http://127.0.0.1:9/v1/metrics",),
                 pushgateway_url="http://127.0.0.1:9")
    sinks = wiring.build_sinks(cfg, str(tmp_path / "spool"))
    assert len(sinks) == 3
    for sink in sinks:
        assert sink.http.cfg is cfg, sink.name
        assert (sink.http.timeout_s, sink.max_backoff_s) == (3.5, 7.0)
        assert sink.http.max_answer_bytes == ANSWER_MAX_BYTES
        assert sink.http.headers()["X-Scope-OrgID"] == "t1"
        assert sink.http.auth() == ("u", "")
    store = Store(cfg)
    assert store.http.cfg is cfg
    assert (store.http.timeout_s, store.http.max_answer_bytes) == (12.0, QUERY_ANSWER_MAX_BYTES)
    store.close()
