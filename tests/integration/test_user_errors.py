"""Bad input, tried as a user would (``dapo-megatron train examples/tiny_cpu.yaml warm_start.enabled=false`` plus one
bad override each): one line ``<kind> error: <message>`` naming the culprit, no traceback, the kind's exit code
(dapo_megatron/user_errors.py), and nothing expensive built first. The launch paths (torchrun, srun) are in
tests/integration/test_user_errors_launchers.py. Each case is one CLI process (~10 s of imports on a loaded 2-core
machine): three stay in the fast set, the rest are marked slow."""

from __future__ import annotations

import http.server
import json
import resource
import subprocess
import threading
from pathlib import Path

import pytest
from cli_runs import TINY, run_cli

from dapo_megatron.user_errors import EXIT_CODES

SMALL = ["warm_start.enabled=false", "data.synthetic.num_train=200", "data.synthetic.num_heldout=8",
         "model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.intermediate_size=64"]


def assert_one_line_error(result: subprocess.CompletedProcess, kind: str, message: str) -> str:
    """Exit code of ``kind``; stderr ends with the one line ``<kind> error: ...message...`` (and only indented
    details after it); no other error line, no traceback. Returns the line."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == EXIT_CODES[kind], (result.returncode, result.stderr[-3000:])
    errors = [i for i, line in enumerate(lines) if line.startswith(f"{kind} error: ")]
    assert len(errors) == 1 and message in lines[errors[0]], result.stderr[-3000:]
    assert all(line.startswith("  ") for line in lines[errors[0] + 1:]), result.stderr[-3000:]
    assert sum(" error: " in line for line in lines) == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "[rank0]" not in result.stderr, result.stderr[-3000:]
    return lines[errors[0]]


def copy_model(model_dir: Path, into: Path, *, without: tuple[str, ...] = ()) -> Path:
    into.mkdir()
    for file in model_dir.iterdir():
        if file.name not in without:
            (into / file.name).write_bytes(file.read_bytes())
    return into


def train(run_dir: Path, *overrides: str, resume: bool = False) -> subprocess.CompletedProcess:
    return run_cli("train", str(TINY), *SMALL, f"trainer.run_dir={run_dir}", *overrides,
                   *(["--resume"] if resume else []))


# ---- the model folder ----------------------------------------------------------------------------------------------
def test_config_without_weights_is_refused_before_a_model_is_built(tmp_path):
    """{"model_type": "qwen2"} alone describes Qwen2-7B (the config's defaults): 28 GB in fp32, never allocated."""
    folder = tmp_path / "just_a_config"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    result = train(tmp_path / "run", "model.source=hf", f"model.hf_path={folder}")
    assert_one_line_error(result, "model", f"{folder} has no weights")
    peak_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    assert peak_gib < 4, f"the refused run peaked at {peak_gib:.1f} GiB"


def _sparse_model_folder(folder: Path, config: dict, tokenizer_from: Path) -> Path:
    """A model folder whose weights file has a true header for every tensor ``config`` implies and a data region of
    the right size that is a hole in the file (no disk used): it passes every header check, and is never read."""
    import torch
    from transformers import Qwen2Config

    from dapo_megatron.hf_format.header import encode_safetensors_header
    from dapo_megatron.policy.model_spec import model_spec_from_hf
    from dapo_megatron.policy.weight_mapping import ShardGeometry, full_model_mappings, hf_shapes

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    spec = model_spec_from_hf(Qwen2Config(**{k: v for k, v in config.items() if k != "model_type"}))
    layout = [(name, torch.empty(shape, dtype=torch.float32, device="meta"))
              for mapping in full_model_mappings(spec)
              for name, shape in zip(mapping.hf_names, hf_shapes(mapping, ShardGeometry(spec, 1)), strict=True)]
    header = encode_safetensors_header(layout)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(header)
        f.truncate(len(header) + sum(t.numel() * 4 for _, t in layout))
    for file in tokenizer_from.iterdir():
        if "token" in file.name or file.name.startswith("chat_template"):
            (folder / file.name).write_bytes(file.read_bytes())
    return folder


def test_model_too_large_for_this_machine_is_refused_naming_both_numbers(tmp_path, model_dir):
    """A complete-looking Qwen2-7B folder (the config's defaults; sparse weights) trained in fp32 on this CPU host:
    refused with the estimate and the host's memory, before any weight is read or any model built."""
    folder = _sparse_model_folder(tmp_path / "qwen2_7b_shape", {"model_type": "qwen2"}, model_dir)
    result = train(tmp_path / "run", "model.source=hf", f"model.hf_path={folder}", "model.precision=fp32")
    line = assert_one_line_error(result, "config", "needs an estimated")
    assert "GiB" in line.split("needs an estimated")[1] and "this host has" in line, line
    peak_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    assert peak_gib < 4, f"the refused run peaked at {peak_gib:.1f} GiB"


def test_training_memory_check_compares_the_estimate_with_what_is_there():
    """The decision itself, with the available memory given: the same model passes with room and is refused
    without; on CPU the trainer ranks of this host share it."""
    from dapo_megatron.config import ConfigError, load_config
    from dapo_megatron.policy.model_spec import model_spec_from_hf
    from dapo_megatron.policy.shapes import published_hf_config
    from dapo_megatron.run.input_checks import check_training_memory

    config = load_config(TINY, ["model.source=hf", "model.hf_path=/models/Qwen2.5-0.5B", "model.precision=bf16"])
    spec = model_spec_from_hf(published_hf_config("Qwen2.5-0.5B"))
    check_training_memory(config, spec, world_size=1, fused_attention=False, available=(10**12, "a big host"))
    with pytest.raises(ConfigError, match=r"needs an estimated [\d.]+ GiB .* but a small host has 1\.0 GiB"):
        check_training_memory(config, spec, world_size=1, fused_attention=False, available=(2**30, "a small host"))


@pytest.mark.slow
def test_folder_whose_weights_were_removed(tmp_path, model_dir):
    folder = copy_model(model_dir, tmp_path / "no_weights", without=("model.safetensors",))
    assert_one_line_error(train(tmp_path / "run", "model.source=hf", f"model.hf_path={folder}"),
                          "model", f"{folder} has no weights")


@pytest.mark.slow
def test_truncated_safetensors_names_the_file(tmp_path, model_dir):
    folder = copy_model(model_dir, tmp_path / "truncated")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a download cut half-way
    assert_one_line_error(train(tmp_path / "run", "model.source=hf", f"model.hf_path={folder}"),
                          "model", f"{weights} is truncated: tensor")


@pytest.mark.slow
def test_weights_that_do_not_fit_the_config(tmp_path, model_dir):
    folder = copy_model(model_dir, tmp_path / "other_config")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 2 * config["intermediate_size"]}))
    result = train(tmp_path / "run", "model.source=hf", f"model.hf_path={folder}")
    assert_one_line_error(result, "model", f"{folder} does not fit its config.json")
    assert "  shape mismatches: model.layers.0.mlp.gate_proj.weight" in result.stderr
    assert f"model.layers.0.mlp.down_proj.weight in {folder / 'model.safetensors'}: shape [64, 128], " \
           f"expected [64, 256]" in result.stderr


# ---- data ----------------------------------------------------------------------------------------------------------
def test_missing_data_file(tmp_path):
    missing = tmp_path / "nowhere" / "train.jsonl"
    result = train(tmp_path / "run", "data.source=dapo_math", f"data.train_files=[{missing}]")
    assert_one_line_error(result, "data", f"{missing}: no such data file")
    assert not (tmp_path / "run" / "initial_model").exists()  # checked before the tiny model was made


@pytest.mark.slow
def test_malformed_jsonl_row_names_file_and_line(tmp_path):
    from dapo_megatron.data.fixtures import DAPO_MATH_FIXTURE

    data = tmp_path / "train.jsonl"
    good = Path(DAPO_MATH_FIXTURE).read_text().splitlines()[0]
    data.write_text(f"{good}\n{{\"data_source\": \"math_dapo\", \"prompt\": \n")
    result = train(tmp_path / "run", "data.source=dapo_math", f"data.train_files=[{data}]")
    assert_one_line_error(result, "data", f"{data} (line 2): row 1: field '<json>': not valid JSON")


# ---- checkpoints ---------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_eval_of_a_path_that_is_not_a_checkpoint(tmp_path, model_dir):
    assert_one_line_error(run_cli("eval", str(TINY), *SMALL, "--ckpt", str(tmp_path / "missing")),
                          "checkpoint", f"--ckpt {tmp_path / 'missing'}: no such directory")
    result = run_cli("eval", str(TINY), *SMALL, "--ckpt", str(model_dir))  # an HF folder, not a checkpoint
    assert_one_line_error(result, "checkpoint", f"--ckpt {model_dir}: no model/ folder")


@pytest.mark.slow
def test_resume_from_a_damaged_checkpoint(tmp_path):
    damaged = tmp_path / "run" / "checkpoints" / "step_000002"
    (damaged / "model").mkdir(parents=True)
    (damaged / "COMPLETE").write_text("2\n")  # marked complete, but the files are gone (a bad copy)
    result = train(tmp_path / "run", resume=True)
    assert_one_line_error(result, "checkpoint", f"--resume: {damaged} is marked complete but lacks "
                                                f"model/metadata.json, optimizer/metadata.json, trainer_state.pt")


# ---- servers and config ----------------------------------------------------------------------------------------------
class _NotSGLang(http.server.BaseHTTPRequestHandler):
    """Another program on the port the user gave: it answers every request with a web page."""

    def _page(self):
        body = b"<html><body>hello from some other web server</body></html>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _page

    def log_message(self, *args):
        pass


@pytest.mark.slow
def test_server_that_answers_garbage(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotSGLang)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        result = train(tmp_path / "run", "rollout.engine=sglang", f'rollout.sglang.urls=["{url}"]')
    finally:
        server.shutdown()
    assert_one_line_error(result, "server", f"GET {url}/model_info answered '<html><body>hello from some other web "
                                            f"server</body></html>', not a JSON object with 'weight_version'")


def test_config_error(tmp_path):
    assert_one_line_error(train(tmp_path / "run", "rollout.n_samples=many"), "config",
                          "rollout.n_samples: expected an integer, got 'many'")


@pytest.mark.slow
def test_a_bug_keeps_its_traceback(tmp_path):
    """The control: an error that is not bad input (here the run directory's parent is a file, which the CLI does
    not check up front) is reported with its traceback and exit code 1, not as a user error."""
    blocker = tmp_path / "a_file"
    blocker.write_text("in the way\n")
    result = train(blocker / "run")
    assert result.returncode == 1 and "Traceback" in result.stderr, result.stderr[-2000:]
