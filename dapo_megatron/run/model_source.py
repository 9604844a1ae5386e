"""Where the policy's first weights come from: always an HF folder, which the trainer loads like any user model.

``model.source = hf``: the user's folder (``model.hf_path``), e.g. Qwen2.5-32B, used as is.
``model.source = tiny``: ``<run_dir>/initial_model``, made once by :func:`dapo_megatron.tiny_model.prepare_tiny_model`
(rank 0 builds it, the other ranks wait; a resumed run finds it complete and reuses it).

:func:`check_model_folder` looks at a user's folder before anything is built from it (config and safetensors headers
only: seconds for a 32B model).
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from dapo_megatron.config import ConfigError, DAPOConfig
from dapo_megatron.hf_format import CONFIG_FILE, compare_shapes, list_tensors, load_hf_config
from dapo_megatron.policy.model_spec import ModelSpec, UnsupportedModelError, model_spec_from_hf
from dapo_megatron.policy.shapes import published_hf_config, published_name
from dapo_megatron.policy.weight_mapping import ShardGeometry, full_model_mappings, hf_shapes
from dapo_megatron.rank_zero import run_on_rank0
from dapo_megatron.tiny_model import prepare_tiny_model
from dapo_megatron.tiny_model.build import COMPLETE_MARKER
from dapo_megatron.user_errors import ModelFolderError


def tiny_model_dir(config: DAPOConfig) -> Path:
    return Path(config.trainer.run_dir) / "initial_model"


def initial_model_dir(config: DAPOConfig) -> Path:
    """The HF folder the run starts from, which must exist already (no collectives)."""
    if config.model.source == "hf":
        hf_dir = Path(config.model.hf_path)
        if not (hf_dir / CONFIG_FILE).exists():
            raise ConfigError(f"model.hf_path: {hf_dir} has no {CONFIG_FILE}")
        return hf_dir
    tiny_dir = tiny_model_dir(config)
    if not (tiny_dir / COMPLETE_MARKER).exists():
        raise ConfigError(f"model.source: the tiny model {tiny_dir} has not been prepared "
                          f"(`dapo-megatron prepare-tiny` or `dapo-megatron train` with this config makes it)")
    return tiny_dir


def prepare_initial_model(config: DAPOConfig) -> Path:
    """:func:`initial_model_dir`, made first when ``model.source = tiny``. Every rank calls it (after
    ``init_distributed`` when there are several): rank 0 prepares, the others wait, and a failure on rank 0 is raised
    on every rank."""
    if config.model.source == "tiny":
        run_on_rank0(lambda: prepare_tiny_model(config, tiny_model_dir(config)), what="preparing the tiny model")
    return initial_model_dir(config)


def load_tokenizer(config: DAPOConfig, model_dir: str | Path):
    """``model.tokenizer_path`` for a user's model when given; else the tokenizer in the model folder."""
    custom = config.model.tokenizer_path if config.model.source == "hf" else None
    path = Path(custom or model_dir)
    if _generic_and_not_byte_level(path):
        return PreTrainedTokenizerFast.from_pretrained(str(path))
    return AutoTokenizer.from_pretrained(str(path))


def _generic_and_not_byte_level(path: Path) -> bool:
    """Whether the folder's tokenizer was saved as the generic class (``TokenizersBackend``: built from a
    ``tokenizers`` object, as the tiny model's is) and is not byte-level. AutoTokenizer would load it as the
    config.json model type's class (Qwen2Tokenizer), whose byte-level pre-tokenizer drops what such a vocabulary
    spells as plain characters: the tiny model's "What is 6*7?\n" became "Whatis6*7?"."""
    try:
        saved = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
        pipeline = json.loads((path / "tokenizer.json").read_text())
    except (OSError, ValueError):
        return False
    return saved == "TokenizersBackend" and "ByteLevel" not in json.dumps(
        [pipeline.get("pre_tokenizer"), pipeline.get("decoder")])


def check_model_folder(model_dir: str | Path, *, tokenizer_path: str | None = None):
    """Raise a :class:`~dapo_megatron.user_errors.ModelFolderError` naming the folder (or file) unless ``model_dir``
    holds a config of a supported model, weights whose every file has a readable header that its file covers, every
    tensor that config implies with the shape it implies, and a tokenizer with a chat template (``tokenizer_path``
    when given). Returns the model's :class:`~dapo_megatron.policy.model.ModelSpec`.

    So a folder with only ``{"model_type": "qwen2"}`` in its config is refused before a 7B model (that config's
    defaults) is allocated, and a truncated shard is named before any weight is read."""

    model_dir = Path(model_dir)
    try:
        spec = model_spec_from_hf(load_hf_config(model_dir))
    except UnsupportedModelError as error:
        raise ModelFolderError(f"{model_dir / CONFIG_FILE}: {error}") from None
    stored = list_tensors(model_dir)
    geometry = ShardGeometry(spec, tensor_parallel=1)
    expected = {name: shape for mapping in full_model_mappings(spec)
                for name, shape in zip(mapping.hf_names, hf_shapes(mapping, geometry), strict=True)}
    mismatch = compare_shapes({name: tensor.shape for name, tensor in stored.items()}, expected,
                              where=lambda name: str(model_dir / stored[name].file),
                              ignore_unexpected=lambda name: True)
    if mismatch:
        raise ModelFolderError(mismatch.report(f"{model_dir} does not fit its {CONFIG_FILE}", max_names=8))
    tokenizer_dir = tokenizer_path or model_dir
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except (OSError, ValueError, TypeError) as error:
        raise ModelFolderError(f"{tokenizer_dir}: no tokenizer transformers can load ({error})") from None
    if tokenizer.chat_template is None:
        raise ModelFolderError(f"{tokenizer_dir}: the tokenizer has no chat template (transformers reads it from "
                               f"chat_template.jinja or tokenizer_config.json)")
    return spec


def _folder_spec(folder: Path) -> ModelSpec:
    """The spec of the model in ``folder``, its unsupported architecture the error `train` gives for it."""
    try:
        return model_spec_from_hf(load_hf_config(folder))
    except UnsupportedModelError as error:
        raise ModelFolderError(f"{folder / CONFIG_FILE}: {error}") from None


def model_spec_for_plan(config: DAPOConfig) -> tuple[ModelSpec, str]:
    """(the model's spec, where its shape came from) for ``dapo-megatron plan``: ``model.hf_path``'s
    ``config.json`` when that folder is here, else the published shape its folder is named after
    (:mod:`dapo_megatron.policy.shapes`; the 32B example points at a cluster path), or for ``model.source = tiny``
    the prepared tiny model's."""
    if config.model.source == "tiny":
        folder = Path(tiny_model_dir(config))
        if not (folder / "config.json").is_file():
            raise ConfigError(f"model.source: the tiny model's vocabulary comes from its tokenizer; run "
                              f"`dapo-megatron prepare-tiny` first (no {folder / 'config.json'})")
        return _folder_spec(folder), str(folder / "config.json")
    folder = Path(config.model.hf_path)
    if (folder / "config.json").is_file():
        return _folder_spec(folder), str(folder / "config.json")
    name = published_name(folder)
    if name is None:
        raise ConfigError(f"model.hf_path: {folder / 'config.json'} does not exist and the folder name is not one of "
                          f"the published shapes dapo_megatron.policy.shapes knows")
    return model_spec_from_hf(published_hf_config(name)), f"published {name} shape ({folder} is not on this machine)"
