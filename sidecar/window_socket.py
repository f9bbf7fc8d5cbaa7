"""The running agent answers ``gpu-sidecar diagnose`` from its recent window (``sidecar.recent``).

A Unix stream socket, ``diagnose.sock`` beside the app socket (the socket's volume: only the
pod's containers reach it; mode 0660). One question per connection, a JSON line:
``{"v": 1, "duration": SECONDS}``; one answer, a JSON object, then the agent closes:
``{"v": 1, "code": 0|1|2, "report": TEXT, "cycles": N, "covered_s": S}`` or
``{"v": 1, "error": TEXT}``. The report is the one ``diagnose`` prints when it samples afresh,
from the same judge and thresholds.

A thread of its own serves the connections, each bounded: the question must arrive whole within
``DEADLINE_S`` and ``MAX_QUESTION`` bytes, the answer must be taken within ``DEADLINE_S``, at
most ``MAX_ASKERS`` at once; anything else is refused (counted and logged once per reason, at
the 1st, 10th, 100th, ...). The only work shared with the cycle is merging the window's
buckets under its lock, so no question, however hostile, delays a cycle by more than that.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import structlog
import tenacity

from sidecar.log import log_count
from sidecar.recent import Recent
from sidecar.sources.app_socket import bind_unix
from sidecar.thresholds import Thresholds

log = structlog.get_logger("sidecar.window_socket")

FILE_NAME = "diagnose.sock"
VERSION = 1
MAX_QUESTION = 1024  # bytes: a question is one short JSON line
MAX_ANSWER = 16 * 1024 * 1024  # bytes the asking side reads at most
DEADLINE_S = 2.0  # for the question to arrive whole, and for the answer to be taken
MAX_ASKERS = 16  # connections held at once; a newcomer beyond it closes the oldest
BACKLOG = 16  # connections the kernel queues until the thread accepts them


def path_of(app_socket: str) -> Path:
    return Path(app_socket).parent / FILE_NAME


class Refused(Exception):
    """A question the agent will not answer: ``reason`` is counted, the text is sent back."""

    def __init__(self, reason: str, text: str) -> None:
        super().__init__(text)
        self.reason = reason


def _number(value: object) -> bool:
    """A JSON number, not ``true``/``false`` (a bool is an int in Python: ``True == 1``)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parse_question(data: bytes) -> float:
    """The seconds asked for, from one question line; Refused for anything else, whatever its
    shape: nothing of a question reaches ``float()`` or ``math`` before its range is checked
    (an integer of 400 digits overflows a float), and nesting too deep for the decoder
    (``[[[...``, a RecursionError) is malformed like any other line that is not the question."""
    try:
        question = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        why = "nested too deep" if isinstance(exc, RecursionError) else str(exc)
        raise Refused("malformed", f"the question is not one JSON line ({why})") from None
    version = question.get("v") if isinstance(question, dict) else None
    if not (_number(version) and version == VERSION):
        raise Refused("malformed", f"the question must be a JSON object with \"v\": {VERSION}")
    seconds = question.get("duration")
    # compared as it came (ints of any size compare exactly; NaN compares false), converted
    # only once it is within range
    if not (_number(seconds) and 1 <= seconds <= 3600):
        raise Refused("malformed", "\"duration\" must be a number of seconds from 1 to 3600")
    return float(seconds)


class _Asker:
    """One connection: its deadline, what it sent so far, the answer left to send."""

    __slots__ = ("answer", "deadline", "question", "sock")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.deadline = deadline
        self.question = b""
        self.answer: memoryview | None = None


class WindowSocket:
    """Answers questions about ``recent`` on ``path`` until ``stop``: one thread, a selector over
    at most ``MAX_ASKERS`` connections, each with a whole-exchange deadline, so neither a slow
    asker nor many at once hold up the next (the oldest is dropped for a newcomer)."""

    def __init__(self, path: Path, recent: Recent, *, label: str = "",
                 t: Thresholds | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self.recent = recent
        self.label = label
        self.t = t
        self.clock = clock
        self.answered = 0
        self.refused: Counter[str] = Counter()
        self.failed: Counter[str] = Counter()  # faults no refusal foresaw, by exception type
        self._sock: socket.socket | None = None
        self._inode: int | None = None
        self._stop = threading.Event()
        self._wake: tuple[socket.socket, socket.socket] | None = None  # stop() writes a byte
        self._thread: threading.Thread | None = None

    def start(self) -> WindowSocket:
        sock = bind_unix(str(self.path), socket.SOCK_STREAM)
        sock.listen(BACKLOG)
        sock.setblocking(False)
        self._sock = sock
        self._inode = os.stat(self.path).st_ino
        self._wake = socket.socketpair()
        self._thread = threading.Thread(target=self._serve, name="diagnose-socket", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._wake is not None:
            with contextlib.suppress(OSError):
                self._wake[1].send(b"\0")
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self._wake is not None:
            for end in self._wake:
                end.close()
        if self._sock is not None:
            self._sock.close()
        with contextlib.suppress(OSError):  # only the file this agent bound
            if self._inode is not None and os.stat(self.path).st_ino == self._inode:
                os.unlink(self.path)

    def _serve(self) -> None:
        assert self._sock is not None and self._wake is not None
        askers: dict[socket.socket, _Asker] = {}  # in the order they came
        with selectors.DefaultSelector() as sel:
            sel.register(self._sock, selectors.EVENT_READ)
            sel.register(self._wake[0], selectors.EVENT_READ)
            while not self._stop.is_set():
                try:
                    self._round(sel, askers)
                except Exception as exc:  # the socket must outlive any fault
                    self._failed(exc)
                    time.sleep(0.1)  # never a busy loop
            for asker in list(askers.values()):
                self._close(sel, askers, asker)

    def _round(self, sel: selectors.BaseSelector, askers: dict[socket.socket, _Asker]) -> None:
        """One wait and what came of it. A fault in one asker's exchange (whatever it is: the
        known ones are refusals) drops that asker alone and the thread serves on."""
        assert self._sock is not None and self._wake is not None
        # idle, the thread sleeps until a connection or stop(); with askers it wakes every
        # half second to hold them to their deadlines
        for key, _ in sel.select(timeout=0.5 if askers else None):
            if key.fileobj is self._wake[0]:
                continue  # stop(): the loop's condition ends it
            if key.fileobj is self._sock:
                self._accept(sel, askers)
                continue
            # None when a newcomer already closed it in this round (the oldest of too many)
            asker = askers.get(key.fileobj)  # type: ignore[call-overload]
            if asker is None:
                continue
            try:
                self._step(sel, askers, asker)
            except Exception as exc:  # one asker's fault is that asker's
                self._failed(exc)
                self._close(sel, askers, asker)
        now = self.clock()
        for asker in [a for a in askers.values() if now > a.deadline]:
            self._refuse("too_slow" if asker.answer is None else "answer_not_taken",
                         f"the exchange did not end within {DEADLINE_S:g} s")
            self._close(sel, askers, asker)

    def _accept(self, sel: selectors.BaseSelector, askers: dict[socket.socket, _Asker]) -> None:
        assert self._sock is not None
        try:
            conn, _ = self._sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # EMFILE and the like: the asker waits in the backlog
            self._refuse("unaccepted", f"cannot accept: {exc.strerror}")
            time.sleep(0.1)  # never a busy loop
            return
        if len(askers) >= MAX_ASKERS:
            oldest = next(iter(askers.values()))
            self._refuse("too_many", f"more than {MAX_ASKERS} connections at once")
            self._close(sel, askers, oldest)
        conn.setblocking(False)
        askers[conn] = _Asker(conn, self.clock() + DEADLINE_S)
        sel.register(conn, selectors.EVENT_READ)

    def _step(self, sel: selectors.BaseSelector, askers: dict[socket.socket, _Asker],
              asker: _Asker) -> None:
        try:
            if asker.answer is None:
                chunk = asker.sock.recv(MAX_QUESTION + 1 - len(asker.question))
                asker.question += chunk
                if len(asker.question) > MAX_QUESTION:
                    raise Refused("too_large", f"a question is at most {MAX_QUESTION} bytes")
                if b"\n" not in asker.question and chunk:
                    return
                self._answer(asker)
                sel.modify(asker.sock, selectors.EVENT_WRITE)
                return
            asker.answer = asker.answer[asker.sock.send(asker.answer):]
            if asker.answer:
                return
        except Refused as exc:
            self._refuse(exc.reason, str(exc))
            with contextlib.suppress(OSError):  # one try to say why; it may not be read
                asker.sock.send(json.dumps({"v": VERSION, "error": str(exc)}).encode() + b"\n")
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._refuse("connection_error", f"the connection failed: {exc.strerror}")
        self._close(sel, askers, asker)

    def _answer(self, asker: _Asker) -> None:
        line = asker.question.split(b"\n", 1)[0]
        try:
            answer = self.answer(parse_question(line))
        except Refused as exc:
            self._refuse(exc.reason, str(exc))
            answer = {"v": VERSION, "error": str(exc)}
        else:
            self.answered += 1
        asker.answer = memoryview(json.dumps(answer).encode() + b"\n")
        asker.deadline = self.clock() + DEADLINE_S  # the asker's time to take it

    @staticmethod
    def _close(sel: selectors.BaseSelector, askers: dict[socket.socket, _Asker],
               asker: _Asker) -> None:
        askers.pop(asker.sock, None)
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(asker.sock)
        asker.sock.close()

    def answer(self, seconds: float) -> dict[str, object]:
        # only when asked: the agent's path stays lean
        from sidecar.views.document import document
        from sidecar.views.report import report

        verdicts, span = self.recent.verdicts(seconds, self.clock(), self.t)
        if not verdicts:
            return {"v": VERSION, "code": 2, "cycles": span.cycles, "covered_s": span.covered_s,
                    "report": f"gpu-sidecar diagnose: no GPU in {span.short()}; the agent "
                              "exports none yet (is the app announcing its GPUs? `gpu-sidecar "
                              "status` says)\n"}
        text = report(verdicts, seconds=span.covered_s, samples=span.cycles,
                      label=self.label, t=self.t, source=span.short())
        doc = document(verdicts, seconds=span.covered_s, samples=span.cycles,
                       source=span.short(), origin="agent-window", t=self.t)
        code = 1 if any(v.findings for v in verdicts.values()) else 0
        return {"v": VERSION, "code": code, "report": text, "document": doc,
                "cycles": span.cycles, "covered_s": span.covered_s}

    def _failed(self, exc: Exception) -> None:
        """A fault no refusal foresaw: counted and logged once per kind (1st, 10th, ...),
        its text and no traceback; the connection it came from is dropped, the thread goes on."""
        kind = type(exc).__name__
        self.failed[kind] += 1
        log_count("diagnose_socket_failed", self.failed[kind], level="error", error=kind,
                  detail=str(exc)[:200], socket=str(self.path),
                  effect="that asker's connection was dropped; the socket goes on answering")

    def _refuse(self, reason: str, text: str) -> None:
        self.refused[reason] += 1
        log_count("diagnose_question_refused", self.refused[reason], level="warning",
                  reason=reason, error=text, socket=str(self.path),
                  effect="that asker got no answer; the agent's cycles go on")


# -- the asking side (``gpu-sidecar diagnose`` beside the agent) ---------------------------------


class NoAgent(Exception):
    """No agent answers on the socket: diagnose samples afresh, saying why."""


def ask(path: Path, seconds: float, *, timeout: float = 10.0) -> dict[str, object]:
    """The running agent's answer for the last ``seconds``; NoAgent when none answers there."""
    if not path.exists():
        raise NoAgent(f"no agent's {FILE_NAME} beside the app socket ({path})")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        try:
            # a full backlog (many askers at once) refuses with EAGAIN: the agent drains it
            # within moments, so try again briefly
            for attempt in tenacity.Retrying(
                    stop=tenacity.stop_after_delay(DEADLINE_S), wait=tenacity.wait_fixed(0.05),
                    retry=tenacity.retry_if_exception_type(BlockingIOError), reraise=True):
                with attempt:
                    sock.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise NoAgent(f"no agent answers on {path} ({exc.strerror})") from None
        sock.sendall(json.dumps({"v": VERSION, "duration": seconds}).encode() + b"\n")
        chunks: list[bytes] = []
        size = 0
        while chunk := sock.recv(65536):
            size += len(chunk)
            if size > MAX_ANSWER:
                raise ValueError(f"the answer on {path} is over {MAX_ANSWER} bytes")
            chunks.append(chunk)
    finally:
        sock.close()
    answer = json.loads(b"".join(chunks).decode("utf-8"))
    if not isinstance(answer, dict):
        raise ValueError(f"the answer on {path} is not a JSON object")
    return answer
