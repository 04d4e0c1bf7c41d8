"""`bench sample` end to end on the CPU: the default model's own answer distributions, the candidates path
against the full sort in the same run (the same tokens kept), the worst-case rows past the candidates, a table
and its JSON; bad flags are one line and exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lucebox.cli import main


def test_bench_sample_times_both_paths_on_the_models_rows(smollm2_path: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "sample.json"
    assert main(["bench", "sample", "--model", str(smollm2_path), "--device", "cpu", "--rows", "32", "--steps", "1",
                 "--suite", "gsm", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    model, flat = report["results"]
    assert (model["logits"], flat["logits"]) == ("model answers", "random, std 3")
    for r in (model, flat):
        assert r["same_kept"] == 1.0  # both paths keep the same tokens in every row
        assert r["full_sort_ms"] > 0 and r["candidates_ms"] > 0 and r["sample_ms"] > 0
    assert model["nucleus"]["p50"] < 100 and model["past_candidates"] < 0.1  # a trained model's nuclei are small
    assert flat["past_candidates"] > 0.5  # the worst case really goes past the candidates
    assert "same tokens kept" in capsys.readouterr().out


@pytest.mark.parametrize(("flag", "value"), [("--rows", "0"), ("--top-p", "1.5"), ("--temperature", "0")])
def test_bad_flags_are_one_line_and_exit_2(smollm2_path: Path, capsys, flag: str, value: str) -> None:
    assert main(["bench", "sample", "--model", str(smollm2_path), "--device", "cpu", flag, value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lucebox: error: bench sample:"), err
