"""`bench spec-cost`: a speculative step's time against a plain one through the engine's own steps, on a random
Qwen3.5 hybrid written from --shape, with a random drafter; the projection tau / r; bad flags are one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lucebox.cli import main
from tests.fixtures.tiny_models import write_tiny_gguf

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("tok") / "tok.gguf", "qwen3")


def test_hybrid_shape_chain_and_tree_costs(tmp_path: Path, tokenizer: Path, capsys) -> None:
    out = tmp_path / "cost.json"
    assert main(["bench", "spec-cost", "--model", str(tokenizer), "--shape", "tiny-qwen3.5", "--device", "cpu",
                 "--draft-layers", "2", "--block", "4", "--budgets", "5", "--batch-sizes", "1,2", "--steps", "2",
                 "--taus", "3,6", "--context", "40", "--profile", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert not Path(report["model"]).exists(), "the random model goes with its temporary folder"
    assert report["drafter"] == {"path": None, "layers": 2, "block": 4}
    got = {(r["config"], r["batch"]): r for r in report["results"]}
    assert set(got) == {("chain", 1), ("chain", 2), ("ddtree b=5", 1), ("ddtree b=5", 2)}
    for (config, _), r in got.items():
        assert r["rows_verified"] == (4 if config == "chain" else 6) and r["context"] == 40
        assert r["plain_step_ms"] > 0 and r["spec_step_ms"] > 0
        assert r["cost_ratio"] == pytest.approx(r["spec_step_ms"] / r["plain_step_ms"])
        assert r["projected_speedup"]["3"] == pytest.approx(3 / r["cost_ratio"])
        # a step commits at most the rows it verifies: tau 6 is out of reach of a 4-row chain only
        assert (r["projected_speedup"]["6"] is None) == (config == "chain")
    table = capsys.readouterr().out
    assert "random drafter (2 layers, block 4)" in table and "ddtree b=5" in table
    # --profile 2: plain and both one-launch configs profiled at batch 1, their step times those timed above
    prof = report["profile"]
    assert prof["batch"] == 1 and prof["steps"] == 2 and set(prof["reports"]) == {"plain", "chain", "ddtree b=5"}
    assert prof["step_ms"]["chain"] == got["chain", 1]["spec_step_ms"]
    busy = {k: v["busy_us_per_step"] for k, v in prof["reports"].items()}
    # a speculative step drafts and verifies several rows: more work than a plain step's one row
    assert busy["chain"] > busy["plain"] > 0 and busy["ddtree b=5"] > busy["plain"], busy
    for rep in prof["reports"].values():
        assert rep["busy_us_per_step"] == pytest.approx(sum(k["us_per_step"] for k in rep["kernels"]))
    assert "bench spec-cost --profile: 2 steps at batch 1" in table and "chain us" in table


@pytest.mark.parametrize(("flag", "value"), [("--taus", "0.5"), ("--budgets", "x"), ("--batch-sizes", "0"),
                                             ("--block", "1"), ("--context", "0")])
def test_bad_flags_are_one_line_and_exit_2(tokenizer: Path, capsys, flag: str, value: str) -> None:
    assert main(["bench", "spec-cost", "--model", str(tokenizer), "--device", "cpu", flag, value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lucebox: error: bench spec-cost:"), err


def test_a_tokenizer_larger_than_the_shape_s_vocab_is_one_line(tmp_path: Path, smollm2_path: Path, capsys) -> None:
    assert main(["bench", "spec-cost", "--model", str(smollm2_path), "--shape", "tiny-qwen3.5", "--device", "cpu",
                 "--json", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "more than the shape's vocabulary of 512" in err[0], err
