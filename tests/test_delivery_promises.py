"""What delivery promises a receiver's answers, seen from outside: ``gpu-sidecar run`` pushing to
a real HTTP server on 127.0.0.1 that answers by plan.

- ``Retry-After`` lengthens the wait before the next attempt beyond ``--retry-max-backoff``
  (DESIGN.md: "a floor that Retry-After can lengthen, never shorten"), and a value far beyond
  the cap (300 s, ``--retry-max-backoff``'s help) still holds attempts off, yet never holds
  shutdown;
- a redirect (here 308, which would keep the method and body) is never followed: the server it
  points to receives nothing, the batch is kept and delivered once the URL answers, and the log
  says which URL the receiver points to."""

from __future__ import annotations

import time

import cramjam
import pytest

from tests.promise_tools import Agent, Receiver, until

SHUTDOWN_TIMEOUT = 3.0


def agent_args(url: str, spool: str, *extra: str) -> list[str]:
    return ["--simulate", "healthy", "--remote-write-url", url, "--spool-dir", spool,
            "--interval", "0.1", "--push-interval", "0.2", "--retry-max-backoff", "0.5",
            "--push-timeout", "5", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT), *extra]


def payload(body: bytes) -> bytes:
    return bytes(cramjam.snappy.decompress_raw(body))  # remote-write: snappy block format


@pytest.mark.parametrize("status", [429, 503])
def test_retry_after_lengthens_the_wait_before_the_next_attempt_beyond_the_backoff(
        tmp_path, status):
    receiver = Receiver(lambda n: (status, {"Retry-After": "3"}, b"busy") if n == 0 else None)
    try:
        with Agent(agent_args(receiver.url, str(tmp_path / "spool"))) as agent:
            until(lambda: receiver.count() >= 2 or not agent.alive(), 60,
                  what=lambda: "a second attempt\n" + agent.stderr_tail())
            assert agent.alive(), agent.stderr_tail()
            (t0, _, refused), (t1, _, retried) = receiver.snapshot()[:2]
            failing = until(lambda: agent.logged("push_failing"), 10, what="push_failing logged")
    finally:
        receiver.close()
    # the backoff alone is at most 0.5 s (--retry-max-backoff); the receiver asked for 3
    assert t1 - t0 >= 3.0 - 0.05, f"retried after {t1 - t0:.2f} s despite Retry-After: 3"
    assert t1 - t0 < 15, f"retried only after {t1 - t0:.2f} s"
    assert failing[0]["retry_after_s"] == 3.0
    assert failing[0]["reason"] == ("http_429" if status == 429 else "http_5xx")
    assert payload(retried).startswith(payload(refused)), "the refused batch was not sent again"


def test_a_retry_after_far_beyond_the_cap_still_holds_attempts_off_but_never_holds_shutdown(
        tmp_path):
    """The cap itself (300 s) is not waited for here: the test would last five minutes."""
    receiver = Receiver(lambda n: (429, {"Retry-After": "100000"}, b"come back tomorrow")
                        if n == 0 else None)
    try:
        agent = Agent(agent_args(receiver.url, str(tmp_path / "spool")))
        with agent:
            until(lambda: receiver.count() >= 1 or not agent.alive(), 60,
                  what=lambda: "a first attempt\n" + agent.stderr_tail())
            failing = until(lambda: agent.logged("push_failing"), 10, what="push_failing logged")
            assert failing[0]["retry_after_s"] == 100000.0
            assert failing[0]["retry_after_honoured_s"] == 300.0  # the cap
            held_since = time.monotonic()
            while time.monotonic() - held_since < 4.0:  # watching that nothing comes, bounded
                assert receiver.count() == 1, "Retry-After far beyond the cap was ignored"
                assert agent.alive(), agent.stderr_tail()
                time.sleep(0.1)
            stopping = time.monotonic()
            rc = agent.stop(timeout=SHUTDOWN_TIMEOUT + 15)
            took = time.monotonic() - stopping
        requests = receiver.snapshot()
    finally:
        receiver.close()
    assert rc == 0, agent.stderr_tail()
    assert took < SHUTDOWN_TIMEOUT + 5, f"shutdown took {took:.1f} s"
    assert len(requests) >= 2, "the backlog was not sent at shutdown"
    assert payload(requests[1][2]).startswith(payload(requests[0][2]))


def test_a_308_redirect_is_never_followed_the_batch_is_kept_and_the_log_names_where_it_points(
        tmp_path):
    elsewhere = Receiver()  # where the redirect points: must never hear from the agent
    redirecting = {"on": True}
    receiver = Receiver(lambda n: (308, {"Location": elsewhere.url}, b"moved")
                        if redirecting["on"] else None)
    try:
        agent = Agent(agent_args(receiver.url, str(tmp_path / "spool"), "--stdout", "--output",
                                 "json"))
        with agent:
            def redirect_failures() -> float:
                found = [r for r in agent.series() if r["name"] == "gpu_sidecar_push_failures_total"
                         and r["labels"].get("reason") == "redirect"]
                return float(found[-1]["value"]) if found else 0.0

            until(lambda: (receiver.count() >= 3 and redirect_failures() >= 2)
                  or elsewhere.count() or not agent.alive(), 60,
                  what=lambda: f"redirects retried and counted ({receiver.count()} requests, "
                               f"{redirect_failures()} counted)\n" + agent.stderr_tail())
            assert agent.alive(), agent.stderr_tail()
            assert elsewhere.count() == 0, "the redirect was followed"
            first_refused = receiver.snapshot()[0][2]
            redirecting["on"] = False
            until(lambda: 204 in receiver.answers, 30,
                  what=lambda: "delivery once the URL stops redirecting\n" + agent.stderr_tail())
            delivered = receiver.snapshot()[receiver.answers.index(204)][2]
        failing = agent.logged("push_failing")
    finally:
        receiver.close()
        elsewhere.close()
    assert elsewhere.count() == 0, "the redirect was followed"
    assert payload(delivered).startswith(payload(first_refused)), "the redirected batch was lost"
    assert len(failing) == 1 and failing[0]["reason"] == "redirect", failing
    said = failing[0]["detail"]
    assert "308" in said and elsewhere.url in said and "never followed" in said, said
