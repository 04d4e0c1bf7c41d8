"""Model files: the GGUF reader against gguf's own, and malformed files giving one clear error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from lucebox import procs
from lucebox.engine.weights.gguf_file import GGUFFile
from lucebox.engine.weights.loader import load_model, read_model_config
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
    return procs.run([sys.executable, "-m", "lucebox", *args], capture_output=True, text=True, cwd=ROOT,
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
    pytest.importorskip("transformers")
    from tests import hf_reference

    done = run_cli("generate", "--prompt", "What is the capital of France?", "--max-tokens", "24",
                   "--temperature", "0", "--show-ids", env_home=smollm2_path.parent.parent)
    assert done.returncode == 0, done.stderr
    ours = [int(x) for x in done.stderr.strip().splitlines()[-1].strip("[]").split(",")]
    tok, hf = hf_reference.tokenizer(smollm2_path), hf_reference.causal_lm(smollm2_path)  # transformers' conversion
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    ref = hf.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
    assert ours == ref
    assert "Paris" in done.stdout


def test_cli_rejects_bad_messages_json(smollm2_path):
    done = run_cli("generate", "--messages", "[{not json", env_home=smollm2_path.parent.parent)
    assert done.returncode == 2 and "not valid JSON" in done.stderr and "Traceback" not in done.stderr


# ---------------------------------------------------------------------------
# Malformed metadata: one line naming the key and its value, checked before anything is allocated


def rewrite_gguf(src: Path, dst: Path, changes: dict[str, Any]) -> Path:
    """A copy of the F32 GGUF `src` with metadata keys set (typed as given) or, for value DROP, removed."""
    f = GGUFFile(src)
    w = gguf.GGUFWriter(dst, f.fields["general.architecture"])  # writes general.architecture itself
    for key, value in {**f.fields, **changes}.items():
        if key != "general.architecture" and value is not DROP:
            _add_field(w, key, value, f)
    for t in f.tensors:
        w.add_tensor(t.name, np.asarray(t.data).copy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


DROP = object()
BAD_METADATA = {  # case: (metadata changes, what the one-line error says)
    "embedding_length_missing": ({"llama.embedding_length": DROP}, "llama.embedding_length is missing"),
    "embedding_length_string": ({"llama.embedding_length": "64"},
                                "llama.embedding_length is the text '64', not a whole number"),
    "block_count_missing": ({"llama.block_count": DROP}, "llama.block_count is missing"),
    "block_count_0": ({"llama.block_count": 0}, "llama.block_count is 0; it must be from 1 to 1024"),
    "block_count_2_31": ({"llama.block_count": 2**31}, "llama.block_count is 2147483648; it must be from 1 to"),
    "head_count_0": ({"llama.attention.head_count": 0}, "llama.attention.head_count is 0; it must be from 1"),
    "head_count_kv_0": ({"llama.attention.head_count_kv": 0}, "llama.attention.head_count_kv is 0; it must be"),
    "alignment_list": ({"general.alignment": [1, 2]},
                       "general.alignment is a list of 2 items; it must be a power of two"),
    "tokens_number": ({"tokenizer.ggml.tokens": 5}, "tokenizer.ggml.tokens is the number 5, not a list"),
    "chat_template_number": ({"tokenizer.chat_template": 7}, "tokenizer.chat_template is the number 7, not a"),
    "rms_eps_string": ({"llama.attention.layer_norm_rms_epsilon": "x"},
                       "llama.attention.layer_norm_rms_epsilon is the text 'x', not a number"),
    "rms_eps_0": ({"llama.attention.layer_norm_rms_epsilon": 0.0},
                  "llama.attention.layer_norm_rms_epsilon is 0.0; it must be above 0"),
    "kv_heads_not_dividing": ({"llama.attention.head_count_kv": 3}, "attention heads cannot share 3"),
}


@pytest.fixture(scope="module")
def bad_gguf(tiny_gguf, tmp_path_factory):
    """Factory: the F32 tiny llama GGUF with one BAD_METADATA case applied (n_tensors_2_63: the header count)."""
    src = tiny_gguf("llama", "F32")
    folder = tmp_path_factory.mktemp("bad-gguf")

    def make(case: str) -> Path:
        if case == "n_tensors_2_63":
            raw = bytearray(src.read_bytes())
            raw[8:16] = (2**63).to_bytes(8, "little")
            return copy_bytes(src, folder / f"{case}.gguf", bytes(raw))
        return rewrite_gguf(src, folder / f"{case}.gguf", BAD_METADATA[case][0])

    return make


@pytest.mark.parametrize("case", [*BAD_METADATA, "n_tensors_2_63"])
def test_malformed_gguf_metadata_is_one_clear_error(bad_gguf, case: str) -> None:
    """(`block_count = 2**31` runs here too; the CLI test below runs it under a memory limit, for old code.)"""
    path = bad_gguf(case)
    expected = "corrupt GGUF header (it claims" if case == "n_tensors_2_63" else BAD_METADATA[case][1]
    with pytest.raises(ModelFileError) as err:
        load_model(path, quiet=True)
    message = str(err.value)
    assert message.startswith(f"{path}: ") and expected in message and "\n" not in message, message
    if case != "chat_template_number":  # the config alone (what `read_model_config` and `props` read) too
        with pytest.raises(ModelFileError):
            read_model_config(path)


@pytest.mark.parametrize("case", ["block_count_2_31", "alignment_list", "n_tensors_2_63"])
def test_cli_reports_malformed_metadata_in_one_line_with_exit_2(bad_gguf, case: str) -> None:
    """Through the CLI, under a 6 GB address-space limit: `block_count = 2**31` exhausted memory."""
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))

    path = bad_gguf(case)
    done = subprocess.run([sys.executable, "-m", "lucebox", "generate", "--model", str(path), "--prompt", "hi",
                           "--max-tokens", "2"], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          preexec_fn=limit)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"lucebox: error: {path}: "), done.stderr[-2000:]


BAD_HF_CONFIG = {  # case: (config.json changes, what the one-line error says)
    "hidden_size_string": ({"hidden_size": "64"}, "hidden_size is the text '64', not a whole number"),
    "layers_missing": ({"num_hidden_layers": DROP}, "num_hidden_layers is missing"),
    "layers_huge": ({"num_hidden_layers": 2**31}, "num_hidden_layers is 2147483648; it must be from 1 to"),
    "heads_0": ({"num_attention_heads": 0}, "num_attention_heads is 0; it must be from 1"),
    "kv_heads_0": ({"num_key_value_heads": 0}, "num_key_value_heads is 0; it must be from 1"),
    "eps_string": ({"rms_norm_eps": "x"}, "rms_norm_eps is the text 'x', not a number"),
    "vocab_list": ({"vocab_size": [1, 2]}, "vocab_size is a list of 2 items, not a whole number"),
}


@pytest.mark.parametrize("case", [*BAD_HF_CONFIG, "not_an_object"])
def test_malformed_hf_config_is_one_clear_error(tiny_hf_folder, tmp_path, case: str) -> None:
    import json
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(tiny_hf_folder("llama"), folder)
    if case == "not_an_object":
        (folder / "config.json").write_text("[1, 2]")
        expected = "config.json holds a list of 2 items, not an object"
    else:
        changes, expected = BAD_HF_CONFIG[case]
        raw = json.loads((folder / "config.json").read_text())
        for key, value in changes.items():
            raw.pop(key, None)
            if value is not DROP:
                raw[key] = value
        (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelFileError) as err:
        load_model(folder, quiet=True)
    assert expected in str(err.value) and "\n" not in str(err.value), str(err.value)
