"""The decode graphs' host block tables are kept across steps (rewritten only where they changed): after
any sequence of steps they must equal tables written from scratch. CPU only (numpy)."""

from __future__ import annotations

import random

import numpy as np

from lucebox.engine.runtime.cuda_graphs import HostTables


def scratch(rows: int, blocks: int, tables: list[list[int]]) -> np.ndarray:
    out = np.zeros((rows, blocks), dtype=np.int64)
    for i, t in enumerate(tables):
        out[i, : min(len(t), blocks)] = t[:blocks]
    return out


def test_incremental_tables_equal_tables_written_from_scratch() -> None:
    rng = random.Random(0)
    rows, blocks = 8, 12
    buf = np.zeros(rows * blocks + 5, dtype=np.int64)  # a view into a larger buffer, as in the graph decoder
    host = HostTables(buf[5:].reshape(rows, blocks))
    seqs = [[rng.randrange(1, 99)] for _ in range(20)]
    for _ in range(400):
        op = rng.random()
        k = rng.randrange(len(seqs))
        if op < 0.5:
            seqs[k].extend(rng.randrange(1, 99) for _ in range(rng.randrange(1, 3)))  # grows in place
        elif op < 0.6:
            seqs[k] = [rng.randrange(1, 99) for _ in range(rng.randrange(1, 15))]  # preempted / cache hit
        batch = rng.sample(seqs, rng.randrange(1, rows + 1))  # the step's rows, any order
        for i, t in enumerate(batch):
            host.fill(i, t)
        host.clear_from(len(batch))
        assert np.array_equal(host.t, scratch(rows, blocks, batch))
    assert not buf[:5].any()  # nothing written outside the tables


def test_a_shorter_table_in_a_row_clears_the_old_tail() -> None:
    host = HostTables(np.zeros((2, 6), dtype=np.int64))
    long, short = [1, 2, 3, 4, 5], [7, 8]
    host.fill(0, long)
    host.fill(0, short)
    assert host.t[0].tolist() == [7, 8, 0, 0, 0, 0]
    host.fill(0, short)
    short.append(9)
    host.fill(0, short)
    assert host.t[0].tolist() == [7, 8, 9, 0, 0, 0]
    host.clear_from(0)
    assert not host.t.any()
