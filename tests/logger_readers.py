"""What a run's loggers wrote, read back: a W&B offline run file and an MLflow tracking store, as {step: {key: value}}.

A W&B offline run is ``run_dir/wandb/offline-run-*/run-*.wandb``: a 7-byte header (``:W&B``, magic, version) then
LevelDB-log records in 32 KiB blocks (each record: CRC32 u32, length u16, type u8 — full, first, middle, last — and
the bytes), every record one ``wandb_internal_pb2.Record``; history records hold the logged values as JSON.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _wandb_records(path: Path) -> list[bytes]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    records, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # the block's tail is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == FULL:
            records.append(chunk)
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            records.append(pending + chunk)
        else:  # zeros: the rest of the block is padding
            pos += -pos % BLOCK
    return records


def wandb_offline_history(run_dir: Path) -> dict[int, dict]:
    from wandb.proto import wandb_internal_pb2

    (path,) = Path(run_dir).glob("wandb/offline-run-*/run-*.wandb")
    history: dict[int, dict] = {}
    for raw in _wandb_records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            row = history.setdefault(record.history.step.num, {})
            for item in record.history.item:
                row[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return history


def mlflow_history(tracking_uri: str, run_id: str) -> dict[int, dict]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    history: dict[int, dict] = {}
    for key in client.get_run(run_id).data.metrics:
        for metric in client.get_metric_history(run_id, key):
            history.setdefault(metric.step, {})[key] = metric.value
    return history
