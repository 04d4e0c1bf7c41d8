"""The data the tests, benchmarks and trainer read ships in the package (lucebox/data), so a fresh clone or an
installed Lucebox needs nothing beside the repository."""

from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

import pytest

from lucebox.data import DATA_DIR, data_dir
from lucebox.errors import LuceboxError

ROOT = Path(__file__).resolve().parents[1]


def package_data_globs() -> list[str]:
    """The `package_data` patterns setup.py gives lucebox.data (read from its syntax tree, not run)."""
    for node in ast.walk(ast.parse((ROOT / "setup.py").read_text(encoding="utf-8"))):
        if isinstance(node, ast.keyword) and node.arg == "package_data":
            return ast.literal_eval(node.value)["lucebox.data"]
    raise AssertionError("setup.py has no package_data")


def data_files() -> list[str]:
    return sorted(p.relative_to(DATA_DIR).as_posix() for p in DATA_DIR.rglob("*")
                  if p.is_file() and p.suffix not in (".py", ".pyc"))


def test_every_data_file_is_packaged_and_has_a_source_line():
    files = data_files()
    assert {"agent_prompts/codex_gpt5_codex.md", "prompts/mt_bench.jsonl", "prompts/bench_gsm.jsonl",
            "prompts/generation_smoke.jsonl", "swe_bench_verified.parquet", "SOURCES.md"} <= set(files)
    globs = package_data_globs()
    unpackaged = [f for f in files if not any(fnmatch.fnmatch(f, g) for g in globs)]
    assert not unpackaged, f"add these to setup.py's package_data: {unpackaged}"
    sources = (DATA_DIR / "SOURCES.md").read_text(encoding="utf-8")
    named = set(re.findall(r"^\| ([^|]+) \|", sources, re.M)) - {"file", "---"}
    patterns = [p.strip() for row in named for p in row.split(",")]
    undocumented = [f for f in files if f != "SOURCES.md" and not any(
        fnmatch.fnmatch(f, p) or fnmatch.fnmatch(Path(f).name, p) for p in patterns)]
    assert not undocumented, f"SOURCES.md has no source and licence for {undocumented}"
    assert all("Apache-2.0" in row or "MIT" in row for row in sources.splitlines() if row.startswith("| ")
               and not row.startswith(("| file", "|---")))


def test_the_data_dir_is_resolved_in_one_place(tmp_path):
    assert data_dir() == DATA_DIR and data_dir(tmp_path) == tmp_path
    with pytest.raises(LuceboxError, match=r"^--data-dir .*missing: not a folder$"):
        data_dir(tmp_path / "missing")


def test_nothing_reads_data_from_outside_the_repository():
    """The old `../shared/data` lookups made a fresh clone collect 0 tests; docs moved into docs/."""
    offenders = []
    for path in [*ROOT.glob("lucebox/**/*.py"), *ROOT.glob("tests/**/*.py"), ROOT / "README.md"]:
        if path == Path(__file__).resolve():
            continue
        text = path.read_text(encoding="utf-8")
        if re.search(r"""\.\./shared|/ "shared"|\bshared/(data|spec|ARCHITECTURE)""", text):
            offenders.append(str(path.relative_to(ROOT)))
    assert not offenders


def test_readme_links_point_inside_the_repository():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    links = [t for t in re.findall(r"\]\(([^)#]+)\)", readme) if not t.startswith(("http://", "https://"))]
    assert all((ROOT / t).exists() for t in links), links
    docs = {"docs/ARCHITECTURE.md", *(f"docs/spec/{p.name}" for p in (ROOT / "docs" / "spec").glob("*.md"))}
    assert len(docs) == 6 and docs <= set(links)
