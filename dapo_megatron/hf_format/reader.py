"""Reading the weights of a Hugging Face folder: a single ``model.safetensors`` or shards named by
``model.safetensors.index.json``.

Every file's header is checked (:mod:`.header`) before any file is opened for reading, so a truncated or corrupted
file, or an index naming an absent file or a tensor its file does not hold, is one :class:`HFFormatError` naming the
file — never an error from deep inside the safetensors library. Then either only the slices a rank needs are read
(:class:`HFWeights`: memory-mapped, only those bytes are touched) or every tensor is streamed one at a time
(:func:`iter_tensors`).
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open

from dapo_megatron.hf_format.folder import INDEX_FILE, SINGLE_FILE, HFFormatError
from dapo_megatron.hf_format.header import StoredTensor, read_safetensors_header


def list_tensors(model_dir: str | Path) -> dict[str, StoredTensor]:
    """Every tensor of the folder (through the index when there is one), with every file's header checked."""
    model_dir = Path(model_dir)
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError(f"weight_map is a {type(weight_map).__name__}")
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise HFFormatError(f"{index_path} is corrupted: no readable 'weight_map' ({exc!r})") from None
    elif (model_dir / SINGLE_FILE).is_file():
        return read_safetensors_header(model_dir / SINGLE_FILE)
    else:
        raise HFFormatError(f"{model_dir} has no weights (neither {INDEX_FILE} nor {SINGLE_FILE})")

    tensors: dict[str, StoredTensor] = {}
    by_file: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(file, []).append(name)
    for file, names in sorted(by_file.items()):
        path = model_dir / file
        if not path.is_file():
            raise HFFormatError(f"{path} is listed in {INDEX_FILE} (for {names[0]!r} and {len(names) - 1} more) "
                                f"but does not exist")
        in_file = read_safetensors_header(path)
        absent = [n for n in names if n not in in_file]
        if absent:
            raise HFFormatError(f"{INDEX_FILE} places {absent} in {path}, which does not hold them")
        tensors.update({n: in_file[n] for n in names})
    return tensors


class HFWeights:
    """Read access to the weights of an HF folder; use as a context manager (keeps the files it read open).

    ``tensors`` maps every name to its header entry (file, dtype, shape), checked on construction.
    """

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self.tensors = list_tensors(self.model_dir)
        self._stack = ExitStack()
        self._handles: dict[str, Any] = {}

    def __enter__(self) -> "HFWeights":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
        self._handles.clear()

    def _handle(self, name: str):
        if name not in self.tensors:
            raise HFFormatError(f"{self.model_dir} holds no tensor {name!r}")
        file = self.tensors[name].file
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(safe_open(self.model_dir / file, framework="pt"))
        return self._handles[file]

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Tensor ``name``, or only rows (``dim=0``) / columns (``dim=1``) ``start:stop`` of it, reading only
        those bytes."""
        handle = self._handle(name)
        if dim is None:
            return handle.get_tensor(name)
        window = slice(start, stop)
        if dim == 0:
            return handle.get_slice(name)[window]
        if dim == 1:
            return handle.get_slice(name)[:, window]
        raise ValueError(f"sliced reads are along dim 0 or 1, got dim={dim} for {name!r}")

    def where(self, name: str) -> str:
        """The file holding ``name``, for error messages."""
        return str(self.model_dir / self.tensors[name].file)


def iter_tensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every ``(name, tensor)`` of the folder, file by file, one tensor in memory at a time."""
    with HFWeights(model_dir) as weights:
        for name in weights.tensors:
            yield name, weights.read(name)
