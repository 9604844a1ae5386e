"""The switch that makes the full test run fail, not skip, when a part of the integration tier cannot run.

Tests of a tier that needs a component this machine may lack skip with a reason when it is missing (SGLang: the
tests marked ``sglang``). ``scripts/test.sh`` without ``--fast`` — what CI runs — sets ``DAPO_REQUIRE_INTEGRATION=1``;
then each such skip is reported as a failure carrying the skip's reason, so a missing SGLang fails the run instead
of passing it with fewer tests. ``tests/conftest.py`` imports the hook below.
"""

from __future__ import annotations

import os

import pytest

SWITCH = "DAPO_REQUIRE_INTEGRATION"
REQUIRED_MARKERS = ("sglang",)  # a test carrying one of these may not skip when the switch is on


def integration_required() -> bool:
    return os.environ.get(SWITCH, "") == "1"


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    markers = [name for name in REQUIRED_MARKERS if item.get_closest_marker(name)]
    if report.skipped and markers and integration_required():
        report.outcome = "failed"
        report.longrepr = (f"{SWITCH}=1 (the full test run): a test marked {markers[0]!r} may not skip; "
                           f"it skipped with: {_skip_reason(report)}")
