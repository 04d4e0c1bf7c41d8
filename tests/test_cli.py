"""The command line: the model as a positional argument (as llama-server and vLLM take it), and `generate`
taking the same engine flags as `serve` (one argument builder, one way to load)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch

from lucebox import cli, procs

ROOT = Path(__file__).resolve().parents[1]
DRAFTER = ROOT / "model_cards" / "drafters" / "smollm2-135m-instruct-dflash"


def parse(*argv: str) -> argparse.Namespace:
    args = cli.build_parser().parse_args(list(argv))
    cli.take_positional_model(args)
    return args


def options(*builders) -> set[str]:
    p = argparse.ArgumentParser(add_help=False)
    for build in builders:
        build(p)
    return {s for a in p._actions for s in a.option_strings}


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_the_model_may_be_given_positionally(command):
    extra = ["--prompt", "hi"] if command == "generate" else []
    assert parse(command, "m.gguf", *extra).model == "m.gguf"
    assert parse(command, "--model", "m.gguf", *extra).model == "m.gguf"
    assert parse(command, "m.gguf", "--model", "m.gguf", *extra).model == "m.gguf"  # the same one twice is fine
    assert parse(command, *extra).model is None  # the default model


def test_two_different_models_is_one_line_and_exit_2(capsys):
    assert cli.main(["serve", "a.gguf", "--model", "b.gguf"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["lucebox: error: the model is given twice: 'a.gguf' and --model 'b.gguf' (give one)"]


@pytest.mark.parametrize("flag", ["--cache-ram", "--prefix-cache-slots", "--prefill-cache-slots",
                                  "--kv-cache-budget", "--kv-cache-min-tokens"])
def test_a_negative_cache_size_is_one_line_and_exit_2(capsys, flag):
    assert cli.main(["serve", "--model", "m.gguf", flag, "-1"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"lucebox: error: {flag} must be >= 0, got -1"]


@pytest.mark.parametrize("argv, message", [
    (["--rows", "1,40"], "bench qmm: --rows takes a comma-separated list of 1..32, not '1,40'"),
    (["--types", "Q4_0"], "bench qmm: --types takes Q4_K, Q6_K, Q8_0, not 'Q4_0'"),
    (["--shape", "nope"], "bench qmm: unknown --shape 'nope' (choose from qwen3-8b, qwen3-0.6b, tiny, tiny-scorer)"),
] + ([] if torch.cuda.is_available() else [
    ([], "bench qmm times the CUDA kernels: this machine has no CUDA device")]))
def test_bench_qmm_bad_arguments_are_one_line_and_exit_2(capsys, argv, message):
    assert cli.main(["bench", "qmm", *argv]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"lucebox: error: {message}"]


def test_generate_takes_every_engine_flag_of_serve():
    serve = options(lambda p: cli.add_engine_args(p, positional=True), cli.add_decoding_args, cli.add_serve_args)
    generate = {s for a in cli.build_parser()._subparsers._group_actions[0].choices["generate"]._actions
                for s in a.option_strings}
    assert serve - generate == options(cli.add_serve_args)  # only the server's own flags are serve's alone
    assert {"--draft", "--no-draft", "--ddtree", "--ddtree-budget", "--kv-tokens", "--model-card"} <= generate


def test_generate_loads_with_serves_configuration():
    args = parse("generate", "m.gguf", "--prompt", "hi", "--draft", "d", "--ddtree", "--ddtree-budget", "8",
                 "--kv-tokens", "1024", "--max-step-tokens", "256")
    cfg = cli.generate_config(args)
    assert (cfg.model, cfg.draft, cfg.ddtree, cfg.ddtree_budget, cfg.kv_tokens, cfg.max_step_tokens) == (
        "m.gguf", "d", True, 8, 1024, 256)
    assert cfg.max_num_seqs == 1 and not cfg.prefix_cache and cfg.prefill_compression == "off"
    assert cli.generate_config(parse("generate", "--prompt", "hi", "--no-draft")).no_draft


def generate(*argv: str) -> str:
    done = procs.run([sys.executable, "-m", "lucebox", "generate", *argv], capture_output=True, text=True,
                     cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_generate_with_a_positional_path_and_the_drafter(smollm2_path):
    """A real run each way; DDTree speculation on greedy decoding writes the same text as plain decoding."""
    common = ["--prompt", "Name three colors.", "--max-tokens", "6", "--kv-tokens", "1024", "--device", "cpu"]
    plain = generate(str(smollm2_path), *common)
    assert plain.strip()
    if DRAFTER.is_dir():
        assert generate(str(smollm2_path), *common, "--draft", str(DRAFTER), "--ddtree") == plain


def test_python_m_lucebox_model_path_serves_that_model(tmp_path):
    """`python -m lucebox MODEL` is `serve MODEL`: a missing file is the model error, not a usage error."""
    missing = tmp_path / "missing.gguf"
    done = procs.run([sys.executable, "-m", "lucebox", str(missing), "--port", "0"], capture_output=True,
                     text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith(f"lucebox: error: model '{missing}' is neither")


@pytest.mark.parametrize("weights, quantized", [("quantized", True), ("dense", False)])
def test_bench_engines_take_the_weights_and_memory_flags(smollm2_path, weights, quantized):
    """`bench decode` builds its engine with engine_from_args: --weights must reach the loader (it was dropped,
    so `bench decode --weights quantized` timed the dense path)."""
    args = parse("bench", "decode", "--model", str(smollm2_path), "--device", "cpu", "--weights", weights)
    engine = cli.engine_from_args(args, max_num_seqs=1)
    assert engine.config.weights == weights
    assert any(getattr(m, "qtype", None) for m in engine.loaded.model.modules()) is quantized
