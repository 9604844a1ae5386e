"""Can the process-wide and checkpoint-writer overrides of megatron-core go? (dapo_megatron.overrides.megatron_core;
the table is dapo_megatron/overrides/README.md.)

Each check runs megatron-core's own code twice, in fresh interpreters (the overrides hold for the life of a process):
once as upstream ships it — the test asserts the defect is still there, so when a new pin fixes it the test fails and
names the override that can go — and once with the override applied, showing it repairs exactly that.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
UPSTREAM = "megatron-core 0.16.1"

PROBE = """
    import json, logging, multiprocessing, queue, sys, tempfile, warnings
    from pathlib import Path

    import torch
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import moe_utils

    from dapo_megatron.overrides.megatron_core import checkpointing, log_levels, process

    if sys.argv[1] == "fixed":  # in the order the trainer applies them
        log_levels.quiet_megatron_loggers()
        process.apply_megatron_core_overrides()
        checkpointing.write_results_in_this_process()
    result = {}

    # the MoE router's GEMM without Transformer Engine
    inp, weight = torch.randn(5, 3), torch.randn(4, 3)
    try:
        out = moe_utils.RouterGatingLinearFunction.apply(inp, weight, None, torch.float32)
        result["router"] = "ok" if torch.allclose(out, inp @ weight.t()) else "wrong"
    except NameError as error:
        result["router"] = f"NameError: {error}"

    # the all-gather megatron calls, and torch's deprecation notice for it
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", append=True)  # behind any filter in force: shows every warning not ignored
        try:
            mappings.dist_all_gather_func(torch.zeros(2), torch.zeros(1))
        except ValueError:  # no process group: the notice comes before torch looks for one
            pass
    deprecated = torch.distributed.all_gather_into_tensor
    result["megatron calls all_gather_into_tensor"] = mappings.dist_all_gather_func is deprecated
    result["all-gather warnings"] = [str(w.message) for w in seen if issubclass(w.category, FutureWarning)]

    # the checkpoint writer's results queue
    results = filesystem_async._get_write_results_queue()
    result["results queue"] = type(results).__name__
    result["processes started"] = [type(child).__name__ for child in multiprocessing.active_children()]

    # a writer process's failure: logged by megatron, then handed back to be raised
    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.levelname)
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.INFO)
    missing = Path(tempfile.mkdtemp()) / "missing" / "shard.distcp"
    handed_back = queue.Queue()
    FileSystemWriterAsync.write_preloaded_data_multiproc([], False, 0, [(missing, "key", ([], []))], handed_back)
    result["writer failure handed back"] = type(handed_back.get_nowait()).__name__
    result["writer failure logged"] = logged

    # a trainer killed while its writer process writes (the writer blocks opening a FIFO nobody reads)
    import os, signal, time
    import psutil
    fifo = Path(tempfile.mkdtemp()) / "shard.distcp"
    os.mkfifo(fifo)

    def save():
        if sys.argv[1] == "fixed":
            checkpointing.writers_die_with_their_trainer()  # as save_load does before every save
        FileSystemWriterAsync.write_preloaded_data_multiproc([], False, 0, [(fifo, "key", ([], []))], queue.Queue())

    trainer = multiprocessing.get_context("fork").Process(target=save)
    trainer.start()
    while not psutil.Process(trainer.pid).children():
        time.sleep(0.01)
    writer = psutil.Process(trainer.pid).children()[0]
    time.sleep(0.5)  # the writer is blocked in its write
    os.kill(trainer.pid, signal.SIGKILL)
    trainer.join()
    try:
        writer.wait(timeout=3)  # killed with its trainer: at once
        result["writer outlives its killed trainer"] = False
    except psutil.TimeoutExpired:
        result["writer outlives its killed trainer"] = True
        writer.kill()
    print("RESULT " + json.dumps(result))
"""


def _probe(mode: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(PROBE), mode], capture_output=True, text=True,
                          timeout=300, cwd=REPO_ROOT, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.fixture(scope="module")
def upstream() -> dict:
    return _probe("upstream")


@pytest.fixture(scope="module")
def fixed() -> dict:
    return _probe("fixed")


def test_can_define_missing_transformer_engine_names_go(upstream, fixed):
    assert upstream["router"] == "NameError: name 'te_general_gemm' is not defined", (
        f"{UPSTREAM}'s MoE router GEMM runs without Transformer Engine now ({upstream['router']}): "
        "define_missing_transformer_engine_names can go")
    assert fixed["router"] == "ok"


def test_can_silence_all_gather_deprecation_go(upstream, fixed):
    assert upstream["megatron calls all_gather_into_tensor"] and len(upstream["all-gather warnings"]) == 1, (
        f"megatron's all-gather no longer warns ({upstream}): silence_all_gather_deprecation can go")
    assert "`torch.distributed.all_gather_into_tensor` is deprecated" in upstream["all-gather warnings"][0]
    assert fixed["all-gather warnings"] == []


def test_can_write_results_in_this_process_go(upstream, fixed):
    assert upstream["results queue"] != "Queue" and "SpawnProcess" in upstream["processes started"], (
        f"{UPSTREAM}'s checkpoint writer no longer starts a Manager process for its results ({upstream}): "
        "write_results_in_this_process can go")
    assert fixed["results queue"] == "Queue" and fixed["processes started"] == []


def test_can_writers_die_with_their_trainer_go(upstream, fixed):
    assert upstream["writer outlives its killed trainer"], (
        f"{UPSTREAM}'s checkpoint writer process no longer outlives a trainer killed mid-save: "
        "writers_die_with_their_trainer can go")
    assert not fixed["writer outlives its killed trainer"]


def test_can_quiet_megatron_loggers_go_for_the_checkpoint_writer(upstream, fixed):
    """A writer's failure is handed back (and raised by the save) in both; upstream also logs it as an error line."""
    assert upstream["writer failure handed back"] == fixed["writer failure handed back"] == "FileNotFoundError"
    assert "ERROR" in upstream["writer failure logged"], (
        f"{UPSTREAM}'s checkpoint writer no longer logs a failure it hands back ({upstream}): the CRITICAL level "
        "quiet_megatron_loggers gives its logger can go")
    assert fixed["writer failure logged"] == []


def test_can_clip_and_step_go():
    """clip_and_step re-implements the end of ``step()`` because no megatron optimizer's ``step()`` takes a norm
    already computed (tests/integration/test_policy_parallel_features.py shows ``step()`` computing it again)."""
    import inspect

    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import ChainedOptimizer, FP32Optimizer, MixedPrecisionOptimizer

    for optimizer in (MixedPrecisionOptimizer, FP32Optimizer, ChainedOptimizer, DistributedOptimizer):
        assert list(inspect.signature(optimizer.step).parameters) == ["self"], (
            f"{UPSTREAM}'s {optimizer.__name__}.step takes arguments now "
            f"({inspect.signature(optimizer.step)}): if one is the gradient norm, clip_and_step can go")
