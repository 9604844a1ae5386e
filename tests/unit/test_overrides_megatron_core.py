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


# ---- a Transformer Engine that is installed but does not load (overrides/megatron_core/transformer_engine_import.py)

def _import_guards(source: str, module: str) -> list[list[str]]:
    """The exception names of every ``try`` whose body imports ``module`` (directly), in ``source``."""
    import ast

    guards = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Try) and any(isinstance(s, ast.Import) and any(a.name == module for a in s.names)
                                             for s in node.body):
            guards.append([ast.unparse(h.type) for h in node.handlers])
    return guards


def test_can_hold_back_broken_transformer_engine_go():
    """``import megatron.core`` imports Transformer Engine in megatron/core/utils.py under ``except ImportError``
    only: a TE whose library fails to load (OSError, RuntimeError) kills the import. When upstream catches more,
    the hold-back (and this test) can go."""
    import importlib.util

    source = Path(importlib.util.find_spec("megatron.core.utils").origin).read_text()
    guards = _import_guards(source, "transformer_engine")
    assert guards and all(handlers == ["ImportError"] for handlers in guards), (
        f"{UPSTREAM}'s utils.py guards its Transformer Engine import with more than ImportError now: delete "
        "overrides/megatron_core/transformer_engine_import.py and its call in cli.py")


@pytest.fixture
def broken_package(tmp_path, monkeypatch):
    """A stand-in of a Transformer Engine whose core library does not load: importing it raises OSError."""
    package = tmp_path / "broken_te_standin"
    package.mkdir()
    (package / "__init__.py").write_text('raise OSError("libtransformer_engine.so: cannot open shared object file")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "broken_te_standin"
    from dapo_megatron.overrides.megatron_core.transformer_engine_import import HeldBack

    sys.meta_path[:] = [hook for hook in sys.meta_path if not isinstance(hook, HeldBack)]


def _megatron_style_import(name: str) -> str:
    """What megatron-core's guarded imports do: ``try: import <name> except ImportError: <absent>``, and the
    narrowest of them (tensor_parallel/random.py) ``except ModuleNotFoundError``."""
    import importlib

    try:
        importlib.import_module(name)
    except ModuleNotFoundError:
        return "absent"
    return "present"


def test_a_transformer_engine_that_does_not_load_is_held_back_naming_its_error(broken_package):
    from dapo_megatron.overrides.megatron_core.transformer_engine_import import hold_back_broken_transformer_engine

    with pytest.raises(OSError):  # control: megatron's `except ImportError` lets this through
        _megatron_style_import(broken_package)
    reason = hold_back_broken_transformer_engine(probed=(broken_package,), packages=(broken_package,))
    assert reason == ("Transformer Engine is installed but does not load (OSError: libtransformer_engine.so: cannot "
                      "open shared object file)")
    assert _megatron_style_import(broken_package) == "absent"
    assert _megatron_style_import(f"{broken_package}.pytorch") == "absent"
    with pytest.raises(ImportError, match="is held back: Transformer Engine is installed but does not load "
                                          r"\(OSError: libtransformer_engine.so"):
        __import__(broken_package)
    assert hold_back_broken_transformer_engine(probed=(broken_package,), packages=(broken_package,)) == reason
    assert _megatron_style_import("json") == "present"  # other packages are untouched
    assert hold_back_broken_transformer_engine(probed=("no_such_package_here",),
                                               packages=("no_such_package_here",)) is None  # absent: nothing to do


def test_the_backend_choice_names_the_error_of_a_held_back_transformer_engine(caplog):
    from dapo_megatron.backend_registry import select_backend, transformer_engine_problem
    from dapo_megatron.config import ConfigError
    from dapo_megatron.cuda.backend import CudaLocalBackend
    from dapo_megatron.overrides.megatron_core.transformer_engine_import import (
        TRANSFORMER_ENGINE_MODULES,
        HeldBack,
        hold_back,
    )

    hook = hold_back(TRANSFORMER_ENGINE_MODULES, "Transformer Engine is installed but does not load (OSError: x.so)")
    try:
        assert "does not load (OSError: x.so)" in transformer_engine_problem()
        with pytest.raises(ConfigError, match=r"model.kernels=transformer_engine needs Transformer Engine on CUDA, "
                                              r"and transformer_engine.pytorch does not import .*OSError: x.so"):
            select_backend("transformer_engine", cuda_available=True)
        with caplog.at_level("WARNING"):
            assert isinstance(select_backend("auto", cuda_available=True), CudaLocalBackend)
        assert "OSError: x.so" in caplog.text
    finally:
        sys.meta_path.remove(hook)
    assert not any(isinstance(h, HeldBack) for h in sys.meta_path)
    assert "is not installed" in transformer_engine_problem()  # control: this machine has no Transformer Engine


# ---- RouterReplay's queue for recomputation (overrides/megatron_core/router_replay.py)

def test_can_set_replay_target_go():
    """megatron's ``set_target_indices`` queues every target for REPLAY_BACKWARD until ``clear_indices``: without
    recomputation a replayed pass kept each micro-batch's int64 targets on the GPU to its end (issue 40.3)."""
    import torch
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from dapo_megatron.overrides.megatron_core.router_replay import set_replay_target

    upstream, fixed, recomputed = RouterReplay(), RouterReplay(), RouterReplay()
    try:
        for micro_batch in range(3):
            target = torch.full((4, 2), micro_batch, dtype=torch.long)
            upstream.set_target_indices(target)
            set_replay_target(fixed, target, kept_for_recompute=False)
            set_replay_target(recomputed, target, kept_for_recompute=True)
        assert len(upstream.replay_backward_list) == 3, (
            f"{UPSTREAM}'s RouterReplay no longer keeps every target for REPLAY_BACKWARD: delete "
            "overrides/megatron_core/router_replay.py (set_replay_target) and call set_target_indices")
        assert fixed.replay_backward_list == [] and int(fixed.target_topk_idx[0, 0]) == 2  # the current one only
        assert [int(t[0, 0]) for t in recomputed.replay_backward_list] == [0, 1, 2]  # for the recomputed forwards
    finally:
        for replay in (upstream, fixed, recomputed):
            RouterReplay.global_router_replay_instances.remove(replay)
