import os

import pytest

# tests/ and bench/ are on sys.path through pyproject.toml's `pythonpath`: the helpers import as top-level modules.
from sglang_fixtures import sglang_model_dir, sglang_server  # noqa: F401 - one SGLang server per session
from sglang_stub import sglang_stub  # noqa: F401 - an HTTP server answering in SGLang's wire format
from tiny_models import build_tiny_qwen2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Qwen2 HF folder with its tokenizer (:func:`tiny_models.build_tiny_qwen2`), one per test module.
    Modules that need another model (the session's SGLang one, longer positions) define their own ``model_dir``."""
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"))


# Set by the full test command (scripts/test.sh without --fast): the integration tier must run, so a test marked
# `slurm` or `sglang` that skips (no cluster, SGLang not importable) is reported as a failure, with the skip's reason.
REQUIRE_INTEGRATION = "DAPO_REQUIRE_INTEGRATION"
INTEGRATION_MARKERS = ("slurm", "sglang")


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
