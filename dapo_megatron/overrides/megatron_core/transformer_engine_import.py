"""A Transformer Engine that is installed but does not load, kept away from megatron-core's own imports.

megatron-core 0.16.1 imports Transformer Engine when it is imported itself (``megatron/core/utils.py``: ``import
transformer_engine`` and ``import transformer_engine_torch``, the first of many such places), each import guarded by
``except ImportError``. A TE whose core library does not load raises something else: ``OSError`` for a missing or
mismatched ``libtransformer_engine.so`` / cuDNN, ``RuntimeError`` for an extension built against another torch. Those
pass the guards, so ``import megatron.core`` itself fails and ``dapo-megatron train`` ends in a traceback before a
backend is chosen (issue 40, item 9; tried on CPU with a stand-in ``transformer_engine`` raising OSError).

:func:`hold_back_broken_transformer_engine`, called by the command line before it imports a command (and so before
megatron-core), imports Transformer Engine once. When that raises anything but ``ImportError``, every later import
of a Transformer Engine module raises a ``ModuleNotFoundError`` naming the original error instead (an import hook,
:class:`HeldBack`; the narrowest of megatron's guards, ``tensor_parallel/random.py``'s, catches only that subclass of
ImportError): megatron's guards take it as "not installed", and the backend registry
(:func:`dapo_megatron.backend_registry.transformer_engine_problem`) reports the error when it falls back to
megatron's local layers, or refuses ``model.kernels: transformer_engine`` in one line.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

# Transformer Engine's import names: the package (its PyTorch layers are transformer_engine.pytorch) and its PyTorch
# extension, which megatron imports by this name.
TRANSFORMER_ENGINE_MODULES = ("transformer_engine", "transformer_engine_torch")
PROBED = ("transformer_engine", "transformer_engine_torch", "transformer_engine.pytorch")


class HeldBack(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """An import hook under which every module of ``packages`` (and their submodules) raises
    ModuleNotFoundError(reason)."""

    def __init__(self, packages: tuple[str, ...], reason: str) -> None:
        self.packages = packages
        self.reason = reason

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.packages:
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec):
        raise ModuleNotFoundError(f"{spec.name} is held back: {self.reason}", name=spec.name)

    def exec_module(self, module) -> None:  # never reached: create_module raises
        raise ModuleNotFoundError(self.reason)


def load_failure(modules: tuple[str, ...]) -> BaseException | None:
    """The first error other than ImportError that importing ``modules`` (in order, each that is installed) raises;
    None when they import or are merely missing (megatron's guards handle ImportError)."""
    for name in modules:
        top = name.split(".")[0]
        if importlib.util.find_spec(top) is None:
            continue
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        except Exception as error:  # noqa: BLE001 - the point: what megatron's `except ImportError` lets through
            return error
    return None


def hold_back(packages: tuple[str, ...], reason: str) -> HeldBack:
    """From now on, importing any module of ``packages`` raises ModuleNotFoundError(reason); what was imported of
    them is forgotten, so no import finds a half-loaded module. Returns the hook (at the front of ``sys.meta_path``)."""
    for name in [name for name in sys.modules if name.split(".")[0] in packages]:
        del sys.modules[name]
    hook = HeldBack(packages, reason)
    sys.meta_path.insert(0, hook)
    return hook


def hold_back_broken_transformer_engine(probed: tuple[str, ...] = PROBED,
                                        packages: tuple[str, ...] = TRANSFORMER_ENGINE_MODULES) -> str | None:
    """Before megatron-core is imported: when Transformer Engine is installed but raises something other than
    ImportError on import, hold it back (see the module docstring) and return what it raised; else None. Once per
    process (a hook already in place is kept)."""
    held = next((hook for hook in sys.meta_path if isinstance(hook, HeldBack) and hook.packages == packages), None)
    if held is not None:
        return held.reason
    error = load_failure(probed)
    if error is None:
        return None
    reason = f"Transformer Engine is installed but does not load ({type(error).__name__}: {error})"
    hold_back(packages, reason)
    return reason
