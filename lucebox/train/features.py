"""The training inputs from the frozen target: TargetFeatures runs whole sequences through the target once
each, exactly as the decode loop does when it captures features for the drafter (DecoderModel.forward with
`capture`, over the engine's KV pool), and returns the captured layers' outputs at every position;
FeatureStore keeps them for every training example (a memory-mapped file), so that later epochs and
resumed runs never run the target."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from lucebox.engine.runtime.llm_engine import LLMEngine
from lucebox.engine.runtime.sampler import SamplingParams
from lucebox.engine.runtime.sequence import Chunk, Sequence
from lucebox.errors import LuceboxError


class TargetFeatures:
    """The target layers' outputs at every position of whole sequences, one forward each.

    Runs the target exactly as the decode loop does when it captures features
    (DecoderModel.forward with `capture`), over the engine's KV pool. Features
    come back in the order the decode loop gets them (layer order).
    """

    def __init__(self, engine: LLMEngine, layer_ids: list[int], max_tokens: int = 16384) -> None:
        self.engine = engine
        self.capture = tuple(layer_ids)
        self.max_tokens = max_tokens

    @torch.no_grad()
    def __call__(self, sequences: list[list[int]]) -> list[list[torch.Tensor]]:
        kv, runner, model = self.engine.kv, self.engine.runner, self.engine.loaded.model
        out: list[list[torch.Tensor]] = []
        i = 0
        while i < len(sequences):
            group: list[Sequence] = []
            n_tok = 0
            while i < len(sequences):
                ids = sequences[i]
                need = kv.blocks_for(len(ids))
                if group and (need > kv.pool.num_free or n_tok + len(ids) > self.max_tokens):
                    break
                if need > kv.pool.num_free:
                    raise LuceboxError(f"a {len(ids)}-token training sequence does not fit the KV cache")
                seq = Sequence(list(ids), SamplingParams())
                seq.block_table = kv.pool.allocate(need)
                group.append(seq)
                n_tok += len(ids)
                i += 1
            try:
                inputs = runner.prepare([Chunk(s, 0, len(s.token_ids)) for s in group])
                _, feats = model(inputs.input_ids, inputs.positions, kv.data, inputs.meta, capture=self.capture)
                by_seq = {c.seq.seq_id: start for c, start in zip(inputs.order, inputs.row_starts)}
                for s in group:
                    a = by_seq[s.seq_id]
                    out.append([f[a: a + len(s.token_ids)].clone() for f in feats])
            finally:
                for s in group:
                    kv.pool.decref(s.block_table)
        return out


class FeatureStore:
    """Every training example's target features, captured once and reused by every epoch (and by a resumed run).

    One row per token: the captured layers' outputs concatenated in layer order ([n_feat * H], what
    DFlashDrafter.fuse concatenates), example after example. The rows live in a memory-mapped file
    (`path`.bin, with `path`.json saying what they are for and how many examples are written, so an
    interrupted capture continues) or, without a path, in RAM. On CUDA the whole store moves to the GPU
    when it fits in 30% of its free memory; otherwise a step copies its rows over (pinned, asynchronous).
    """

    def __init__(self, rows: torch.Tensor, offsets: list[int], device: torch.device) -> None:
        self.offsets = offsets
        self.device = device
        if device.type == "cuda" and rows.numel() * rows.element_size() <= 0.3 * torch.cuda.mem_get_info(device)[0]:
            rows = rows.to(device)
        self.rows = rows

    @staticmethod
    def nbytes(lengths: list[int], width: int, dtype: torch.dtype) -> int:
        return sum(lengths) * width * dtype.itemsize

    @classmethod
    def build(cls, features: TargetFeatures, sequences: list[list[int]], width: int, dtype: torch.dtype,
              device: torch.device, path: Path | None = None, fingerprint: str = "", group: int = 64,
              progress: Callable[[int, int], None] | None = None) -> FeatureStore:
        """Capture (or reopen) the features of `sequences`: the target runs once per sequence not yet stored."""
        lengths = [len(s) for s in sequences]
        offsets = [0, *itertools.accumulate(lengths)]
        n_rows = offsets[-1]
        done = 0
        if path is None:
            rows = torch.empty(n_rows, width, dtype=dtype)
        else:
            meta_path, bin_path = path.with_suffix(".json"), path.with_suffix(".bin")
            want = {"fingerprint": fingerprint, "dtype": str(dtype), "width": width, "rows": n_rows}
            size = n_rows * width * dtype.itemsize
            try:
                meta = json.loads(meta_path.read_text())
                if {k: meta.get(k) for k in want} == want and bin_path.stat().st_size == size:
                    done = int(meta["done"])
            except (OSError, ValueError, KeyError):
                done = 0
            if not done:
                bin_path.parent.mkdir(parents=True, exist_ok=True)
                with bin_path.open("wb") as f:
                    f.truncate(size)
            mm = np.memmap(bin_path, dtype=np.uint8, mode="r+")
            rows = torch.from_numpy(mm).view(dtype).view(n_rows, width)
        while done < len(sequences):
            end = min(done + group, len(sequences))
            for j, f in enumerate(features(sequences[done:end]), start=done):
                rows[offsets[j]: offsets[j + 1]] = torch.cat(f, dim=-1).to("cpu", dtype)
            done = end
            if path is not None:
                mm.flush()
                meta_path.write_text(json.dumps({**want, "done": done}))
            if progress is not None:
                progress(done, len(sequences))
        return cls(rows, offsets, device)

    def example(self, i: int) -> torch.Tensor:
        """[T_i, width] on the device."""
        return self._to_device(self.rows[self.offsets[i]: self.offsets[i + 1]])

    def gather(self, idx: list[int], lengths: list[int]) -> torch.Tensor:
        """The first lengths[j] rows of example idx[j], for every j, concatenated: [sum lengths, width]."""
        return self._to_device(torch.cat([self.rows[self.offsets[i]: self.offsets[i] + n]
                                          for i, n in zip(idx, lengths)]))

    def _to_device(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or self.device.type == "cpu":  # a store held on the device ("cuda:0" is "cuda")
            return x.to(self.device)
        return x.pin_memory().to(self.device, non_blocking=True)  # pinned: no wait for the GPU's queued work
