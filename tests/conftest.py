"""Shared fixtures: the real model files, fetched once into $LUCEBOX_HOME."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from lucebox import fetch
from lucebox.data import DATA_DIR
from tests.memory import memory_log_module, memory_log_start, release_memory

if os.environ.get("PYTEST_XDIST_WORKER"):  # tox runs two workers on two cores: one intra-op thread each, or every
    torch.set_num_threads(1)                # multi-threaded op waits at its barrier for a descheduled thread


# CI runs two pytest workers (tox.ini: `-n 2 --dist loadfile --no-loadscope-reorder`). Each module is a unit of
# work, handed out in collection order: the slowest first (seconds under two workers on the 2-core CI machine,
# stop 62), so the run does not end on one worker's long module while the other idles. The modules whose
# process peaks near 3 GB or more (two fp32 Gemma 3 copies; two or three live servers at once) share one group, run
# one after another on one worker, so two of them never run at once; the others peak at ~2 GB.
SLOW_FIRST = (
    "test_spec_cache_matrix", "test_parity", "test_constrained_xml", "test_spec", "test_constrained_api",
    "test_bench_serve", "test_spec_sampled", "test_prefix_cache", "test_serving", "test_pflash", "test_spec_train",
    "test_pflash_server", "test_api_fuzz", "test_ahead", "test_thinking_budget", "test_grammar", "test_model_files",
    "test_probe", "test_bench_agent", "test_engine", "test_api_responses", "test_tensor_parallel",
    "test_engine_isolation", "test_train_data", "test_api_anthropic", "test_pacing", "test_sampling_fuzz",
    "test_api_chat", "test_bench_models", "test_cli",
)
HEAVY = frozenset({"test_spec_cache_matrix", "test_parity", "test_prefix_cache", "test_serving"})


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: without xdist, never called
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadfile`, with the HEAVY modules together as one unit of work."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class HeavyTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = super()._split_scope(nodeid)
            return "heavy" if Path(module).stem in HEAVY else module

    return HeavyTogether(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: a module's tests keep their order


def data_file(rel: str) -> Path:
    """A file of the data bundled in lucebox/data; it ships with the repository, so a missing one fails loudly."""
    path = DATA_DIR / rel
    assert path.is_file(), f"{path} is missing: the repository bundles it (lucebox/data/SOURCES.md)"
    return path


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return fetch.pull("smollm2", quiet=True)


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    return fetch.pull("gemma3-270m", quiet=True)


@pytest.fixture(scope="module")
def one_thread():
    """For modules of tiny models (`pytestmark = pytest.mark.usefixtures("one_thread")`): one intra-op thread
    is faster on tensors this small, and far faster while other processes load the cores (each barrier of a
    multi-threaded op then waits for a descheduled thread)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


from tests.fixtures.tiny_models import tiny_gguf, tiny_hf_folder  # noqa: E402,F401  (session fixtures)


class SharedServer:
    """The default-model server the API tests share (`live_server`).

    It keeps running from one module to the next while they use it, stops as soon as a module that does not
    use it starts, and starts again for the next one that does: a server is ~1.6 GB, and the modules in
    between (transformers parity with two copies of Gemma 3, the drafter trainer, ...) need that memory.
    """

    def __init__(self) -> None:
        self.server: Any = None

    def get(self, model: Path) -> Any:
        if self.server is None:
            from tests.live_server import start_server

            # Greedy decode steps one step ahead, as CUDA serves by default (engine/runtime/ahead.py), so the API
            # tests (tools, streams, disconnects, turns) run that path; on the CPU it is otherwise off.
            self.server = start_server(model, ahead=True)
        return self.server

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


SHARED_SERVER = SharedServer()


@pytest.fixture(scope="module")
def live_server(smollm2_path):
    """The full server on the default model, shared by the API tests (fp32 on CPU); see SharedServer."""
    return SHARED_SERVER.get(smollm2_path)


@pytest.fixture(scope="session", autouse=True)
def _stop_the_shared_server():
    yield
    SHARED_SERVER.stop()


@pytest.fixture(scope="module", autouse=True)
def _release_memory_after_each_module(request):
    """Stop the shared server before a module that does not use it; after each module, hand what it freed
    (its servers, engines, transformers reference models) back to the OS, so the suite's peak is the
    largest module's, not the sum of them all. With LUCEBOX_MEMLOG=file, append each module's peak."""
    if not any("live_server" in item.fixturenames for item in request.session.items
               if getattr(item, "module", None) is request.module):
        SHARED_SERVER.stop()
    log = os.environ.get("LUCEBOX_MEMLOG")
    if log:
        memory_log_start()
    yield
    release_memory()
    if log:
        memory_log_module(Path(log), request.module.__name__)
