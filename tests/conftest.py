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


@pytest.fixture(scope="session")
def live_server(smollm2_path):
    """The full server on the default model, shared by the API tests (fp32 on CPU)."""
    from tests.live_server import start_server

    server = start_server(smollm2_path)
    yield server
    server.stop()
