"""Load a model from a GGUF file or a Hugging Face folder into a runnable form."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lucebox import heap
from lucebox.engine.models import DecoderModel
from lucebox.engine.models.config import HYBRID_ARCHS, ModelConfig
from lucebox.engine.models.qwen35 import Qwen35Model
from lucebox.engine.tokenizer import Tokenizer, tokenizer_from_gguf, tokenizer_from_hf_dir
from lucebox.engine.weights import gguf_loader, hf_loader
from lucebox.engine.weights.config_check import describe
from lucebox.errors import ModelFileError
from lucebox.progress import Progress

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """Everything the engine needs from a model file."""

    path: Path
    format: str  # "gguf" | "hf"
    config: ModelConfig
    model: DecoderModel
    tokenizer: Tokenizer
    chat_template: str | None  # GGUF tokenizer.chat_template or chat_template.jinja; None if absent
    tokenizer_config: dict[str, Any] | None  # HF folders only
    quant: str  # dominant weight type in the file, e.g. "Q4_1", "BF16"
    dtype: torch.dtype
    device: torch.device


def read_model_config(path: Path) -> ModelConfig:
    """The ModelConfig alone (cheap: metadata only)."""
    path = Path(path)
    if path.is_dir():
        return hf_loader.hf_config(path)
    return gguf_loader.gguf_config(gguf_loader.open_gguf(path), path)


def load_model(
    path: Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    quiet: bool = False,
    weights: str = "auto",
    cap_bytes: int | None = None,
) -> LoadedModel:
    """Read config, weights and tokenizer; weights land on `device` in `dtype` (GGUF quant blocks held as
    `weights` says: auto | both | quantized | dense, see gguf_loader.iter_gguf_tensors; `cap_bytes` is the
    --gpu-memory cap that auto weighs against)."""
    path = Path(path)
    device = torch.device(device)
    start = time.monotonic()
    if path.is_dir():
        cfg = hf_loader.hf_config(path)
        tokenizer = tokenizer_from_hf_dir(path)
        tensors = hf_loader.iter_hf_tensors(path, cfg, dtype, device)
        n_tensors = hf_loader.count_tensors(path)
        tok_cfg_path = path / "tokenizer_config.json"
        tok_cfg = hf_loader.read_json(tok_cfg_path) if tok_cfg_path.exists() else None
        if tok_cfg is not None and not isinstance(tok_cfg, dict):
            raise ModelFileError(f"{tok_cfg_path} holds {describe(tok_cfg)}, not an object")
        template = _hf_chat_template(path)
        fmt, quant = "hf", _hf_dtype_name(path)
    elif path.exists():
        reader = gguf_loader.open_gguf(path)
        cfg = gguf_loader.gguf_config(reader, path)
        gguf_loader.check_quant_types(reader, path)
        tokenizer = tokenizer_from_gguf(reader)
        tensors = gguf_loader.iter_gguf_tensors(reader, cfg, dtype, device, weights, cap_bytes)
        n_tensors = len(reader.tensors)
        template = gguf_loader.field(reader, "tokenizer.chat_template")
        if template is not None and not isinstance(template, str):
            raise ModelFileError(f"{path}: tokenizer.chat_template is {describe(template)}, not a template text")
        tok_cfg = None
        fmt, quant = "gguf", gguf_loader.dominant_quant(reader)
    else:
        raise ModelFileError(f"{path}: no such file or folder")

    model = build_model(cfg, tensors, n_tensors, device, path, quiet)
    heap.trim()  # the load's freed temporaries (dequantized and unfused weights): ~0.28 GB for SmolLM2 on CPU
    if not quiet:
        log.info(
            "loaded %s (%s, %s, %d layers, %.0fM params) on %s as %s in %.1fs",
            cfg.name, cfg.arch, quant, cfg.num_layers, cfg.n_params() / 1e6, device,
            str(dtype).removeprefix("torch."), time.monotonic() - start,
        )
    return LoadedModel(path, fmt, cfg, model, tokenizer, template, tok_cfg, quant, dtype, device)


def build_model(
    cfg: ModelConfig,
    tensors: Any,
    n_tensors: int,
    device: torch.device,
    path: Path,
    quiet: bool,
) -> DecoderModel:
    """Create the module on the meta device and assign the loaded tensors."""
    with torch.device("meta"):
        model = Qwen35Model(cfg) if cfg.arch in HYBRID_ARCHS else DecoderModel(cfg)
    expected = set(model.state_dict().keys())
    state: dict[str, torch.Tensor] = {}
    freq_factors = None
    progress = Progress(f"load {path.name}", total=n_tensors, unit="tensors", quiet=quiet)
    for name, tensor in tensors:
        progress.advance()
        if name == "rope_freqs.weight":
            freq_factors = tensor.float().cpu()
        elif name in expected:
            want = model.get_parameter(name).shape
            if tuple(tensor.shape) != tuple(want):
                raise ModelFileError(f"{path}: tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(want)}")
            state[name] = tensor
    progress.close()
    missing = sorted(expected - state.keys())
    if missing:
        more = f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelFileError(f"{path}: missing tensor {missing[0]}{more}")
    model.load_state_dict(state, assign=True, strict=True)
    model.finalize(device, freq_factors)
    model.eval().requires_grad_(False)
    return model


def _hf_dtype_name(folder: Path) -> str:
    torch_dtype = hf_loader.read_json(folder / "config.json").get("torch_dtype") or "unknown"
    return str(torch_dtype).upper().replace("FLOAT", "F").replace("BF", "BF")


def _hf_chat_template(folder: Path) -> str | None:
    """transformers >= 4.43 may save the template beside tokenizer_config.json."""
    jinja = folder / "chat_template.jinja"
    return jinja.read_text(encoding="utf-8") if jinja.exists() else None
