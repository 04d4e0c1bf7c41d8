"""`bench spec` end to end on the CPU: the default model with its shipped drafter, plain vs chain vs DDTree on
one suite, each configuration warmed up once and then run over every suite; greedy speculative output equals
plain output token for token (fp32), and the report holds every row it promises."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lucebox.bench.spec import agreement
from lucebox.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

DRAFTER = Path(__file__).resolve().parents[1] / "model_cards" / "drafters" / "smollm2-135m-instruct-dflash"


def test_bench_spec_greedy_equals_plain_in_every_configuration(smollm2_path: Path, tmp_path: Path, capsys) -> None:
    """Every configuration, a tree with the server's chain depth and one with the whole chain among them."""
    out = tmp_path / "spec.json"
    assert main(["bench", "spec", "--model", str(smollm2_path), "--device", "cpu", "--draft", str(DRAFTER),
                 "--suite", "gsm", "--prompts", "1", "--max-new", "12", "--budgets", "20",
                 "--tree-chain", "auto,15", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    got = {(r["suite"], r["config"], r["temperature"]): r for r in report["results"]}
    hot = ("plain", "chain", "ddtree b=20 chain=15")  # temperature 1: plain, chain and the last tree
    assert set(got) == {("gsm", c, t) for c in hot + ("ddtree b=20",) for t in (0, 1) if t == 0 or c in hot}
    for (suite, config, temp), r in got.items():
        assert r["tokens"] > 0 and r["tok_s"] > 0
        if temp == 0:
            assert r["identical_to_plain"] is True and r["agreement"] == 1.0, (suite, config)  # lossless
        assert r["tau"] == 1.0 if config == "plain" else r["tau"] >= 1.0
    assert got["gsm", "plain", 0]["speedup"] == 1.0
    table = capsys.readouterr().out
    assert "ddtree b=20 chain=15" in table and "T=1" in table
    assert main(["bench", "spec", "--model", str(smollm2_path), "--device", "cpu", "--draft", str(DRAFTER),
                 "--tree-chain", "deep"]) == 2
    assert "--tree-chain: 'deep' is neither auto nor a depth" in capsys.readouterr().err


def test_agreement_counts_tokens_up_to_the_first_difference() -> None:
    plain = [[1, 2, 3, 4], [5, 6]]
    assert agreement(plain, plain) == 1.0
    assert agreement([[1, 2, 9, 4], [5, 6, 7]], plain) == 4 / 6  # 2 of 4, then 2 of 2 (a longer output too)
    assert agreement([[9], []], plain) == 0.0
