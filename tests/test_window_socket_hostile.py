"""A question of any shape or size never stops the diagnose socket answering (issue #44, item
1), and the socket's bounds are what docs/diagnose.md says they are.

A 420-byte question whose duration is an integer of 400 digits (``float()`` of it overflows) or
a line of 1,000 nested brackets (the JSON decoder's recursion) ended the socket's thread: every
later ``diagnose`` timed out and fell back to sampling afresh, and nothing was counted or
logged. Here each hostile question goes to a real agent's ``diagnose.sock``, its refusal is
read, and a real ``gpu-sidecar diagnose`` is then answered from the agent's window.

The bounds (the held askers, the time an asker has to take its answer, the refusal of a
duration that is ``true``) are probed on a real socket, computed from the code's constants, and
the constants held to the sentence of docs/diagnose.md that promises them, so that changing
either the behaviour or the figure fails a test here.
"""

from __future__ import annotations

import contextlib
import re
import socket
from pathlib import Path

import pytest

from sidecar import window_socket
from sidecar.recent import Recent
from sidecar.window_socket import DEADLINE_S, FILE_NAME, MAX_ASKERS, MAX_QUESTION, WindowSocket, ask
from tests.conftest import ROOT
from tests.test_agent_window import _answer, _connect, agent_beside, diagnose_beside
from tests.waiting import until

# (what it is, the question's bytes, what the refusal says)
HOSTILE = [
    ("a duration of 400 digits", b'{"v": 1, "duration": ' + b"9" * 400 + b"}\n", "from 1 to 3600"),
    ("a negative duration of 400 digits", b'{"v": 1, "duration": -' + b"9" * 400 + b"}\n",
     "from 1 to 3600"),
    ("1,000 nested brackets", b"[" * 1000 + b"\n", "nested too deep"),
    ("nested objects to the size limit", b'{"a":' * ((MAX_QUESTION - 1) // 5) + b"\n",
     "not one JSON line"),
    ("a version of 400 digits", b'{"v": ' + b"1" * 400 + b', "duration": 60}\n', '"v": 1'),
    ('"v": true', b'{"v": true, "duration": 60}\n', '"v": 1'),
    ('"v": "1"', b'{"v": "1", "duration": 60}\n', '"v": 1'),
    ('"duration": true', b'{"v": 1, "duration": true}\n', "from 1 to 3600"),
    ("a NaN duration", b'{"v": 1, "duration": NaN}\n', "from 1 to 3600"),
    ("an infinite duration", b'{"v": 1, "duration": Infinity}\n', "from 1 to 3600"),
    ("a duration past a float", b'{"v": 1, "duration": 1e999}\n', "from 1 to 3600"),
    ("a duration of 400 digits and a fraction",
     b'{"v": 1, "duration": 1' + b"0" * 400 + b'.5}\n', "from 1 to 3600"),
    ("a duration as text", b'{"v": 1, "duration": "60"}\n', "from 1 to 3600"),
    ("a duration in a list", b'{"v": 1, "duration": [60]}\n', "from 1 to 3600"),
    ("not UTF-8", b"\xff\xfe\xfd\n", "not one JSON line"),
    ("an empty line", b"\n", "not one JSON line"),
    ("JSON null", b"null\n", '"v": 1'),
]


def test_every_hostile_question_is_refused_and_diagnose_is_answered_from_the_window_after_each(
        tmp_path):
    with agent_beside(tmp_path, "healthy") as (agent, env):
        path = Path(env["GPU_SIDECAR_SOCKET"]).parent / FILE_NAME
        until(lambda: agent.cycles() >= 2 and path.exists(), what="the diagnose socket")
        for what, question, said in HOSTILE:
            assert len(question) <= MAX_QUESTION, what  # short questions, every one
            asker = _connect(path)
            asker.sendall(question)
            refusal = _answer(asker)
            asker.close()
            assert said in refusal.get("error", ""), (what, refusal)
            # the socket still answers: a real diagnose, from the agent's window, not afresh
            proc = diagnose_beside(env, "--duration", "10")
            assert proc.returncode == 0, (what, proc.stdout + proc.stderr)
            assert "window: the agent's window:" in proc.stdout, (what, proc.stdout)
    assert "Traceback" not in "".join(agent.err), "".join(agent.err)[-3000:]
    assert not agent.logged("diagnose_socket_failed"), agent.logged("diagnose_socket_failed")
    # refused, counted and logged once per reason (at the 1st, 10th, ...), as docs promise
    refused = agent.logged("diagnose_question_refused")
    assert [e["count"] for e in refused if e["reason"] == "malformed"] == [1, 10], refused
    assert {e["reason"] for e in refused} == {"malformed"}, refused


def test_a_fault_in_one_askers_exchange_drops_that_asker_and_the_socket_serves_on(tmp_path):
    """Belt and braces: a fault no refusal foresaw (here the window itself failing to answer
    twice) closes that asker's connection, is counted by kind, and the thread answers the next."""

    class Failing(Recent):
        faults = 2

        def verdicts(self, *args, **kwargs):
            if Failing.faults:
                Failing.faults -= 1
                raise ZeroDivisionError("a fault nobody foresaw")
            return super().verdicts(*args, **kwargs)

    served = WindowSocket(tmp_path / FILE_NAME, Failing()).start()
    try:
        for _ in range(2):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(10)
                s.connect(str(tmp_path / FILE_NAME))
                s.sendall(b'{"v": 1, "duration": 60}\n')
                assert s.recv(100) == b""  # dropped, nothing half said
        answer = ask(tmp_path / FILE_NAME, 60)
        assert answer["code"] == 2 and "no GPU" in answer["report"]  # an empty window, answered
        assert served.failed == {"ZeroDivisionError": 2} and served.answered == 1
        assert served._thread.is_alive()
    finally:
        served.stop()


# -- the socket's bounds, as docs/diagnose.md promises them --------------------------------------


def _promised() -> str:
    text = " ".join((ROOT / "docs" / "diagnose.md").read_text().split())
    sentence = re.search(r"A question is one JSON line; anything else \(([^)]*)\)", text)
    assert sentence, "docs/diagnose.md no longer says what the diagnose socket refuses"
    return sentence.group(1)


def test_the_documented_bounds_are_the_codes():
    said = _promised()
    assert f"over {MAX_QUESTION // 1024} KiB" in said and MAX_QUESTION % 1024 == 0, said
    assert f"not whole within {DEADLINE_S:g} s" in said, said
    assert f"an answer not taken within {DEADLINE_S:g} s" in said, said
    assert f"more than {MAX_ASKERS} askers at once" in said, said


def _held(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(str(path))
    return s


def test_the_socket_holds_max_askers_at_once_and_a_newcomer_closes_the_oldest(tmp_path):
    # a clock that never moves: no asker reaches its deadline, so only the limit closes one
    served = WindowSocket(tmp_path / FILE_NAME, Recent(), clock=lambda: 0.0).start()
    held: list[socket.socket] = []
    try:
        held = [_connect(tmp_path / FILE_NAME) for _ in range(MAX_ASKERS + 1)]
        until(lambda: served.refused["too_many"] == 1, what="the newcomer past the limit refused")
        assert held[0].recv(100) == b"", "the oldest asker was not the one closed"
        # every other one is still held: each asks now and is answered
        for s in held[1:]:
            s.sendall(b'{"v": 1, "duration": 60}\n')
            assert _answer(s)["code"] == 2
        assert served.refused == {"too_many": 1} and served.answered == MAX_ASKERS
    finally:
        for s in held:
            s.close()
        served.stop()


def test_max_askers_held_at_once_close_none(tmp_path):
    served = WindowSocket(tmp_path / FILE_NAME, Recent(), clock=lambda: 0.0).start()
    held: list[socket.socket] = []
    try:
        held = [_connect(tmp_path / FILE_NAME) for _ in range(MAX_ASKERS)]
        # the last asks and is answered: each one before it was accepted before it
        held[-1].sendall(b'{"v": 1, "duration": 60}\n')
        assert _answer(held[-1])["code"] == 2
        for s in held[:-1]:
            s.sendall(b'{"v": 1, "duration": 60}\n')
            assert _answer(s)["code"] == 2
        assert not served.refused and served.answered == MAX_ASKERS
    finally:
        for s in held:
            s.close()
        served.stop()


def test_a_duration_that_is_true_is_refused_not_taken_for_one_second(tmp_path):
    served = WindowSocket(tmp_path / FILE_NAME, Recent()).start()
    try:
        for question in (b'{"v": 1, "duration": true}\n', b'{"v": true, "duration": 60}\n'):
            with _held(tmp_path / FILE_NAME) as s:
                s.sendall(question)
                assert "error" in _answer(s), question
        assert served.refused == {"malformed": 2} and served.answered == 0
    finally:
        served.stop()
    for bad in ('{"v": 1, "duration": true}', '{"v": 1, "duration": false}',
                '{"v": true, "duration": 60}'):
        with contextlib.suppress(window_socket.Refused):
            window_socket.parse_question(bad.encode())
            raise AssertionError(f"{bad} was taken")
    assert window_socket.parse_question(b'{"v": 1, "duration": 1}') == 1.0


class Clock:
    """The socket's clock, set by the test; its calls counted (the thread reads it once per
    round, so three more calls are three rounds that held every asker to its deadline)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.calls = 0

    def __call__(self) -> float:
        self.calls += 1
        return self.now

    def rounds(self, n: int) -> None:
        seen = self.calls
        until(lambda: self.calls >= seen + n, what=f"{n} rounds of the socket's thread")


@pytest.mark.slow
def test_an_asker_has_deadline_s_from_its_answer_to_take_it_then_it_is_dropped(tmp_path):
    """An answer larger than the socket's buffers, and an asker that reads none of it: held
    until ``DEADLINE_S`` after the answer was ready (not after the connection: the question
    came 1.5 s into it), dropped just past it; the asker reads a cut answer, then the end."""

    class Large(WindowSocket):
        def answer(self, seconds: float) -> dict[str, object]:
            return {"v": 1, "code": 0, "report": "x" * (8 << 20), "cycles": 0, "covered_s": 0}

    clock = Clock()
    served = Large(tmp_path / FILE_NAME, Recent(), clock=clock).start()
    try:
        with _connect(tmp_path / FILE_NAME) as s:
            clock.rounds(2)  # accepted at 0
            clock.now = asked = 1.5
            s.sendall(b'{"v": 1, "duration": 60}\n')
            until(lambda: served.answered == 1, what="the answer ready")
            clock.rounds(1)  # its deadline set, from the clock at 1.5
            clock.now = asked + DEADLINE_S - 0.01
            clock.rounds(3)
            assert not served.refused, f"dropped before {DEADLINE_S:g} s: {served.refused}"
            clock.now = asked + DEADLINE_S + 0.01
            until(lambda: served.refused["answer_not_taken"] == 1, timeout=10,
                  what=f"the asker dropped past {DEADLINE_S:g} s")
            data = b""
            with contextlib.suppress(ConnectionResetError):
                while chunk := s.recv(1 << 20):
                    data += chunk
            assert 0 < len(data) < 8 << 20  # what the buffers held, then the end
    finally:
        served.stop()
