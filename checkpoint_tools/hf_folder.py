"""A Hugging Face model folder, checked from file headers only: which tensors it holds, and whether they fit the model.

A safetensors file is ``[8-byte little-endian header length N][N bytes of JSON header][data]``; the header maps each
tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` relative to the start of the data. Reading just
the headers (a few KB, never the weights) is enough to catch, before any process is started:

* a corrupted or truncated file — unparsable header, or a tensor whose bytes would lie past the end of the file or
  whose byte length is not ``numel × itemsize``;
* an index (``model.safetensors.index.json``) naming a file that is absent, or a tensor its file does not hold;
* tensors missing from or extra to what :mod:`dapo_megatron.policy.weight_mapping` expects for this config, and
  shape mismatches — all listed by name in one error.

Bit flips inside the data region cannot be detected: safetensors stores no checksum.

It also knows the *side files* a converted checkpoint carries along (config, generation config, tokenizer) so that
``<out>/hf/`` is enough to rebuild a complete HF folder later.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from checkpoint_tools.errors import ConversionError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"

# Everything besides the weights that an HF folder needs to be loaded and used for generation.
SIDE_FILES = (
    CONFIG_FILE,
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)

# safetensors dtype code → (bytes per element, torch dtype)
_DTYPES = {
    "F64": (8, torch.float64), "F32": (4, torch.float32), "F16": (2, torch.float16), "BF16": (2, torch.bfloat16),
    "I64": (8, torch.int64), "I32": (4, torch.int32), "I16": (2, torch.int16), "I8": (1, torch.int8),
    "U8": (1, torch.uint8), "BOOL": (1, torch.bool),
    "F8_E4M3": (1, torch.float8_e4m3fn), "F8_E5M2": (1, torch.float8_e5m2),
}
_MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as a safetensors header describes it."""

    name: str
    file: str  # file name inside the model folder
    dtype: str  # safetensors code, e.g. "F32", "BF16"
    shape: tuple[int, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype][1]


def read_safetensors_header(path: Path) -> dict[str, StoredTensor]:
    """The tensors a safetensors file declares, after checking the header against the file's size."""
    try:
        file_size = path.stat().st_size
        with open(path, "rb") as f:
            raw_length = f.read(8)
            if len(raw_length) < 8:
                raise ConversionError(f"{path} is corrupted: {file_size} bytes, too short for a safetensors header")
            header_length = int.from_bytes(raw_length, "little")
            if header_length > min(file_size - 8, _MAX_HEADER_BYTES):
                raise ConversionError(
                    f"{path} is corrupted: its header claims {header_length} bytes but the file has {file_size}"
                )
            header = json.loads(f.read(header_length))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConversionError(f"{path} is corrupted: the safetensors header is not valid JSON ({exc})") from None
    except OSError as exc:
        raise ConversionError(f"cannot read {path}: {exc}") from None
    if not isinstance(header, dict):
        raise ConversionError(f"{path} is corrupted: the safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    data_bytes = file_size - 8 - header_length
    tensors = {}
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ConversionError(f"{path} is corrupted: malformed header entry for {name!r}: {entry!r}") from None
        if dtype not in _DTYPES:
            raise ConversionError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
        expected = math.prod(shape) * _DTYPES[dtype][0]
        if not 0 <= begin <= end or end - begin != expected:
            raise ConversionError(
                f"{path} is corrupted: tensor {name!r} ({dtype} {list(shape)}) spans bytes [{begin}, {end}), "
                f"expected a span of {expected} bytes"
            )
        if end > data_bytes:
            raise ConversionError(
                f"{path} is truncated: tensor {name!r} ends at data byte {end} but the file holds only {data_bytes} "
                f"bytes of data"
            )
        tensors[name] = StoredTensor(name, path.name, dtype, shape)
    return tensors


def list_hf_tensors(model_dir: Path) -> dict[str, StoredTensor]:
    """Every tensor of the folder (through the index when there is one), with every file's header checked."""
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ConversionError(f"{index_path} is corrupted: no readable 'weight_map' ({exc!r})") from None
    elif (model_dir / SINGLE_FILE).is_file():
        weight_map = None
    else:
        raise ConversionError(f"{model_dir} has neither {INDEX_FILE} nor {SINGLE_FILE}: no weights to convert")

    if weight_map is None:
        return read_safetensors_header(model_dir / SINGLE_FILE)
    tensors: dict[str, StoredTensor] = {}
    by_file: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(file, []).append(name)
    for file, names in sorted(by_file.items()):
        path = model_dir / file
        if not path.is_file():
            raise ConversionError(f"{path} is listed in {INDEX_FILE} (for {names[0]!r} and {len(names) - 1} more) "
                                  f"but does not exist")
        in_file = read_safetensors_header(path)
        absent = [n for n in names if n not in in_file]
        if absent:
            raise ConversionError(f"{INDEX_FILE} places {absent} in {path}, which does not hold them")
        tensors.update({n: in_file[n] for n in names})
    return tensors


def _ignorable(name: str, tie_embeddings: bool) -> bool:
    """Stored tensors that are not weights of the model: RoPE buffers, and a tied model's copy of the embedding."""
    return name.endswith("rotary_emb.inv_freq") or (tie_embeddings and name == "lm_head.weight")


def check_hf_tensors(tensors: dict[str, StoredTensor], expected: dict[str, tuple[int, ...]], *,
                     tie_embeddings: bool, where: Path) -> None:
    """Exactly the ``expected`` names with the expected shapes, else one error listing every problem by name."""
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(n for n in set(tensors) - set(expected) if not _ignorable(n, tie_embeddings))
    wrong = [f"{n} in {tensors[n].file}: shape {list(tensors[n].shape)}, expected {list(shape)}"
             for n, shape in expected.items() if n in tensors and tensors[n].shape != shape]
    problems = ([f"missing tensors: {', '.join(missing)}"] if missing else []) + (
        [f"unexpected tensors: {', '.join(extra)}"] if extra else []) + (
        [f"shape mismatches: {'; '.join(wrong)}"] if wrong else [])
    if problems:
        raise ConversionError(f"{where} does not match its {CONFIG_FILE}: " + " | ".join(problems))


def weights_dtype(tensors: dict[str, StoredTensor], expected: dict[str, tuple[int, ...]]) -> torch.dtype:
    """The one dtype every weight is stored in (an error when they differ)."""
    dtypes = {tensors[n].torch_dtype for n in expected}
    if len(dtypes) != 1:
        raise ConversionError(f"the weights are stored in several dtypes ({sorted(map(str, dtypes))}): pass --dtype")
    return dtypes.pop()


def copy_side_files(src_dir: Path, dst_dir: Path) -> list[str]:
    """Copy the config, generation config and tokenizer files present in ``src_dir``; return their names."""
    dst_dir.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in SIDE_FILES:
        if (src_dir / name).is_file():
            shutil.copyfile(src_dir / name, dst_dir / name)
            copied.append(name)
    return copied


def load_config(config_dir: Path):
    """The ``transformers`` config of ``config_dir`` (local files only), as a :class:`ConversionError` if unreadable."""
    from transformers import AutoConfig

    if not (config_dir / CONFIG_FILE).is_file():
        raise ConversionError(f"{config_dir} has no {CONFIG_FILE}")
    try:
        return AutoConfig.from_pretrained(str(config_dir), local_files_only=True)
    except (ValueError, KeyError, OSError) as exc:
        raise ConversionError(f"{config_dir / CONFIG_FILE} cannot be read by transformers: {exc}") from None
