"""Model files: the GGUF reader against gguf's own, and malformed files giving one clear error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from lucebox.engine.gguf_file import GGUFFile
from lucebox.engine.loader import load_model, read_model_config
from lucebox.errors import ModelFileError
from tests.fixtures.tiny_models import write_tiny_hf_folder

ROOT = Path(__file__).resolve().parents[1]


def same_as_gguf_reader(path: Path) -> None:
    ours = GGUFFile(path)
    ref = gguf.GGUFReader(path)
    for key, f in ref.fields.items():
        if not key.startswith("GGUF."):
            assert ours.fields[key] == f.contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.tensor_type == b.tensor_type and list(a.shape) == [int(d) for d in b.shape], a.name
        assert a.data.shape == b.data.shape and np.array_equal(np.asarray(a.data), np.asarray(b.data)), a.name


def test_reader_matches_gguf_reader_on_the_default_model(smollm2_path):
    same_as_gguf_reader(smollm2_path)


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_1", "Q5_0", "Q2_K", "Q4_K", "Q6_K"])
def test_reader_matches_gguf_reader_on_every_quant_type(tiny_gguf, qtype):
    same_as_gguf_reader(tiny_gguf("llama", qtype))


def copy_bytes(src: Path, dst: Path, data: bytes | None = None, size: int | None = None) -> Path:
    raw = src.read_bytes() if data is None else data
    dst.write_bytes(raw if size is None else raw[:size])
    return dst


@pytest.fixture
def tiny(tiny_gguf) -> Path:
    return tiny_gguf("llama", "Q8_0")


def test_truncated_file_is_refused(tiny, tmp_path):
    size = tiny.stat().st_size
    for cut in (10, 200, size // 2, size - 1):
        with pytest.raises(ModelFileError, match="truncated"):
            load_model(copy_bytes(tiny, tmp_path / "cut.gguf", size=cut), quiet=True)


def test_bad_magic_and_garbage_are_refused(tiny, tmp_path):
    raw = bytearray(tiny.read_bytes())
    raw[:4] = b"GGUX"
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        load_model(copy_bytes(tiny, tmp_path / "m.gguf", bytes(raw)), quiet=True)
    with pytest.raises(ModelFileError):
        load_model(copy_bytes(tiny, tmp_path / "g.gguf", b"GGUF" + bytes(range(256)) * 8), quiet=True)


def test_corrupt_header_is_refused(tiny, tmp_path):
    raw = bytearray(tiny.read_bytes())
    raw[16:24] = (10**12).to_bytes(8, "little")  # absurd metadata count
    with pytest.raises(ModelFileError):
        load_model(copy_bytes(tiny, tmp_path / "h.gguf", bytes(raw)), quiet=True)


def write_custom(path: Path, arch: str) -> Path:
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_head_count(2)
    w.add_context_length(64)
    w.add_feed_forward_length(64)
    w.add_tensor("token_embd.weight", np.zeros((16, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unknown_architecture_is_named(tmp_path):
    with pytest.raises(ModelFileError, match="unsupported architecture 'rwkv6'"):
        read_model_config(write_custom(tmp_path / "rwkv.gguf", "rwkv6"))


def test_unsupported_quant_type_is_named(tiny_gguf, tmp_path):
    # A valid llama file whose embedding is Q8_K, a type gguf.quants cannot dequantize.
    src = GGUFFile(tiny_gguf("llama", "F32"))
    w = gguf.GGUFWriter(tmp_path / "q8k.gguf", "llama")
    for key, value in src.fields.items():
        if key in ("general.architecture", "GGUF.version"):
            continue
        _add_field(w, key, value, src)
    for t in src.tensors:
        if t.name == "token_embd.weight":
            rows = t.numpy_shape[0]
            _, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_K]  # one 256-value block per row
            w.add_tensor(t.name, np.zeros((rows, size), np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q8_K)
        else:
            w.add_tensor(t.name, np.asarray(t.data).copy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError, match="unsupported quant type Q8_K"):
        load_model(tmp_path / "q8k.gguf", quiet=True)


def _add_field(w: gguf.GGUFWriter, key: str, value, src: GGUFFile) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value) if value >= 0 else w.add_int32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, list):
        w.add_array(key, value)


def test_hf_folder_errors_name_the_problem(tiny_hf_folder, tmp_path):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(tiny_hf_folder("qwen2", shards=2), folder)
    (folder / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(ModelFileError, match="unsupported architecture 'bert'"):
        load_model(folder, quiet=True)
    shutil.rmtree(folder)
    shutil.copytree(tiny_hf_folder("qwen2", shards=2), folder)
    shard = sorted(folder.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ModelFileError, match="safetensors"):
        load_model(folder, quiet=True)
    shard.unlink()
    with pytest.raises(ModelFileError, match="missing"):
        load_model(folder, quiet=True)


def run_cli(*args: str, env_home: Path | None = None) -> subprocess.CompletedProcess:
    import os

    env = dict(os.environ)
    if env_home is not None:
        env["LUCEBOX_HOME"] = str(env_home)
    return subprocess.run([sys.executable, "-m", "lucebox", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=300)


@pytest.mark.parametrize("make", ["truncated", "garbage", "missing", "bert_folder"])
def test_cli_reports_bad_model_in_one_line_with_exit_2(tmp_path, tiny_gguf, make):
    if make == "truncated":
        path = copy_bytes(tiny_gguf("qwen3", "Q4_0"), tmp_path / "t.gguf", size=5000)
    elif make == "garbage":
        path = copy_bytes(Path(__file__), tmp_path / "g.gguf")
    elif make == "missing":
        path = tmp_path / "nope.gguf"
    else:
        path = write_tiny_hf_folder(tmp_path / "f", "llama")
        (path / "config.json").write_text('{"model_type": "bert"}')
    done = run_cli("generate", "--model", str(path), "--prompt", "hi", "--max-tokens", "2")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lucebox: error: "), done.stderr
    assert "Traceback" not in done.stderr


def test_cli_pull_prints_the_path_last(smollm2_path):
    done = run_cli("pull", "smollm2", env_home=smollm2_path.parent.parent)
    assert done.returncode == 0
    assert done.stdout.strip().splitlines()[-1] == str(smollm2_path)


def test_cli_generate_matches_transformers_greedy(smollm2_path):
    """The issue's check: the chat-templated prompt, 24 greedy tokens, same tokens as transformers."""
    transformers = pytest.importorskip("transformers")
    import torch

    done = run_cli("generate", "--prompt", "What is the capital of France?", "--max-tokens", "24",
                   "--temperature", "0", "--show-ids", env_home=smollm2_path.parent.parent)
    assert done.returncode == 0, done.stderr
    ours = [int(x) for x in done.stderr.strip().splitlines()[-1].strip("[]").split(",")]
    tok = transformers.AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name,
                                                           dtype=torch.float32)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    ref = hf.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
    assert ours == ref
    assert "Paris" in done.stdout


def test_cli_rejects_bad_messages_json(smollm2_path):
    done = run_cli("generate", "--messages", "[{not json", env_home=smollm2_path.parent.parent)
    assert done.returncode == 2 and "not valid JSON" in done.stderr and "Traceback" not in done.stderr
