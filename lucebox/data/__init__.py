"""The data the benchmarks, the drafter trainer and the tests read, shipped inside the package.

One place resolves the folder, so an installed Lucebox, a fresh clone and the
test suite all find the same files (sources and licences: SOURCES.md here).
`--data-dir` points any command at another folder with the same layout:
agent_prompts/*.md, prompts/*.jsonl, swe_bench_verified.parquet.
"""

from __future__ import annotations

from pathlib import Path

from lucebox.errors import LuceboxError

DATA_DIR = Path(__file__).resolve().parent


def data_dir(override: Path | str | None = None) -> Path:
    """`override` (a --data-dir value) when given, else the bundled folder; a missing override is one clear error."""
    if override is None:
        return DATA_DIR
    path = Path(override).expanduser()
    if not path.is_dir():
        raise LuceboxError(f"--data-dir {path}: not a folder")
    return path
