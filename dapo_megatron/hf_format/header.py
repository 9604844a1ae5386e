"""The safetensors header: read and checked against the file it heads, or built for a file about to be written.

A safetensors file is ``[8-byte little-endian header length N][N bytes of JSON header][data]``; the header maps each
tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` relative to the start of the data (plus an
optional ``__metadata__``), padded with spaces; the data are the raw little-endian tensor bytes back to back.
Reading just the header (a few KB, never the weights) is enough to catch a corrupted or truncated file —
unparsable header, a tensor whose bytes would lie past the end of the file or whose byte length is not
``numel × itemsize`` — before any library maps it. Bit flips inside the data cannot be detected: safetensors stores
no checksum.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from dapo_megatron.hf_format.folder import HFFormatError

# safetensors dtype code → (bytes per element, torch dtype)
_DTYPES = {
    "F64": (8, torch.float64), "F32": (4, torch.float32), "F16": (2, torch.float16), "BF16": (2, torch.bfloat16),
    "I64": (8, torch.int64), "I32": (4, torch.int32), "I16": (2, torch.int16), "I8": (1, torch.int8),
    "U8": (1, torch.uint8), "BOOL": (1, torch.bool),
    "F8_E4M3": (1, torch.float8_e4m3fn), "F8_E5M2": (1, torch.float8_e5m2),
}
_CODES = {dtype: code for code, (_, dtype) in _DTYPES.items()}
_MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit
_HEADER_ALIGN = 8


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
                raise HFFormatError(f"{path} is corrupted: {file_size} bytes, too short for a safetensors header")
            header_length = int.from_bytes(raw_length, "little")
            if header_length > min(file_size - 8, _MAX_HEADER_BYTES):
                raise HFFormatError(
                    f"{path} is corrupted: its header claims {header_length} bytes but the file has {file_size}"
                )
            header = json.loads(f.read(header_length))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HFFormatError(f"{path} is corrupted: the safetensors header is not valid JSON ({exc})") from None
    except OSError as exc:
        raise HFFormatError(f"cannot read {path}: {exc}") from None
    if not isinstance(header, dict):
        raise HFFormatError(f"{path} is corrupted: the safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    data_bytes = file_size - 8 - header_length
    tensors = {}
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise HFFormatError(f"{path} is corrupted: malformed header entry for {name!r}: {entry!r}") from None
        if dtype not in _DTYPES:
            raise HFFormatError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
        expected = math.prod(shape) * _DTYPES[dtype][0]
        if not 0 <= begin <= end or end - begin != expected:
            raise HFFormatError(
                f"{path} is corrupted: tensor {name!r} ({dtype} {list(shape)}) spans bytes [{begin}, {end}), "
                f"expected a span of {expected} bytes"
            )
        if end > data_bytes:
            raise HFFormatError(
                f"{path} is truncated: tensor {name!r} ends at data byte {end} but the file holds only {data_bytes} "
                f"bytes of data"
            )
        tensors[name] = StoredTensor(name, path.name, dtype, shape)
    return tensors


def encode_safetensors_header(layout: Sequence[tuple[str, torch.Tensor]]) -> bytes:
    """Length prefix + header for a file holding ``layout``'s tensors in order (only names, shapes and dtypes are
    read: ``meta`` tensors do)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, tensor in layout:
        if tensor.dtype not in _CODES:
            raise ValueError(f"{name}: dtype {tensor.dtype} cannot be written as safetensors ({sorted(_DTYPES)})")
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _CODES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % _HEADER_ALIGN)
    return len(encoded).to_bytes(8, "little") + encoded
