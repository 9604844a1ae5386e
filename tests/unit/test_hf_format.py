"""The HF-format package on its own: reading (header checks, sliced reads, streaming), writing (shards, names, index,
side files, atomic publish, memory), buckets, and the one mismatch report. No megatron, no processes."""

from __future__ import annotations

import json
import os
import weakref
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dapo_megatron.hf_format import (
    INDEX_FILE,
    HFFormatError,
    HFWeights,
    TensorMismatch,
    WrongShape,
    bucketed,
    checked_buckets,
    compare_shapes,
    copy_side_files,
    iter_tensors,
    list_tensors,
    write_hf_folder,
    write_shard,
)

TENSORS = {f"layer{i}.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4) + i for i in range(4)}  # 48 B


def _source_folder(tmp_path: Path) -> Path:
    """An HF-like folder: config, tokenizer files (chat_template.jinja included), old weights, an unrelated file."""
    folder = tmp_path / "src"
    folder.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_text("{}")
    (folder / "chat_template.jinja").write_text("{{ messages }}")
    (folder / "merges.txt").write_text("a b")
    (folder / "model.safetensors").write_bytes(b"old weights")
    (folder / "notes.txt").write_text("not a side file")
    return folder


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


# ------------------------------------------------------------------------------------------------------ the writer
def test_written_folder_has_hf_shard_names_index_and_side_files(tmp_path):
    out = write_hf_folder(tmp_path / "out", bucketed(TENSORS.items(), 100), side_files_from=_source_folder(tmp_path))
    names = sorted(p.name for p in out.iterdir())
    assert names == ["chat_template.jinja", "config.json", "generation_config.json", "merges.txt",
                     "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", INDEX_FILE,
                     "tokenizer.json", "tokenizer_config.json"]
    index = json.loads((out / INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == 4 * 48
    assert index["weight_map"] == {"layer0.weight": "model-00001-of-00002.safetensors",
                                   "layer1.weight": "model-00001-of-00002.safetensors",
                                   "layer2.weight": "model-00002-of-00002.safetensors",
                                   "layer3.weight": "model-00002-of-00002.safetensors"}
    read_back = {}
    for file in set(index["weight_map"].values()):  # the safetensors library reads what we wrote
        read_back.update(load_file(out / file))
    assert read_back.keys() == TENSORS.keys() and all(torch.equal(read_back[n], t) for n, t in TENSORS.items())
    assert dict(iter_tensors(out)).keys() == TENSORS.keys()  # and so does our reader, through the index
    assert _leftovers(tmp_path) == []


def test_every_dtype_round_trips_bit_exact(tmp_path):
    tensors = {str(dtype): torch.randn(5, 3).to(dtype) for dtype in
               (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn)}
    tensors["int"] = torch.arange(7)
    tensors["scalar"] = torch.tensor(2.5)
    out = write_hf_folder(tmp_path / "out", [list(tensors.items())])
    with safe_open(out / "model-00001-of-00001.safetensors", framework="pt") as f:
        for name, tensor in tensors.items():
            stored = f.get_tensor(name)
            assert stored.dtype == tensor.dtype and stored.shape == tensor.shape
            assert torch.equal(stored.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name


def test_existing_folder_is_replaced_only_when_asked(tmp_path):
    out = tmp_path / "out"
    write_hf_folder(out, [[("a", torch.zeros(2))]])
    with pytest.raises(FileExistsError, match="already exists"):
        write_hf_folder(out, [[("b", torch.ones(2))]])
    assert list_tensors(out).keys() == {"a"}
    write_hf_folder(out, [[("b", torch.ones(2))]], replace=True)
    assert list_tensors(out).keys() == {"b"} and _leftovers(tmp_path) == []


def test_a_failing_producer_leaves_no_folder(tmp_path):
    def producer():
        yield [("a", torch.zeros(2))]
        raise RuntimeError("the exporter broke")

    with pytest.raises(RuntimeError, match="exporter broke"):
        write_hf_folder(tmp_path / "out", producer())
    with pytest.raises(ValueError, match="no tensors"):
        write_hf_folder(tmp_path / "out", [])
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


def test_shard_writer_holds_one_tensor_at_a_time(tmp_path):
    alive: list[weakref.ref] = []

    def producer():
        for i in range(4):
            assert not [r for r in alive if r() is not None], f"a tensor was still held when tensor {i} was asked for"
            tensor = torch.full((3, 4), float(i))
            alive.append(weakref.ref(tensor))
            yield f"w{i}", tensor
            del tensor

    layout = [(f"w{i}", torch.empty(3, 4, device="meta")) for i in range(4)]  # planned ahead, no data
    shard = write_shard(tmp_path / "part.safetensors", layout, producer())
    assert shard.names == ("w0", "w1", "w2", "w3") and shard.nbytes == 4 * 48
    assert torch.equal(load_file(tmp_path / "part.safetensors")["w3"], torch.full((3, 4), 3.0))
    alive.clear()
    with pytest.raises(AssertionError, match="still held"):  # control: a consumer that keeps tensors is caught
        kept = list(producer())  # noqa: F841


def test_shard_writer_checks_the_tensors_against_the_plan(tmp_path):
    layout = [("a", torch.empty(2, device="meta")), ("b", torch.empty(2, device="meta"))]
    with pytest.raises(RuntimeError, match=r"got b \[2\] torch.float32 where part.safetensors is planned to hold a"):
        write_shard(tmp_path / "part.safetensors", layout, iter([("b", torch.zeros(2))]))
    with pytest.raises(RuntimeError, match="ended before b"):
        write_shard(tmp_path / "part.safetensors", layout, iter([("a", torch.zeros(2))]))
    with pytest.raises(RuntimeError, match=r"got a \[3\]"):
        write_shard(tmp_path / "part.safetensors", layout, iter([("a", torch.zeros(3))]))


def test_each_bucket_is_written_before_the_next_is_pulled(tmp_path):
    def reusing_producer():
        """Like an exporter reusing one buffer: pulling a bucket overwrites the previous bucket's tensors."""
        previous = None
        for bucket in bucketed(((n, t.clone()) for n, t in TENSORS.items()), 48):
            if previous is not None:
                for _, tensor in previous:
                    tensor.fill_(float("nan"))
            previous = bucket
            yield bucket

    out = write_hf_folder(tmp_path / "out", reusing_producer())
    assert all(torch.equal(t, TENSORS[n]) for n, t in iter_tensors(out))
    prefetched = list(reusing_producer())  # control: a consumer pulling ahead would see clobbered tensors
    assert torch.isnan(prefetched[0][0][1]).all()


def test_side_files_are_the_one_list(tmp_path):
    copied = copy_side_files(_source_folder(tmp_path), tmp_path / "dst")
    assert sorted(copied) == ["chat_template.jinja", "config.json", "generation_config.json", "merges.txt",
                              "tokenizer.json", "tokenizer_config.json"]
    assert sorted(p.name for p in (tmp_path / "dst").iterdir()) == sorted(copied)


# ------------------------------------------------------------------------------------------------------ the reader
def test_sliced_reads_return_exactly_the_slice(tmp_path):
    out = write_hf_folder(tmp_path / "out", [list(TENSORS.items())])
    with HFWeights(out) as weights:
        assert weights.tensors["layer2.weight"].shape == (3, 4)
        assert weights.where("layer2.weight") == str(out / "model-00001-of-00001.safetensors")
        assert torch.equal(weights.read("layer2.weight", dim=0, start=1, stop=3), TENSORS["layer2.weight"][1:3])
        assert torch.equal(weights.read("layer2.weight", dim=1, start=2, stop=4), TENSORS["layer2.weight"][:, 2:4])
        assert torch.equal(weights.read("layer2.weight"), TENSORS["layer2.weight"])
        with pytest.raises(HFFormatError, match="holds no tensor 'nope'"):
            weights.read("nope")


def test_truncated_or_corrupted_files_are_named_before_safetensors_reads_them(tmp_path):
    single = tmp_path / "single"
    single.mkdir()
    save_file(dict(TENSORS), single / "model.safetensors")
    assert dict(iter_tensors(single)).keys() == TENSORS.keys()  # control: the intact folder reads
    os.truncate(single / "model.safetensors", (single / "model.safetensors").stat().st_size - 10)
    with pytest.raises(HFFormatError, match=rf"{single / 'model.safetensors'} is truncated: tensor"):
        list(iter_tensors(single))
    with open(single / "model.safetensors", "r+b") as f:
        f.seek(8)
        f.write(b"\xff" * 16)
    with pytest.raises(HFFormatError, match="model.safetensors is corrupted"):
        HFWeights(single)
    (single / "model.safetensors").write_bytes(b"\x01")
    with pytest.raises(HFFormatError, match="too short for a safetensors header"):
        list_tensors(single)


def test_an_index_naming_absent_files_or_tensors_is_refused(tmp_path):
    out = write_hf_folder(tmp_path / "out", bucketed(TENSORS.items(), 100))
    index = json.loads((out / INDEX_FILE).read_text())
    index["weight_map"]["extra.weight"] = "model-00001-of-00002.safetensors"
    (out / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(HFFormatError, match=r"places \['extra.weight'\] in .*model-00001-of-00002.safetensors"):
        list_tensors(out)
    del index["weight_map"]["extra.weight"]
    (out / INDEX_FILE).write_text(json.dumps(index))
    (out / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(HFFormatError, match="model-00002-of-00002.safetensors is listed in"):
        list_tensors(out)
    with pytest.raises(HFFormatError, match=r"has no weights \(neither model.safetensors.index.json nor model"):
        list_tensors(tmp_path)


# ----------------------------------------------------------------------------------------------------- buckets
def test_buckets_respect_the_byte_limit_and_names_are_unique():
    tensors = [(f"w{i}", torch.zeros(10)) for i in range(5)]  # 40 bytes each
    assert [[n for n, _ in b] for b in bucketed(tensors, 100)] == [["w0", "w1"], ["w2", "w3"], ["w4"]]
    assert [len(b) for b in bucketed([("big", torch.zeros(100)), ("small", torch.zeros(1))], 8)] == [1, 1]
    with pytest.raises(ValueError, match="'a' appears twice"):
        list(bucketed([("a", torch.zeros(1)), ("a", torch.zeros(1))], 100))
    with pytest.raises(TypeError, match="'a' is a list"):
        list(bucketed([("a", [1.0])], 100))
    with pytest.raises(ValueError, match="bucket_bytes must be > 0"):
        list(bucketed(tensors, 0))


def test_checked_buckets_pass_buckets_through_as_given_one_at_a_time():
    pulled = []

    def producer():
        for i in range(3):
            pulled.append(i)
            yield [(f"w{i}a", torch.zeros(1)), (f"w{i}b", torch.zeros(1))]

    stream = checked_buckets(producer())
    first = next(stream)
    assert [n for n, _ in first] == ["w0a", "w0b"] and pulled == [0]  # not re-bucketed, nothing pulled ahead
    assert len(list(stream)) == 2
    with pytest.raises(ValueError, match="'w0a' appears twice"):
        list(checked_buckets([[("w0a", torch.zeros(1))], [("w0a", torch.zeros(1))]]))
    with pytest.raises(ValueError, match="holds no tensors"):
        list(checked_buckets([[], []]))


# ---------------------------------------------------------------------------------------------- the mismatch report
def test_mismatch_report_names_every_problem_on_its_own_line():
    stored = {"a": (2, 3), "b": (4,), "extra": (1,), "rotary_emb.inv_freq": (8,)}
    mismatch = compare_shapes(stored, {"a": (2, 3), "b": (5,), "c": (1,)}, where=lambda name: f"f-{name}",
                              ignore_unexpected=lambda name: name.endswith("inv_freq"))
    assert mismatch.report("folder X does not match its config.json").splitlines() == [
        "folder X does not match its config.json:",
        "  missing tensors: c",
        "  unexpected tensors: extra",
        "  shape mismatches: b in f-b: shape [4], expected [5]",
    ]
    assert not compare_shapes({"a": (1,)}, {"a": [1]})
    long = TensorMismatch(missing=[f"t{i}" for i in range(5)], other={"bad values": ["x: NaN"]},
                          wrong_shape=[WrongShape("emb", [100, 8], "[>=101, 8]")])
    assert long.report("model", max_names=2).splitlines()[1:] == [
        "  missing tensors: t0; t1; ... and 3 more",
        "  shape mismatches: emb: shape [100, 8], expected [>=101, 8]",
        "  bad values: x: NaN",
    ]
