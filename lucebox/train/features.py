"""The training inputs from the frozen target: TargetFeatures runs whole sequences through the target once
each, exactly as the decode loop does when it captures features for the drafter (DecoderModel.forward with
`capture`, over the engine's KV pool), and returns the captured layers' outputs at every position."""

from __future__ import annotations

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
