"""Hugging Face model folders: reading, writing and checking them, and the buckets weights travel in.

The one home of HF-format I/O (no megatron here; ``transformers`` only to read a config):

* :mod:`.folder` — file names (index, single file, config), the side files that travel with weights, the error;
* :mod:`.header` — safetensors headers, read and checked against their file, or built for a file to write;
* :mod:`.reader` — the tensors of a folder, sliced reads of only what a rank needs, streaming every tensor;
* :mod:`.writer` — sharded safetensors streamed one tensor at a time, HF shard names + index, atomic publish;
* :mod:`.buckets` — grouping ``(name, tensor)`` pairs into buckets of bounded size, once, where they are made;
* :mod:`.mismatch` — the one "missing / unexpected / wrong shape" report.
"""

from dapo_megatron.hf_format.buckets import Bucket, BucketWithCopies, bucketed, checked_buckets, nbytes
from dapo_megatron.hf_format.folder import (
    CONFIG_FILE,
    INDEX_FILE,
    SIDE_FILES,
    SINGLE_FILE,
    HFFormatError,
    copy_side_files,
    load_hf_config,
)
from dapo_megatron.hf_format.header import StoredTensor, encode_safetensors_header, read_safetensors_header
from dapo_megatron.hf_format.mismatch import TensorMismatch, WrongShape, compare_shapes
from dapo_megatron.hf_format.reader import HFWeights, iter_tensors, list_tensors
from dapo_megatron.hf_format.writer import (
    WrittenShard,
    discard,
    name_shards,
    publish,
    staging_dir,
    write_hf_folder,
    write_shard,
)

__all__ = [
    "Bucket", "BucketWithCopies", "bucketed", "checked_buckets", "nbytes",
    "CONFIG_FILE", "INDEX_FILE", "SIDE_FILES", "SINGLE_FILE", "HFFormatError", "copy_side_files", "load_hf_config",
    "StoredTensor", "encode_safetensors_header", "read_safetensors_header",
    "TensorMismatch", "WrongShape", "compare_shapes",
    "HFWeights", "iter_tensors", "list_tensors",
    "WrittenShard", "discard", "name_shards", "publish", "staging_dir", "write_hf_folder", "write_shard",
]
