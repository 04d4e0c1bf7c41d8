"""transformers' own conversions of the real model files (SmolLM2, Gemma 3), made once per machine.

transformers converts a GGUF by dequantizing every tensor in numpy: ~45 s for Gemma 3 270M's weights and
~25 s for its 262K-token tokenizer on the CI machine, in every run. The converted model or tokenizer is saved
under $LUCEBOX_HOME/test-cache (only for files kept there, as the fetched models are), keyed by the file's name, size
and mtime and by the transformers version, and later runs load it in a second or two (a model's weights
memory-mapped, as the run that converted it does too).
It is still transformers' conversion of the same file, so the reference stays independent of Lucebox.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lucebox.fetch import lucebox_home


def _cached(path: Path, kind: str, convert: Callable[[], Any], load: Callable[[Path], Any],
            save: Callable[[Any, Path], None]) -> Any:
    import transformers

    if not path.resolve().is_relative_to(lucebox_home().resolve()):  # a test's own file: nothing to keep
        return convert()
    st = path.stat()
    folder = (lucebox_home() / "test-cache" /
              f"{path.name}-{st.st_size}-{st.st_mtime_ns}-transformers{transformers.__version__}-{kind}")
    if (folder / "complete").exists():
        try:
            return load(folder)
        except Exception:  # a damaged cache entry: convert again
            shutil.rmtree(folder, ignore_errors=True)
    obj = convert()
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        save(obj, tmp)
        (tmp / "complete").touch()
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
    except Exception:  # no room, or another run got there first: this run keeps its own conversion
        shutil.rmtree(tmp, ignore_errors=True)
        return obj
    del obj  # what later runs load (for a model: mapped, not held twice)
    return load(folder)


def _save_model(model: Any, folder: Path) -> None:
    """Config and fp32 weights (transformers will not `save_pretrained` a model it loaded from a GGUF)."""
    folder.mkdir(parents=True)
    model.config.save_pretrained(folder)
    torch.save(model.state_dict(), folder / "model.pt")


def _load_model(folder: Path) -> Any:
    """The weights memory-mapped and assigned, not copied: they stay page cache the kernel can reclaim, not a
    second anonymous copy beside the file's pages (two test workers share the machine's memory)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(folder))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(torch.load(folder / "model.pt", mmap=True, weights_only=True), assign=True)
    return model


def causal_lm(path: Path) -> Any:
    """AutoModelForCausalLM of GGUF `path` in fp32, eval mode."""
    import transformers

    convert = lambda: transformers.AutoModelForCausalLM.from_pretrained(  # noqa: E731
        str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return _cached(path, "model-pt", convert, _load_model, _save_model).eval()


def tokenizer(path: Path) -> Any:
    """AutoTokenizer of GGUF `path`."""
    import transformers

    auto = transformers.AutoTokenizer
    return _cached(path, "tokenizer", lambda: auto.from_pretrained(str(path.parent), gguf_file=path.name),
                   lambda folder: auto.from_pretrained(str(folder)), lambda tok, folder: tok.save_pretrained(folder))
