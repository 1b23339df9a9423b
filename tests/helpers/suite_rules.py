"""Rules the whole suite keeps, as pytest hooks (tests/conftest.py imports them, so every run has them).

* No test depends on how fast the machine is. Hypothesis's deadline and its too-slow health check measure
  wall time, so every Hypothesis test runs with both off (conftest's profile does it for the tests that do not
  say; a test that sets ``deadline`` or ``suppress_health_check`` itself must keep them off): collecting one
  that does not is an error naming it. ``make test-under-load`` runs the suite beside 8 busy processes.
* ``CAPEVAL_NO_SKIPS=1`` (the lowest-versions part of ``make test``): a test that skips fails instead, naming
  why it skipped. There a skip means a declared floor that nothing runs (a package of the set that does not
  import at its floor, a test left without what it needs).
"""
from __future__ import annotations

import os

import pytest

NO_SKIPS = "CAPEVAL_NO_SKIPS"


def speed_bound_hypothesis_tests(items) -> list[str]:
    """The collected Hypothesis tests whose settings keep a wall-clock check: a deadline, or the too-slow
    health check."""
    try:
        from hypothesis import HealthCheck
    except ImportError:
        return []
    bad = []
    for item in items:
        chosen = getattr(getattr(item, "obj", None), "_hypothesis_internal_use_settings", None)
        if chosen is None:
            continue
        if chosen.deadline is not None or HealthCheck.too_slow not in chosen.suppress_health_check:
            bad.append(item.nodeid)
    return bad


def pytest_collection_modifyitems(config, items) -> None:
    bad = speed_bound_hypothesis_tests(items)
    if bad:
        raise pytest.UsageError(
            "these Hypothesis tests measure wall time (a deadline or the too_slow health check), which a busy "
            f"machine fails: set deadline=None and suppress HealthCheck.too_slow: {', '.join(bad)}")


def _no_skips(report) -> None:
    if os.environ.get(NO_SKIPS) == "1" and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped in a run where every test must run ({NO_SKIPS}=1): {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _no_skips(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _no_skips(outcome.get_result())
