"""`bench decode --peer-bench PATH`: runs that llama-bench on the same file in the same run and reports its
pp512 / tg128 beside this engine's rows. llama-bench does not exist here, so a stand-in script on PATH prints
llama-bench's `-o json` shape (a list of tests with n_prompt, n_gen, avg_ts, ...) and records its arguments."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lucebox.bench.decode import PEER_ARGS, peer_bench, write_random_quant_gguf
from lucebox.bench.pflash import SHAPES

FAKE = '''#!{python}
import json, sys
open({log!r}, "w").write(json.dumps(sys.argv[1:]))
print("ggml_cuda_init: found 1 CUDA devices", file=sys.stderr)
if {fail!r}:
    print("error: failed to load model", file=sys.stderr)
    sys.exit(1)
common = {{"build_commit": "abc1234", "build_number": 6000, "backends": "CUDA", "model_filename": sys.argv[2],
          "model_type": "qwen3 0.6B Q8_0", "n_gpu_layers": 99, "flash_attn": True}}
print(json.dumps([dict(common, n_prompt=512, n_gen=0, avg_ns=56000000, stddev_ns=100000, avg_ts=9143.5,
                       stddev_ts=20.1),
                  dict(common, n_prompt=0, n_gen=128, avg_ns=470000000, stddev_ns=900000, avg_ts=272.25,
                       stddev_ts=0.6)], indent=2))
'''


def fake_llama_bench(where: Path, fail: bool = False) -> tuple[Path, Path]:
    where.mkdir(parents=True, exist_ok=True)
    tool, log = where / "llama-bench", where / "argv.json"
    tool.write_text(FAKE.format(python=sys.executable, log=str(log), fail=fail))
    tool.chmod(0o755)
    return tool, log


@pytest.fixture(scope="module")
def tiny_q8(tmp_path_factory, smollm2_path: Path) -> Path:
    return write_random_quant_gguf(tmp_path_factory.mktemp("m") / "tiny-q8.gguf", SHAPES["tiny"], smollm2_path,
                                   mix="Q8_0", context=1024)


def test_peer_bench_reads_pp512_and_tg128(tmp_path: Path, tiny_q8: Path) -> None:
    tool, log = fake_llama_bench(tmp_path)
    peer = peer_bench(tool, tiny_q8)
    assert (peer["pp512"], peer["tg128"]) == (9143.5, 272.25)
    assert json.loads(log.read_text()) == ["-m", str(tiny_q8), *PEER_ARGS]
    assert PEER_ARGS == ["-p", "512", "-n", "128", "-ngl", "99", "-fa", "1", "-o", "json"]
    assert peer["tests"][1]["build_commit"] == "abc1234"


def test_peer_bench_failure_says_why(tmp_path: Path, tiny_q8: Path) -> None:
    tool, _ = fake_llama_bench(tmp_path, fail=True)
    with pytest.raises(RuntimeError, match="failed to load model"):
        peer_bench(tool, tiny_q8)


def test_bench_decode_cli_runs_the_peer_on_the_same_file(tmp_path: Path, tiny_q8: Path) -> None:
    """The whole command: the stand-in found on PATH, its numbers in the table and the JSON."""
    bin_dir = tmp_path / "bin"
    fake_llama_bench(bin_dir)
    out = tmp_path / "bench.json"
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.run([sys.executable, "-m", "lucebox", "bench", "decode", "--model", str(tiny_q8),
                           "--device", "cpu", "--no-hf", "--prompt-lens", "512", "--batch-sizes", "1", "--gen-len", "3",
                           "--peer-bench", "llama-bench", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=Path(__file__).parents[1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((bin_dir / "argv.json").read_text())[:2] == ["-m", str(tiny_q8)]
    assert "llama.cpp" in proc.stdout and "9,143.5" in proc.stdout and "272.2" in proc.stdout
    report = json.loads(out.read_text())
    assert report["peer_bench"]["pp512"] == 9143.5 and report["peer_bench"]["tg128"] == 272.25
    by_kind = {r["kind"]: r for r in report["results"]}
    assert by_kind["prefill"]["llama_cpp_tok_s"] == 9143.5
    assert by_kind["decode"]["llama_cpp_tok_s"] == 272.25


def test_weight_bytes_count_the_experts_a_step_reads(tiny_gguf) -> None:
    """A MoE layer's routed experts count as the share of them a decode step of that batch reads (uniform
    routing: 1 - (1 - k/E)^batch), everything else whole; a dense model counts the same at every batch."""
    import torch

    from lucebox.bench.decode import weight_bytes
    from lucebox.engine.weights.loader import load_model

    model = load_model(tiny_gguf("qwen3moe", "F32"), device="cpu", dtype=torch.float32, quiet=True).model
    moes = [b.moe for b in model.blk if getattr(b, "moe", None) is not None]
    assert moes
    experts = sum(p.numel() * 4 for m in moes for name in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
                  for p in getattr(m, name).parameters(recurse=False))
    whole = sum(p.numel() * 4 for p in model.parameters()) - model.token_embd.weight.numel() * 4 * (
        not model.cfg.tie_word_embeddings)
    k, e = moes[0].top_k, moes[0].n_experts
    for batch in (1, 4):
        share = 1 - (1 - k / e) ** batch
        assert abs(weight_bytes(model, batch) - (whole - experts * (1 - share))) <= 8
    dense = load_model(tiny_gguf("llama", "F32"), device="cpu", dtype=torch.float32, quiet=True).model
    assert weight_bytes(dense, 1) == weight_bytes(dense, 16)


def test_bench_decode_profile_accounts_for_a_decode_step(tmp_path: Path, tiny_q8: Path, capsys) -> None:
    """`--profile N`: N eager decode steps profiled after the timed cases: a table of ops (CPU) by time a step,
    in the JSON too, busiest first, the shares summing to 1 and the calls a step counted over N steps."""
    from lucebox.cli import main

    out = tmp_path / "bench.json"
    assert main(["bench", "decode", "--model", str(tiny_q8), "--device", "cpu", "--no-hf", "--prompt-lens", "16",
                 "--batch-sizes", "2", "--gen-len", "3", "--profile", "3", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "bench decode --profile: 3 eager decode steps at batch 2 on cpu" in printed
    prof = json.loads(out.read_text())["profile"]
    assert prof["batch"] == 2 and prof["steps"] == 3 and prof["busy_us_per_step"] > 0
    rows = prof["kernels"]
    assert rows and all(r["us_per_step"] > 0 for r in rows)
    assert [r["us_per_step"] for r in rows] == sorted((r["us_per_step"] for r in rows), reverse=True)
    assert abs(sum(r["share"] for r in rows) - 1) < 1e-6
    linear = next(r for r in rows if r["name"] in ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul"))
    assert linear["calls_per_step"] >= 1 and linear["calls_per_step"] * 3 == round(linear["calls_per_step"] * 3)
    assert linear["name"] in printed
