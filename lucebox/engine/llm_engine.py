"""The synchronous engine: a loaded model, its KV pool, a scheduler, one `step()`.

Everything above it (the async server loop, the CLI, benchmarks, tests)
drives generation through `add()` and `step()`; nothing else touches the
model or the KV cache.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lucebox.engine.kv_cache import KVCache
from lucebox.engine.loader import LoadedModel, load_model
from lucebox.engine.model_runner import ModelRunner
from lucebox.engine.sampler import SampleRow, SamplingParams, TokenLogprobs, make_generator, sample
from lucebox.engine.scheduler import Scheduler
from lucebox.engine.sequence import Chunk, Sequence
from lucebox.errors import LuceboxError

if TYPE_CHECKING:
    from lucebox.cache.manager import PrefixCache
    from lucebox.engine.spec.dflash import SpecDecoder

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


@dataclass
class EngineConfig:
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (fp32 on CPU, bf16 on CUDA) | float32 | bfloat16 | float16
    n_ctx: int | None = None  # context length; None = the model's
    kv_tokens: int | None = None  # KV pool size in tokens; None = sized from memory
    block_size: int = 16
    max_num_seqs: int = 64
    max_step_tokens: int = 2048  # prefill chunk budget per step
    cuda_graphs: bool = True  # decode-only steps as CUDA graph replays (CUDA only)
    draft: str | None = None  # DFlash drafter folder; None = plain decoding
    ddtree: bool = False  # verify a draft tree instead of a chain
    ddtree_budget: int = 22  # tree nodes per verification
    spec_static: bool | None = None  # fixed-shape (CUDA-graph) speculative steps; None = on CUDA only

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dev = torch.device(self.device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise LuceboxError("--device cuda was asked for but CUDA is not available")
        return dev

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        if self.dtype not in DTYPES:
            raise LuceboxError(f"unknown dtype {self.dtype!r} (choose from {', '.join(DTYPES)})")
        return DTYPES[self.dtype]


@dataclass
class StepOutput:
    seq: Sequence
    new_tokens: list[int]
    finished: bool


class LLMEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None) -> None:
        self.loaded = loaded
        self.config = config or EngineConfig()
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.device = loaded.device
        self.n_ctx = min(self.config.n_ctx or loaded.config.max_position, loaded.config.max_position)
        kv_tokens = self.config.kv_tokens or self._default_kv_tokens()
        block_size = self.config.block_size
        num_blocks = max(2, -(-kv_tokens // block_size) + 1)
        self.kv = KVCache.create(loaded.config, num_blocks, block_size, loaded.dtype, self.device)
        self.runner = ModelRunner(loaded.model, self.kv)
        if self.config.cuda_graphs:
            self.runner.enable_cuda_graphs(self.config.max_num_seqs, self.n_ctx)
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=self.config.max_num_seqs,
            max_step_tokens=self.config.max_step_tokens,
            max_model_len=self.n_ctx,
            eos_ids=self.tokenizer.eos_ids,
        )
        self.last_step: list[tuple[int, int, int]] = []  # (seq id, start, rows) of the last step, for stats
        self.spec: SpecDecoder | None = None
        self.cache: PrefixCache | None = None
        if self.config.draft:
            self.enable_speculation(Path(self.config.draft), ddtree=self.config.ddtree,
                                    budget=self.config.ddtree_budget)
        log.info("KV cache: %d blocks x %d tokens (%.0f MiB)", num_blocks, block_size,
                 self.kv.data.numel() * self.kv.data.element_size() / 2**20)

    @classmethod
    def from_path(cls, path: str | Path, config: EngineConfig | None = None, quiet: bool = False) -> LLMEngine:
        config = config or EngineConfig()
        device = config.resolve_device()
        loaded = load_model(Path(path), device=device, dtype=config.resolve_dtype(device), quiet=quiet)
        return cls(loaded, config)

    def enable_speculation(self, draft: Path, *, ddtree: bool = False, budget: int = 22) -> None:
        """Load a DFlash drafter for this target; decode steps then draft and verify."""
        from lucebox.engine.spec.dflash import SpecDecoder
        from lucebox.engine.spec.drafter import load_drafter

        drafter = load_drafter(draft, self.model_config, self.device, self.loaded.dtype)
        self.set_speculation(SpecDecoder(drafter, self.loaded.model, self.kv, ddtree=ddtree, budget=budget))
        log.info("speculative decoding: DFlash drafter %s (%d layers, block %d)%s", draft,
                 drafter.cfg.num_layers, drafter.cfg.block_size, f", DDTree budget {budget}" if ddtree else "")

    def enable_prefix_cache(self, cfg: Any, template: Any = None) -> None:
        """Tiered prefix cache (lucebox.cache): GPU blocks, RAM snapshots, optional disk."""
        from lucebox.cache.layout import layout_id
        from lucebox.cache.manager import PrefixCache
        from lucebox.cache.markers import ChatMarkers, NoChatMarkers

        markers = None
        if template is not None:
            try:
                markers = ChatMarkers.from_template(template, self.tokenizer)
            except NoChatMarkers as exc:
                log.info("prefix cache: no turn markers in the chat template (%s); turn snapshots off", exc)
        mc = self.model_config
        layout = layout_id(model_path=self.loaded.path, kv_dtype=self.kv.data.dtype, block_size=self.kv.block_size,
                           n_ctx=self.n_ctx, template_sha1=template.sha1 if template is not None else "",
                           num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim)
        self.cache = PrefixCache(cfg, self.kv, markers, layout)
        self.scheduler.cache = self.cache

    @property
    def blocks_in_use(self) -> int:
        """KV blocks held by sequences (what the prefix cache keeps alive is not counted)."""
        return self.kv.pool.num_used - (self.cache.blocks_held if self.cache is not None else 0)

    def set_speculation(self, spec: SpecDecoder | None) -> None:
        """Switch decoding mode (only between requests: no sequence may be running)."""
        assert not self.has_work(), "switch speculation only when the engine is idle"
        self.spec = spec
        self.scheduler.decode_rows = spec.rows_per_step if spec else 1
        self.scheduler.on_release = spec.release if spec else None
        static = self.config.spec_static
        if spec is not None and (static or (static is None and self.device.type == "cuda" and self.config.cuda_graphs)):
            from lucebox.engine.spec.static import StaticSpec

            spec.static = StaticSpec(spec, self.config.max_num_seqs, self.n_ctx)

    def _default_kv_tokens(self) -> int:
        """Room for a few full-context sequences, within a memory budget."""
        per_token = KVCache.bytes_per_token(self.model_config, self.loaded.dtype)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * 0.5)
        else:
            budget = 1 << 30  # host RAM: leave room for everything else
        return max(self.config.block_size * 2, min(4 * self.n_ctx, budget // per_token))

    # ----- requests ----------------------------------------------------------

    def add(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """Queue a request; raises LuceboxError if it can never fit."""
        seq = self.new_sequence(prompt_ids, params)
        self.scheduler.add(seq)
        return seq

    def new_sequence(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """Validate a request and make its Sequence, without queueing it (any thread)."""
        if not prompt_ids:
            raise LuceboxError("the prompt is empty")
        if len(prompt_ids) >= self.n_ctx:
            raise LuceboxError(
                f"the prompt has {len(prompt_ids)} tokens; this model's context is {self.n_ctx} tokens"
            )
        if self.kv.blocks_for(len(prompt_ids) + 1) > self.kv.pool.num_blocks - 1:
            raise LuceboxError(f"the prompt has {len(prompt_ids)} tokens, more than the KV cache holds")
        try:
            params.validate()
        except ValueError as exc:
            raise LuceboxError(str(exc)) from None
        return Sequence(list(prompt_ids), params, generator=make_generator(params.seed, self.device))

    def abort(self, seq: Sequence) -> None:
        self.scheduler.abort(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[StepOutput]:
        """Run one model step; returns the sequences that got a token."""
        chunks = self.scheduler.schedule()
        self.last_step = [(c.seq.seq_id, c.start, c.n) for c in chunks]
        if not chunks:
            return []
        if self.spec is not None:
            return self._spec_step(chunks)
        sampled, logits, argmax = self.runner.run(chunks)
        rows = [self._row(c) for c in sampled]
        if argmax is not None and all(r.params.greedy and not r.params.has_penalties and r.params.logprobs is None
                                      for r in rows):
            tokens, logprobs = argmax.tolist(), [None] * len(rows)
        else:
            tokens, logprobs = sample(logits, rows)
        n_before = [len(c.seq.token_ids) for c in sampled]
        finished = set(self.scheduler.postprocess(chunks, sampled, tokens, logprobs))
        return [StepOutput(c.seq, c.seq.token_ids[n:], c.seq in finished) for c, n in zip(sampled, n_before)]

    def _spec_step(self, chunks: list[Chunk]) -> list[StepOutput]:
        """Draft for the decoding sequences, verify every draft and run the prefill chunks in one forward."""
        spec = self.spec
        assert spec is not None
        decodes = [c for c in chunks if c.n == 1 and c.start > 0]
        others = [c for c in chunks if not (c.n == 1 and c.start > 0)]
        outputs = []
        if decodes and spec.static is not None:
            step_lps: dict[int, list[TokenLogprobs | None]] = {}

            def chooser(chunk: Chunk, logits: torch.Tensor, best: list[int]) -> Callable[[int, list[int]], int]:
                p = chunk.seq.params
                if p.greedy and not p.has_penalties and p.logprobs is None:
                    return lambda row, accepted: best[row]
                return self._chooser(chunk.seq, logits.float(), step_lps.setdefault(chunk.seq.seq_id, []))

            committed = spec.static.step(decodes, chooser)
            if committed is not None:
                for c, tokens in zip(decodes, committed):
                    n_before = len(c.seq.token_ids)
                    lps = step_lps.get(c.seq.seq_id)
                    finished = self.scheduler.commit(c.seq, self._within_limit(c.seq, tokens), lps)
                    outputs.append(StepOutput(c.seq, c.seq.token_ids[n_before:], finished))
                decodes = []
                if not others:
                    return outputs
        verify = spec.propose(decodes) if decodes else []
        result = self.runner.forward(self.runner.prepare(verify + others), capture=spec.capture)
        for i, c in enumerate(result.inputs.order):
            seq = c.seq
            n_before = len(seq.token_ids)
            if c.verify:
                lps: list[TokenLogprobs | None] = []
                choose = self._chooser(seq, result.chunk_logits(i), lps)
                tokens = spec.accept(c, result.chunk_logits(i), result.chunk_features(i), choose)
                finished = self.scheduler.commit(seq, self._within_limit(seq, tokens), lps)
            else:
                spec.extend_context(seq, c.start, result.chunk_features(i))
                seq.num_computed = c.start + c.n
                if not c.wants_logits:
                    continue
                toks, lps = sample(result.chunk_logits(i), [self._row(c)])
                finished = self.scheduler.commit(seq, toks, lps)
            outputs.append(StepOutput(seq, seq.token_ids[n_before:], finished))
        return outputs

    def _chooser(self, seq: Sequence, logits: torch.Tensor,
                 lps: list[TokenLogprobs | None]) -> Callable[[int, list[int]], int]:
        """The target's choice at a verified row, as plain decoding would make it there."""
        p = seq.params
        if p.greedy and not p.has_penalties and p.logprobs is None:
            best = logits.argmax(-1).tolist()
            return lambda row, accepted: best[row]

        def choose(row: int, accepted: list[int]) -> int:
            history = seq.output_ids + accepted if p.has_penalties else []
            toks, lp = sample(logits[row: row + 1], [SampleRow(p, seq.prompt_ids, history, seq.generator)])
            lps.append(lp[0])
            return toks[0]

        return choose

    @staticmethod
    def _within_limit(seq: Sequence, tokens: list[int]) -> list[int]:
        return tokens[: max(seq.params.max_tokens - seq.num_output, 0)]

    @staticmethod
    def _row(c: Chunk) -> SampleRow:
        s = c.seq
        # Penalties need the history; copying it every step would cost O(length) for nothing otherwise.
        return SampleRow(s.params, s.prompt_ids, s.output_ids if s.params.has_penalties else [], s.generator)

    # ----- conveniences (CLI, tests, benchmarks) -----------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Run prompts to completion together (batched); returns the output ids."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.add(p, sp) for p, sp in zip(prompts, plist)]
        while any(not s.is_finished for s in seqs):
            self.step()
        return [s.output_ids for s in seqs]

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[int]:
        """Yield the output tokens of one request as they are produced."""
        seq = self.add(prompt_ids, params)
        try:
            while not seq.is_finished:
                for out in self.step():
                    if out.seq is seq:
                        yield from out.new_tokens
        finally:
            self.abort(seq)

    @torch.inference_mode()
    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [len, vocab] (fp32) at every position of one prompt, for parity tests."""
        seq = Sequence(list(token_ids), SamplingParams())
        seq.block_table = self.kv.pool.allocate(self.kv.blocks_for(len(token_ids)))
        try:
            inputs = self.runner.prepare([Chunk(seq, 0, len(token_ids))])
            hidden, _ = self.loaded.model(inputs.input_ids, inputs.positions, self.kv.data, inputs.meta)
            return self.loaded.model.logits(hidden).float()
        finally:
            self.kv.pool.decref(seq.block_table)
