import os
import sys

import pytest
from sglang_fixtures import sglang_model_dir, sglang_server  # noqa: F401 - one SGLang server per session

# Tests import their helpers (spawn_ranks.py, tiny_models.py, actor_harness.py) as top-level modules.
sys.path.insert(0, os.path.dirname(__file__))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: integration tests (real servers, clusters, long runs); `-m 'not slow'` skips them")
    config.addinivalue_line("markers", "sglang: needs an SGLang installation")
    config.addinivalue_line("markers", "slurm: needs a running SLURM cluster")
