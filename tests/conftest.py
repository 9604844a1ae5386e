import os
import sys

import pytest

# Tests import their helpers (spawn_ranks.py, tiny_models.py, actor_harness.py) as top-level modules, and the row
# layouts the project's packers are measured against from bench/ (baseline_packing.py).
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

from sglang_fixtures import sglang_model_dir, sglang_server  # noqa: E402,F401 - one SGLang server per session

# Set by the full test command (scripts/test.sh without --fast): the integration tier must run, so a test marked
# `slurm` or `sglang` that skips (no cluster, SGLang not importable) is reported as a failure, with the skip's reason.
REQUIRE_INTEGRATION = "DAPO_REQUIRE_INTEGRATION"
INTEGRATION_MARKERS = ("slurm", "sglang")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: integration tests (real servers, clusters, long runs); `-m 'not slow'` skips them")
    config.addinivalue_line("markers", "sglang: needs an SGLang installation")
    config.addinivalue_line("markers", "slurm: needs a running SLURM cluster")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not (report.skipped and os.environ.get(REQUIRE_INTEGRATION) == "1"):
        return
    tier = [name for name in INTEGRATION_MARKERS if item.get_closest_marker(name) is not None]
    if not tier or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    reason = reason.removeprefix("Skipped: ")
    report.outcome = "failed"
    report.longrepr = (f"{REQUIRE_INTEGRATION}=1: this {'/'.join(tier)} test must run, but it was skipped: {reason}")
