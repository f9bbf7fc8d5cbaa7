"""Waiting for a condition, never for a length of time: a test that sleeps and then counts fails
on a loaded machine for no fault of the code. ``until`` polls what the test is about to judge,
returns as soon as it holds, and fails after a generous bound saying what it awaited and the last
value it saw."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import pytest

T = TypeVar("T")

TIMEOUT_S = 60.0  # generous: a loaded CI machine, never a fast one, should reach it


def _shown(value: object, limit: int = 600) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def until(condition: Callable[[], T], timeout: float = TIMEOUT_S, *, interval: float = 0.05,
          what: str | Callable[[], str] = "the condition") -> T:
    """Call ``condition`` every ``interval`` seconds until it returns something truthy, and
    return that; after ``timeout`` seconds fail the test naming ``what`` was awaited (a callable
    is asked then, to describe the state it ended in) and the last value ``condition``
    returned."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            awaited = what() if callable(what) else what
            pytest.fail(f"waited {timeout:g} s for {awaited}; last seen: {_shown(value)}")
        time.sleep(interval)
