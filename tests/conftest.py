"""Shared fixtures: the real model files, fetched once into $LUCEBOX_HOME."""

from __future__ import annotations

from pathlib import Path

import pytest

from lucebox import fetch

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return fetch.pull("smollm2", quiet=True)


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    return fetch.pull("gemma3-270m", quiet=True)


from tests.fixtures.tiny_models import tiny_gguf, tiny_hf_folder  # noqa: E402,F401  (session fixtures)
