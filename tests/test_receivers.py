"""The test receivers themselves: each keeps its state in the test's directory, and a port taken
by a stranger between our check and the receiver's bind moves the receiver, never the test."""

from __future__ import annotations

import http.server
import threading

import pytest
import requests

from tests import receivers
from tests.receivers import LOCAL, Pushgateway, VictoriaMetrics, listener_pid_owns, running


class Stranger:
    """Someone else's server on a port: answers 200 to everything, as a healthy receiver would."""

    def __init__(self) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Length", "8")
                self.end_headers()
                self.wfile.write(b"stranger")

            do_PUT = do_POST = do_GET

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer((LOCAL, 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def port_taken_once(monkeypatch):
    """free_port() first names a port that a stranger listens on (as if it was taken after our
    check), then real free ports."""
    stranger = Stranger()
    real = receivers.free_port
    ports = iter([stranger.port])
    monkeypatch.setattr(receivers, "free_port", lambda: next(ports, None) or real())
    yield stranger
    stranger.stop()


@pytest.mark.parametrize("kind", [VictoriaMetrics, Pushgateway])
def test_a_receiver_whose_port_was_taken_starts_on_another(tmp_path, port_taken_once, kind):
    receiver = kind(tmp_path)
    assert receiver.process.port == port_taken_once.port
    with running(receiver.start()):
        assert receiver.port != port_taken_once.port
        assert listener_pid_owns(receiver.process.proc.pid, receiver.port)
        assert "stranger" not in requests.get(receiver.base + "/metrics", timeout=5).text


def test_a_receiver_whose_url_was_handed_out_fails_clearly_rather_than_use_a_stranger(
        tmp_path, port_taken_once):
    vm = VictoriaMetrics(tmp_path)
    assert vm.write_url.endswith(f":{port_taken_once.port}/api/v1/write")  # given to an agent
    with pytest.raises(RuntimeError, match="taken by another process"):
        vm.start()
    vm.stop()


def test_pushgateway_keeps_its_groups_in_the_test_directory_only(tmp_path):
    first = Pushgateway(tmp_path / "a")
    (tmp_path / "a").mkdir()
    with running(first.start()):
        r = requests.put(f"{first.base}/metrics/job/left_behind", data="x 1\n", timeout=5)
        assert r.status_code == 200
    assert (tmp_path / "a" / "pushgateway.data").stat().st_size > 0  # persisted here, on stop
    (tmp_path / "b").mkdir()
    second = Pushgateway(tmp_path / "b")
    with running(second.start()):
        assert second.groups() == []  # nothing of the first run comes back
