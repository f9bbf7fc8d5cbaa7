"""The test run's own output stays clean (issue #35): a part running in-process (a sink's
sender, an engine reader, a watcher) that logs after its test is over, when pytest is writing
its progress, must not print into that progress. Its lines go through pytest's log capture, so
a failing test still shows them ("Captured log call")."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.conftest import ROOT

LATE_LOGGER = textwrap.dedent('''
    import threading, time
    import structlog

    log = structlog.get_logger("sidecar.late")


    def test_starts_a_thread_that_logs_after_the_test():
        def late():
            time.sleep(0.3)  # pytest is between tests now, writing its progress
            log.warning("late_line_from_a_thread", marker="LEAKED-INTO-PROGRESS")

        threading.Thread(target=late, daemon=True).start()


    def test_then_waits_while_it_logs():
        time.sleep(0.8)


    def test_a_failing_test_still_shows_its_log_lines():
        log.error("said_before_failing", marker="SHOWN-ON-FAILURE")
        assert False


    def test_leaves_a_thread_that_logs_as_the_run_ends():
        def at_the_end():
            time.sleep(0.5)  # pytest is writing its summary now, or has finished
            log.warning("line_from_a_thread_at_the_end", marker="LEAKED-AT-THE-END")

        threading.Thread(target=at_the_end).start()

''')


def test_log_lines_of_in_process_parts_never_reach_the_progress_output(tmp_path):
    test_file = tmp_path / "test_late_logger.py"
    test_file.write_text(LATE_LOGGER)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
         "--rootdir", str(tmp_path), str(test_file)],
        capture_output=True, text=True, cwd=ROOT, timeout=120)
    out = proc.stdout + proc.stderr
    assert "1 failed, 3 passed" in out, out[-3000:]
    assert "LEAKED" not in out, out[-3000:]
    assert "SHOWN-ON-FAILURE" in out, "a failing test's log lines were hidden"
