"""The synchronous engine: a loaded model, its KV pool, a scheduler, one `step()`.

Everything above it (the async server loop, the CLI, benchmarks, tests)
drives generation through `add()` and `step()`; nothing else touches the
model or the KV cache.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lucebox.engine.kernels import triton_deltanet
from lucebox.engine.kernels.kv_quant import KV_DTYPES
from lucebox.engine.runtime import cuda_graphs
from lucebox.engine.runtime.ahead import Ahead
from lucebox.engine.runtime.cuda_graphs import batch_buckets
from lucebox.engine.runtime.grammar import Constraint, expand_masks, fill_masks, greedy_tokens
from lucebox.engine.runtime.kv_cache import KVCache, resolve_kv_dtype
from lucebox.engine.runtime.model_runner import ModelRunner, is_decode
from lucebox.engine.runtime.pacing import PrefillPacer
from lucebox.engine.runtime.recurrent_state import RecurrentStates
from lucebox.engine.runtime.sampler import (
    SampleRow,
    SamplingError,
    SamplingParams,
    TokenLogprobs,
    sample,
)
from lucebox.engine.runtime.scheduler import Scheduler
from lucebox.engine.runtime.sequence import Chunk, Sequence
from lucebox.engine.weights.loader import LoadedModel, load_model
from lucebox.errors import LuceboxError

if TYPE_CHECKING:
    from lucebox.cache.manager import PrefixCache
    from lucebox.cache.snapshots import LocalKV
    from lucebox.engine.runtime.memory_plan import MemoryPlan
    from lucebox.engine.spec.adaptive import AdaptiveSpec
    from lucebox.engine.spec.dflash import SpecDecoder

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


WEIGHTS = ("auto", "both", "quantized", "dense")  # --weights: how GGUF quant blocks are held (gguf_loader)


@dataclass
class EngineConfig:
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (fp32 on CPU, bf16 on CUDA) | float32 | bfloat16 | float16
    n_ctx: int | None = None  # context length; None = the model's
    kv_tokens: int | None = None  # KV pool size in tokens; None = sized from memory (memory_plan.py on CUDA)
    gpu_memory: float | None = None  # GB this process may use on a CUDA device; None = what is free
    block_size: int = 16
    max_num_seqs: int = 64
    max_step_tokens: int = 2048  # prefill chunk budget per step
    prefill_pacing: bool = False  # while sequences decode, cap prefill chunks from step times (pacing.py)
    cuda_graphs: bool = True  # decode-only steps as CUDA graph replays (CUDA only)
    draft: str | None = None  # DFlash drafter folder; None = plain decoding
    ddtree: bool = False  # verify a draft tree instead of a chain
    ddtree_budget: int = 22  # tree nodes per verification
    spec_static: bool | None = None  # fixed-shape (CUDA-graph) speculative steps; None = on CUDA only
    spec_adaptive: bool = True  # per sequence, decode plainly while its drafts do not pay (spec/adaptive.py)
    weights: str = "auto"  # GGUF quant blocks: auto | both | quantized | dense (gguf_loader.auto_weights)
    kv_dtype: str = "auto"  # KV cache storage: auto (the model's dtype) | bf16 (a bf16 model) | q8_0 (int8 + scales)
    tensor_parallel: int = 1  # ranks the model is split over (engine/parallel); 1: this process alone
    # Greedy decode steps launched one step ahead of the host (runtime/ahead.py). None: where CUDA graphs run
    # (LUCEBOX_AHEAD=0 or 1 overrides); on the CPU nothing overlaps, so it only delays each token by a step.
    ahead: bool | None = None

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
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None,
                 decode_guard: Callable[[Callable[[], Any]], Any] | None = None) -> None:
        """`decode_guard`: Spark's graph-resident decode (ModelRunner.guard, spark/engine.py): decode-only steps
        run under it, nothing runs a step ahead, and speculation's steps are not captured."""
        self.loaded = loaded
        self.config = config or EngineConfig()
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.device = loaded.device
        self.n_ctx = min(self.config.n_ctx or loaded.config.max_position, loaded.config.max_position)
        block_size = self.config.block_size
        try:
            self.kv_dtype = resolve_kv_dtype(self.config.kv_dtype, loaded.dtype)  # "q8_0" or the model dtype
        except ValueError as exc:
            raise LuceboxError(str(exc)) from None
        self.memory_plan: MemoryPlan | None = None
        # A hybrid's recurrent state slots and rows per verification: the memory plan's on CUDA (None: no cap).
        self.state_slots, self.verify_rows = self.config.max_num_seqs, None
        self.warm_up_seconds: float | None = None  # set by warm_up
        self.warm_up_end: float | None = None  # time.monotonic() when the warm-up ended (ready to serve)
        # The drafter loads first, so the memory plan counts its weights and its share of each KV block.
        self.hybrid = loaded.config.is_hybrid  # recurrent layers: per-sequence states (runtime/recurrent_state.py)
        drafter = self._load_drafter(Path(self.config.draft)) if self.config.draft else None
        if self.device.type == "cuda" and (self.config.kv_tokens is None or self.config.gpu_memory is not None):
            self.memory_plan = self._plan_memory(drafter)
        elif self.config.gpu_memory is not None:
            log.warning("--gpu-memory applies to CUDA devices; ignored on %s", self.device)
        if self.config.kv_tokens:
            num_blocks = max(2, -(-self.config.kv_tokens // block_size) + 1)
            plan = self.memory_plan
            if plan is not None and plan.capped and num_blocks > plan.blocks:
                need = num_blocks * plan.block_bytes / 2**30
                raise LuceboxError(f"--kv-tokens {self.config.kv_tokens} needs {need:.2f} "
                                   f"GB of KV cache; --gpu-memory leaves {plan.kv_bytes / 2**30:.2f} GB "
                                   f"({plan.kv_tokens} tokens)")
        elif self.memory_plan is not None:
            num_blocks = self.memory_plan.blocks
        else:
            num_blocks = max(2, -(-self._default_kv_tokens() // block_size) + 1)
        try:
            self.kv = KVCache.create(loaded.config, num_blocks, block_size, loaded.dtype, self.device,
                                     kv_dtype=self.kv_dtype, state_slots=self.state_slots)
        except torch.cuda.OutOfMemoryError:
            raise LuceboxError(f"a KV cache of {num_blocks * block_size} tokens does not fit in device memory "
                               "(lower --kv-tokens or --ctx-size)") from None
        if self.kv.states is not None:  # one slot per running sequence (runtime/recurrent_state.py)
            graphs_off = self.device.type == "cuda" and self.config.cuda_graphs and not cuda_graphs.HYBRID
            log.info("recurrent state: %d slots x %.1f MiB (fp32)%s", self.kv.states.num_slots,
                     RecurrentStates.bytes_per_slot(loaded.config) / 2**20,
                     "; CUDA graphs are off for hybrid models (LUCEBOX_HYBRID_GRAPHS=0)" if graphs_off else "")
        self.runner = ModelRunner(loaded.model, self.kv, loaded.dtype)
        self.runner.guard = decode_guard
        if self.config.cuda_graphs and (not self.hybrid or cuda_graphs.HYBRID):  # a hybrid's: decode-only steps
            self.runner.enable_cuda_graphs(self.config.max_num_seqs, self.n_ctx, self.config.max_step_tokens)
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=self.config.max_num_seqs,
            max_step_tokens=self.config.max_step_tokens,
            max_model_len=self.n_ctx,
            eos_ids=self.tokenizer.eos_ids,
        )
        self.last_step: list[tuple[int, int, int]] = []  # (seq id, start, rows) of the last step, for stats
        # Called once a step's forward is launched, before the host waits for its tokens: the async server hands
        # the previous step's tokens to the event loop here, so its Python work overlaps this step's GPU time
        # instead of taking the GIL from the engine thread while it prepares the step.
        self.on_launched: Callable[[], None] | None = None
        self.pacer = PrefillPacer(self.config.max_step_tokens) if self.config.prefill_pacing else None
        # Greedy decode steps launched before the last one's tokens are read (with a drafter: the steps where
        # every sequence decodes plainly; set_speculation).
        self.ahead: Ahead | None = Ahead(self.runner, self.scheduler) if self._runs_ahead() else None
        self._settled: list[StepOutput] = []  # outputs of a step settled between two `step()` calls
        self.spec: SpecDecoder | None = None
        self.adaptive: AdaptiveSpec | None = None  # which sequences speculate (set with `spec`)
        self.draft_path: Path | None = None  # the drafter folder enable_speculation loaded
        self.cache: PrefixCache | None = None
        if self.config.draft:
            self.enable_speculation(Path(self.config.draft), ddtree=self.config.ddtree,
                                    budget=self.config.ddtree_budget, drafter=drafter)
        log.info("KV cache: %d blocks x %d tokens (%.0f MiB)", num_blocks, block_size,
                 self.kv.data.numel() * self.kv.data.element_size() / 2**20)

    @classmethod
    def from_path(cls, path: str | Path, config: EngineConfig | None = None, quiet: bool = False) -> LLMEngine:
        from lucebox.engine.runtime import warmup

        # Loading and the memory plan compile kernels; another engine's warm-up (bench spec, tests) armed the
        # late-compile recorder for its own serving, not for this start-up.
        warmup.COMPILES.armed = False
        config = config or EngineConfig()
        device = config.resolve_device()
        if config.weights not in WEIGHTS:
            raise LuceboxError(f"--weights is {config.weights}; choose from {', '.join(WEIGHTS)}")
        if config.kv_dtype not in KV_DTYPES:
            raise LuceboxError(f"--kv-dtype is {config.kv_dtype!r}; choose from {', '.join(KV_DTYPES)}")
        if config.tensor_parallel > 1:
            from lucebox.engine.parallel.worker import tensor_parallel_engine

            return tensor_parallel_engine(Path(path), config, quiet)
        cap = None
        if config.gpu_memory is not None and device.type == "cuda":
            from lucebox.engine.runtime.memory_plan import apply_cap

            cap = apply_cap(device, config.gpu_memory)  # before loading, so the weights count against it
        try:
            loaded = load_model(Path(path), device=device, dtype=config.resolve_dtype(device), quiet=quiet,
                                weights=config.weights,
                                cap_bytes=None if cap is None else cap - torch.cuda.memory_reserved(device))
        except torch.cuda.OutOfMemoryError:
            if config.gpu_memory is None:
                raise
            raise LuceboxError(f"loading the model's weights needs more than --gpu-memory {config.gpu_memory:g} GB "
                               "on the device") from None
        return cls(loaded, config)

    def enable_speculation(self, draft: Path, *, ddtree: bool = False, budget: int = 22,
                           drafter: Any = None) -> None:
        """Load a DFlash drafter for this target (unless `drafter` is it, loaded already); decode steps then
        draft and verify. EngineConfig.draft does this at construction, inside the memory plan."""
        drafter = drafter if drafter is not None else self._load_drafter(draft)
        if self.verify_rows == 0:
            log.warning("speculative decoding is off: the recurrent states of even one verification of 2 rows "
                        "(%.1f MiB each) do not fit the memory plan", RecurrentStates.bytes_per_slot(
                            self.model_config) / 2**20)
            return
        spec = self.spec_decoder_class()(drafter, self.drafter_target, self.kv, ddtree=ddtree, budget=budget,
                                         dtype=self.loaded.dtype, max_rows=self.verify_rows)
        if self.hybrid:
            slot = RecurrentStates.bytes_per_slot(self.model_config)
            log.info("speculation on a hybrid: a verification keeps %d rows x %.1f MiB of recurrent state per "
                     "sequence (%.2f GiB for %d sequences)", spec.rows_per_step, slot / 2**20,
                     spec.rows_per_step * slot * self.state_slots / 2**30, self.state_slots)
        self.set_speculation(spec)
        self.draft_path = Path(draft)
        log.info("speculative decoding: DFlash drafter %s (%d layers, block %d)%s", draft,
                 drafter.cfg.num_layers, drafter.cfg.block_size, f", DDTree budget {budget}" if ddtree else "")

    @property
    def drafter_target(self) -> Any:
        """Where the drafter reads the target's embedding and LM head (engine/parallel: whole copies on rank 0)."""
        return self.loaded.model

    def spec_decoder_class(self) -> type[SpecDecoder]:
        """The speculative decoder's class (engine/parallel's also tells the other ranks DDTree's K/V moves)."""
        from lucebox.engine.spec.dflash import SpecDecoder

        return SpecDecoder

    def _load_drafter(self, draft: Path) -> Any:
        from lucebox.engine.spec.drafter import load_drafter

        return load_drafter(draft, self.model_config, self.device, self.loaded.dtype)

    def enable_prefix_cache(self, cfg: Any, template: Any = None) -> None:
        """Tiered prefix cache (lucebox.cache): GPU blocks, RAM snapshots, optional disk.

        With speculation on (enable it first), cached entries carry the drafter's context KV too,
        and the disk folder's layout names the drafter, so a hit also restores the drafter's context."""
        from lucebox.cache.layout import layout_id, model_identity
        from lucebox.cache.manager import PrefixCache
        from lucebox.cache.markers import ChatMarkers, NoChatMarkers

        markers = None
        if template is not None:
            try:
                markers = ChatMarkers.from_template(template, self.tokenizer)
            except NoChatMarkers as exc:
                log.info("prefix cache: no turn markers in the chat template (%s); turn snapshots off", exc)
        mc = self.model_config
        extra: dict[str, object] = {}
        if self.spec is not None:
            dc = self.spec.drafter.cfg
            extra["drafter"] = [model_identity(self.draft_path) if self.draft_path is not None else "unnamed",
                                dc.num_layers, dc.num_kv_heads, dc.head_dim]
        skew = getattr(self.loaded.model, "router_skew", None)
        if skew is not None:  # a routing simulation (spark/simulate.py) changes every MoE layer's output
            extra["router_skew"] = skew
        target = self.snapshot_kv()
        if target.states is not None:  # a hybrid's snapshots hold its recurrent state (cache/state_snapshots.py)
            extra["state"] = [list(shape) for shape in target.states.shapes()]
        layout = layout_id(model_path=self.loaded.path, kv_dtype=self.kv.kv_dtype, block_size=self.kv.block_size,
                           n_ctx=self.n_ctx, template_sha1=template.sha1 if template is not None else "",
                           num_layers=mc.num_layers, num_kv_heads=target.kv_heads, head_dim=mc.head_dim, extra=extra)
        if self.cache is not None:
            self.cache.close()  # a replaced cache's threads stop once its queued disk writes are done
        self.cache = PrefixCache(cfg, self.kv, markers, layout, draft_kv=self.spec.kv if self.spec else None,
                                 target=target)
        self.scheduler.cache = self.cache

    def snapshot_kv(self) -> LocalKV:
        """What the prefix cache's RAM and disk snapshots copy: this engine's KV and recurrent states
        (engine/parallel: every rank's)."""
        from lucebox.cache.snapshots import LocalKV

        return LocalKV(self.kv)

    @property
    def blocks_in_use(self) -> int:
        """KV blocks held by sequences (what the prefix cache keeps alive is not counted)."""
        return self.kv.pool.num_used - (self.cache.blocks_held if self.cache is not None else 0)

    def set_speculation(self, spec: SpecDecoder | None) -> None:
        """Switch decoding mode (only between requests: no sequence may be running)."""
        assert not self.has_work(), "switch speculation only when the engine is idle"
        # Cached entries hold the drafter context of the mode they were made in; switch before caching.
        assert self.cache is None, "switch speculation before enable_prefix_cache"
        self.spec = spec
        self.draft_path = None
        self.ahead = None
        self.scheduler.decode_rows = spec.reserve_rows if spec else 1
        self.scheduler.on_release = self._release_spec if spec else None
        self.adaptive = None
        self.scheduler.decode_start = None
        if spec is not None:
            from lucebox.engine.spec.adaptive import AdaptiveSpec

            self.adaptive = AdaptiveSpec(self.config.spec_adaptive)
            if self._lazy_context:
                self.scheduler.decode_start = self._decode_start
        if self.runner.graphs is not None:  # a hybrid's plain rows feed the drafter context from the decode graphs
            self.runner.graphs.keep_layers(spec.capture if spec is not None and not self._lazy_context else ())
        if self.runner.prefill_graphs is not None:  # prompt and catch-up chunks feed the drafter context
            self.runner.prefill_graphs.set_capture(spec.capture if spec is not None else ())
        static = self.config.spec_static
        if spec is not None and self._static_hybrid_ok() and self.runner.guard is None and (
                static or (static is None and self.device.type == "cuda" and self.config.cuda_graphs)):
            from lucebox.engine.spec.static import StaticSpec

            spec.static = StaticSpec(spec, self.config.max_num_seqs, self.n_ctx)
        if self._runs_ahead() and spec is None:
            self.ahead = Ahead(self.runner, self.scheduler)
        elif self._runs_ahead() and self._lazy_context:  # with a drafter: its plain rows, its one-launch steps
            self.ahead = Ahead(self.runner, self.scheduler, self._decodes_plainly, spec.static, self._commit_ahead)

    def _static_hybrid_ok(self) -> bool:
        """Whether speculation's fixed-shape steps can take this target: any but a hybrid, and a hybrid on one
        device whose verification is capturable (on CUDA the delta rule in `tree_step`, not the torch recurrence
        that batches a depth at a time; on the CPU nothing is captured)."""
        if not self.hybrid:
            return True
        if self.config.tensor_parallel > 1:
            return False
        probe = torch.empty(0, device=self.device)
        return self.device.type != "cuda" or (cuda_graphs.HYBRID and triton_deltanet.use_tree_kernel(probe))

    def _runs_ahead(self) -> bool:
        """Whether greedy decode steps launch one step ahead (EngineConfig.ahead, LUCEBOX_AHEAD)."""
        on = self.config.ahead
        if on is None and os.environ.get("LUCEBOX_AHEAD") in ("0", "1"):
            on = os.environ["LUCEBOX_AHEAD"] == "1"
        if on is None:
            on = self.runner.graphs is not None
        graphs = self.runner.graphs is not None
        return (on and self.config.tensor_parallel == 1 and (self.device.type != "cuda" or graphs)
                and self.runner.guard is None)  # a guarded step is read before it is kept (spark/engine.py)

    @property
    def _lazy_context(self) -> bool:
        """Plain rows leave the drafter context behind; a sequence that drafts again re-runs those positions
        first (Scheduler.decode_start). Not a hybrid: re-running positions would advance its recurrent state
        twice, so its plain rows extend the drafter context as they go (its steps then stay speculative ones)."""
        return not self.hybrid

    def _decodes_plainly(self, seq: Sequence) -> bool:
        """A sequence the adaptive rule has decoding plainly, and its drafter context left behind (lazy)."""
        assert self.adaptive is not None
        return not self.adaptive.speculates(seq)

    def _count_plain(self, chunks: list[Chunk]) -> None:
        """The adaptive rule counts the plain rows of a step launched ahead (as `_spec_step` does its own), once
        it is launched: a probe that starts here makes the next step a speculative one, not this one."""
        if self.adaptive is not None:
            for c in chunks:
                if not self.adaptive.speculates(c.seq):
                    self.adaptive.plain_token(c.seq)

    def _commit_ahead(self, c: Chunk, tokens: list[int], batch: int) -> StepOutput:
        """A speculative step launched ahead: commit one row's verified tokens, as `_spec_step` does."""
        assert self.adaptive is not None
        if self.adaptive.speculates(c.seq):  # (not: the step before, resolved after this one launched, stopped it)
            self.adaptive.observe(c.seq, len(tokens), batch)
        n_before = len(c.seq.token_ids)
        finished = self._commit_verified(c, tokens, None)
        return StepOutput(c.seq, c.seq.token_ids[n_before:], finished)

    def _decode_start(self, seq: Sequence) -> int:
        assert self.adaptive is not None
        return min(seq.draft_len, seq.num_computed) if self.adaptive.speculates(seq) else seq.num_computed

    def _release_spec(self, seq: Sequence) -> None:
        assert self.spec is not None and self.adaptive is not None
        self.spec.release(seq)
        self.adaptive.release(seq)

    def _default_kv_tokens(self) -> int:
        """Host RAM (CPU devices): room for a few full-context sequences within 1 GiB, leaving room for
        everything else. CUDA devices are sized by `_plan_memory`."""
        per_token = KVCache.bytes_per_token(self.model_config, self.loaded.dtype, self.kv_dtype)
        return max(self.config.block_size * 2, min(4 * self.n_ctx, (1 << 30) // per_token))

    def _plan_memory(self, drafter: Any = None) -> MemoryPlan:
        """The KV pool's size on a CUDA device: the budget (the --gpu-memory cap, or in use + free) less the
        weights, a measured activation peak and the graph pool (lucebox.engine.runtime.memory_plan); logged in one line.
        Without a cap the pool holds at most 4 full contexts, leaving the rest to a scorer, a drafter or a
        benchmark's reference model loaded next to it. A drafter (loaded already) adds its context K/V to
        every block, and its CUDA graphs' outputs (one set per batch bucket) to the graph margin."""
        from lucebox.engine.runtime import memory_plan as mp
        from lucebox.engine.runtime import prefill_graphs

        cfg, dev = self.config, self.device
        cap = mp.apply_cap(dev, cfg.gpu_memory) if cfg.gpu_memory is not None else None
        torch.cuda.synchronize(dev)
        weights = torch.cuda.memory_allocated(dev)
        free, _ = torch.cuda.mem_get_info(dev)
        budget = cap if cap is not None else torch.cuda.memory_reserved(dev) + int(free * mp.UNCAPPED_SHARE)
        per_token = KVCache.bytes_per_token(self.model_config, self.loaded.dtype, self.kv_dtype)
        spec_outputs = 0
        if drafter is not None:
            dc, size = drafter.cfg, torch.tensor([], dtype=self.loaded.dtype).element_size()
            per_token += dc.num_layers * 2 * dc.num_kv_heads * dc.head_dim * size
            # verify graphs: logits (fp32 at most) and the captured target layers, for every row of a batch
            # bucket (rows per step: at most the block or tree budget, the block size bounds the chain)
            rows = max(dc.block_size, cfg.ddtree_budget + 1 if cfg.ddtree else 0)
            mc = self.model_config
            row_bytes = mc.vocab_size * 4 + len(dc.target_layer_ids) * mc.hidden_size * size
            spec_outputs = sum(batch_buckets(cfg.max_num_seqs)) * rows * row_bytes
        chunk = min(cfg.max_step_tokens, self.n_ctx)
        # The probe pool: the largest chunk over a chunk of context (4096 tokens at least), within a quarter
        # of what the weights leave.
        probe = max(chunk, min(self.n_ctx, max(2 * chunk, 4096), max(budget - weights, 0) // 4 // per_token))
        try:
            measured = mp.measure_activations(self.loaded.model, self.loaded.dtype, dev, block_size=cfg.block_size,
                                              chunk=chunk, batch=cfg.max_num_seqs, n_ctx=self.n_ctx,
                                              probe_tokens=probe,
                                              graphs=cfg.cuda_graphs and (not self.hybrid or cuda_graphs.HYBRID),
                                              kv_dtype=self.kv_dtype)
        except torch.cuda.OutOfMemoryError:
            where = f"--gpu-memory {cfg.gpu_memory:g} GB" if cap is not None else "the free device memory"
            raise LuceboxError(f"a {chunk}-token prefill chunk does not fit next to the weights "
                               f"({weights / mp.GB:.2f} GB) in {where}: lower --max-step-tokens") from None
        activations = max(mp.extrapolate_peak(measured.prefill, self.n_ctx), measured.decode)
        # One decode graph's workspace (the graphs share one pool) plus the static outputs: twice the step.
        graphs = 2 * measured.graph + spec_outputs + mp.slack(budget)
        if cfg.cuda_graphs and not self.hybrid and self.model_config.n_experts == 0:
            # Prefill graphs (their own pool, replayed beside a decode graph): about one chunk's workspace,
            # and their logits for every chunk a step can hold.
            size = torch.tensor([], dtype=self.loaded.dtype).element_size()
            workspace = mp.extrapolate_peak(measured.prefill, min(self.n_ctx, prefill_graphs.MAX_CTX))
            graphs += workspace + cfg.max_num_seqs * self.model_config.vocab_size * size
        if self.hybrid:  # state slots (and the scratch one) next to the KV pool, each verified row's state
            slot = RecurrentStates.bytes_per_slot(self.model_config)
            rows = (cfg.ddtree_budget + 1 if cfg.ddtree else drafter.cfg.block_size) if drafter is not None else 0
            self.state_slots, self.verify_rows = mp.state_slots(
                room=budget - weights - activations - graphs, slot_bytes=slot, max_seqs=cfg.max_num_seqs,
                verify_rows=rows)
            weights += (self.state_slots + 1) * slot
            activations += self.state_slots * (self.verify_rows + 1) * slot if self.verify_rows else 0
            if self.state_slots < cfg.max_num_seqs or self.verify_rows < rows:
                log.info("memory plan: %d recurrent state slots of %.1f MiB (--max-num-seqs %d; more sequences wait "
                         "for a slot)%s", self.state_slots, slot / 2**20, cfg.max_num_seqs,
                         f", verification capped at {self.verify_rows} rows (of {rows})" if self.verify_rows < rows
                         else "")
        plan = mp.plan_memory(budget=budget, capped=cap is not None, weights=weights, activations=activations,
                              graphs=graphs, block_bytes=per_token * cfg.block_size, block_size=cfg.block_size,
                              min_tokens=chunk, max_tokens=None if cap is not None else 4 * self.n_ctx)
        log.info("%s", plan.line())
        return plan

    # ----- start-up warm-up (lucebox.engine.runtime.warmup) --------------------------

    def warm_up(self, progress: bool = True) -> float:
        """Capture every CUDA graph bucket this configuration can reach and run every eager shape class once,
        so no request waits for a capture or a Triton compile; returns the seconds taken (also logged).
        On the CPU (no graphs, no JIT) one short request. The engine must be idle."""
        from lucebox.engine.runtime import warmup
        from lucebox.progress import Progress

        t = time.monotonic()
        graphs = self.runner.graphs
        static = self.spec.static if self.spec is not None else None
        if self.device.type == "cuda":
            warmup.COMPILES.install()
            warmup.COMPILES.armed = False  # (as from_path: a warm-up's compiles are not late ones)
            limit = min(self.n_ctx - 4, (self.kv.pool.num_blocks - 2) * self.kv.block_size - 4)
            lengths = warmup.shape_lengths(min(self.config.max_step_tokens, limit), limit)
            prefill = self.runner.prefill_graphs
            total = ((len(graphs.buckets()) if graphs else 0) + (len(static.graph_keys()) if static else 0)
                     + (len(prefill.buckets) if prefill else 0))
            bar = Progress("warm-up", total + len(lengths), "steps", quiet=not progress)
            self._tune_quant_kernels()  # first: a graph keeps the launch config it was captured with
            self._compile_attention(limit)
            vocab = self.model_config.vocab_size  # the constrained greedy kernel, for eager (fp32) and graph logits
            for dtype in {torch.float32, self.loaded.dtype}:
                greedy_tokens(torch.zeros(1, vocab, device=self.device, dtype=dtype),
                              np.full((1, (vocab + 31) // 32), -1, np.int32))
            captured = graphs.capture_all(bar.advance) if graphs else 0
            captured_prefill = prefill.capture_all(bar.advance) if prefill else 0
            captured_spec = static.capture_all(bar.advance) if static else 0
            steps = warmup.warm_requests(self, lengths, bar.advance)
            if self.adaptive is not None and self.adaptive.enabled:
                from lucebox.engine.spec.adaptive import measure_cost_ratio

                self.adaptive.cost = measure_cost_ratio(self)  # r, where per-sequence speculation pays
            torch.cuda.synchronize(self.device)
            bar.close()
        else:
            captured = captured_prefill = captured_spec = 0
            steps = warmup.warm_requests(self, [1])
        for g in (graphs, self.runner.prefill_graphs, static):
            if g is not None:
                g.ready = True
        self._compiles_at_ready = warmup.COMPILES.count
        if self.pacer is not None:  # the warm-up's steps include compiles and captures: measure afresh
            self.pacer = PrefillPacer(self.config.max_step_tokens)
        warmup.COMPILES.armed = self.device.type == "cuda"
        self.warm_up_end = time.monotonic()
        self.warm_up_seconds = self.warm_up_end - t
        log.info("warm-up: %d decode graphs, %d prefill graphs, %d speculative graphs captured, %d steps of every "
                 "shape class, in %.1fs", captured, captured_prefill, captured_spec, steps, self.warm_up_seconds)
        return self.warm_up_seconds

    def _compile_attention(self, max_rows: int) -> None:
        """Every paged prefill-attention variant (tile config, key splits, window, tree; a drafter's blocks)
        compiled up front: the synthetic requests below cannot reach all of them (the split count depends on the
        live context)."""
        from lucebox.engine.kernels import triton_attention

        if not triton_attention.available(self.device):
            return
        cfg = self.model_config
        window = cfg.sliding_window if cfg.has_sliding_layers else None
        scale = cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim**-0.5
        for heads in sorted({cfg.layer_heads(i) for i in range(cfg.num_layers)}):  # Laguna: 48 and 64
            triton_attention.warm_up(self.kv.data[0, 0], self.kv.data[0, 1], num_heads=heads,
                                     page=self.kv.block_size, scale=scale, window=window,
                                     max_rows=min(self.config.max_step_tokens, max_rows), tree=self.spec is not None,
                                     dtype=self.loaded.dtype)
        if self.spec is not None and triton_attention.supports(self.spec.drafter.cfg.head_dim):  # its blocks
            dc, dkv = self.spec.drafter.cfg, self.spec.kv.data
            triton_attention.warm_up(dkv[0, 0], dkv[0, 1], num_heads=dc.num_heads, page=self.kv.block_size,
                                     scale=dc.head_dim**-0.5, window=dc.sliding_window, max_rows=dc.block_size,
                                     dtype=self.loaded.dtype, bidirectional=True)

    def _tune_quant_kernels(self) -> None:
        """Pick the quantized matmul kernels' launch configs for this model's weight shapes (timed once)."""
        from lucebox.engine.weights.quant import linear

        tuned = linear.warm_up(self.loaded.model)
        if tuned:
            log.info("quantized kernels tuned: %s", linear.summary(tuned))

    @property
    def captures_after_ready(self) -> int:
        """CUDA graphs captured after the warm-up (each one made a request wait): 0 unless it missed a bucket."""
        static = self.spec.static if self.spec is not None else None
        return sum(g.captures_after_ready for g in (self.runner.graphs, self.runner.prefill_graphs, static)
                   if g is not None)

    @property
    def compiles_after_ready(self) -> int:
        """Triton kernels compiled in this process since the warm-up: 0 unless it missed a shape."""
        from lucebox.engine.runtime.warmup import COMPILES

        at = getattr(self, "_compiles_at_ready", None)
        return 0 if at is None else COMPILES.count - at

    def warm_up_props(self) -> dict[str, Any]:
        """/props `warm_up`: whether it ran, how long it took, and what was compiled or captured after it."""
        graphs = self.runner.graphs
        static = self.spec.static if self.spec is not None else None
        return {"done": self.warm_up_end is not None,
                "seconds": round(self.warm_up_seconds, 3) if self.warm_up_seconds is not None else None,
                "decode_graphs": len(graphs.graphs) if graphs else 0,
                "prefill_graphs": len(self.runner.prefill_graphs.graphs) if self.runner.prefill_graphs else 0,
                "spec_graphs": len(static.graphs) if static else 0,
                "captures_after_ready": self.captures_after_ready, "compiles_after_ready": self.compiles_after_ready}

    # ----- requests ----------------------------------------------------------

    def add(self, prompt_ids: list[int], params: SamplingParams, constraint: Constraint | None = None) -> Sequence:
        """Queue a request; raises LuceboxError if it can never fit."""
        seq = self.new_sequence(prompt_ids, params, constraint)
        self.scheduler.add(seq)
        return seq

    def new_sequence(self, prompt_ids: list[int], params: SamplingParams,
                     constraint: Constraint | None = None) -> Sequence:
        """Validate a request and make its Sequence, without queueing it (any thread). `constraint`: the
        grammar its output must follow (grammar.py), fresh for this sequence."""
        if not prompt_ids:
            raise LuceboxError("the prompt is empty")
        if len(prompt_ids) >= self.n_ctx:
            raise LuceboxError(
                f"the prompt has {len(prompt_ids)} tokens; this model's context is {self.n_ctx} tokens"
            )
        if self.kv.blocks_for(len(prompt_ids) + 1) > self.kv.pool.num_blocks - 1:
            raise LuceboxError(f"the prompt has {len(prompt_ids)} tokens, more than the KV cache holds")
        vocab = self.model_config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            bad = next(t for t in prompt_ids if not 0 <= t < vocab)
            raise LuceboxError(f"token id {bad} in the prompt is outside this model's vocabulary (0..{vocab - 1})")
        try:
            params.validate()
        except ValueError as exc:
            raise LuceboxError(str(exc)) from None
        return Sequence(list(prompt_ids), params, constraint=constraint)

    def abort(self, seq: Sequence, reason: str = "cancelled") -> None:
        """End `seq` now; with reason "stop" (the answer is complete) its prefix is still cached."""
        self.settle()
        self.scheduler.abort(seq, reason)

    def settle(self) -> None:
        """Resolve the decode step launched ahead, if any (runtime/ahead.py): call it before reading or
        changing a running sequence between steps. Its outputs come with the next `step()`."""
        if self.ahead is not None and self.ahead.inflight is not None:
            self._settled += self.ahead.settle()

    def has_work(self) -> bool:
        """Whether `step()` has something to do (a sequence held at Sequence.hold_at is nothing to do)."""
        return (self.scheduler.has_work() or bool(self._settled)
                or (self.ahead is not None and self.ahead.inflight is not None))

    def step(self) -> list[StepOutput]:
        """Run one model step; returns the sequences that got a token or ended.

        A sequence whose rows make the step raise (its sampling parameters, say) ends alone with
        finish reason "error"; the others get exactly the tokens they would have got without it.
        """
        outputs, self._settled = self._settled, []
        ahead = self.ahead
        if ahead is not None and ahead.inflight is not None:
            t0 = time.perf_counter()
            chunks = ahead.next_chunks()
            if chunks is not None:  # the next step goes behind the one in flight, then that one is read
                held = ahead.advance(chunks)
                self._count_plain(chunks)
                self.last_step = [(c.seq.seq_id, c.start, c.n) for c in chunks]
                if self.on_launched is not None:
                    self.on_launched()
                outputs += ahead.resolve(held)
                if self.pacer is not None:  # steps back to back: a call lasts about one decode step
                    self.pacer.observe(len(held.chunks), 0, time.perf_counter() - t0)
                return outputs
            outputs += ahead.settle()
        if self.pacer is not None:
            self.scheduler.prefill_cap = self.pacer.budget()
        t0 = time.perf_counter()  # the pacer's step time
        chunks = self.scheduler.schedule()
        self.last_step = [(c.seq.seq_id, c.start, c.n) for c in chunks]
        if not chunks:
            return outputs
        if ahead is not None and ahead.eligible(chunks):  # its tokens are read in the next step()
            ahead.launch(chunks)
            self._count_plain(chunks)
            if self.on_launched is not None:
                self.on_launched()
            return outputs
        if self.pacer is None:
            return outputs + (self._spec_step(chunks) if self.spec is not None else self._plain_step(chunks))
        decode_rows = sum(1 for c in chunks if is_decode(c))  # before the step: it appends the sampled tokens
        outputs += self._spec_step(chunks) if self.spec is not None else self._plain_step(chunks)
        self.pacer.observe(decode_rows, sum(c.n for c in chunks) - decode_rows, time.perf_counter() - t0)
        return outputs

    def _plain_step(self, chunks: list[Chunk], extend: bool = False) -> list[StepOutput]:
        """A step without drafts. `extend`: decode rows of a hybrid that speculates, whose drafter context
        follows them (`_forward_and_sample`)."""
        failed: dict[Sequence, Exception] = {}
        sampled, tokens, logprobs = self._forward_and_sample(chunks, failed, extend)
        outputs = [self._fail(seq, exc) for seq, exc in failed.items()]
        n_before = [len(c.seq.token_ids) for c in sampled]
        finished = set(self.scheduler.postprocess(chunks, sampled, tokens, logprobs))
        outputs += [StepOutput(c.seq, c.seq.token_ids[n:], c.seq in finished)
                    for c, n in zip(sampled, n_before) if c.seq not in failed]
        return outputs

    def _forward_and_sample(self, chunks: list[Chunk], failed: dict[Sequence, Exception], extend: bool = False
                            ) -> tuple[list[Chunk], list[int], list[TokenLogprobs | None]]:
        """Forward the chunks and pick each sampling chunk's token; returns (sampled chunks, tokens, logprobs).

        Nothing here changes a sequence (but, with `extend`, the drafter context of decode rows that ran: the
        speculating hybrid's plain rows, whose drafter layers' outputs the forward pass kept), so when the batch
        raises, each chunk is run again alone and one that still raises goes into `failed` (its placeholder
        token is never used)."""
        try:
            sampled, logits, argmax, features = self.runner.run(chunks, self.spec.capture if extend else ())
            if self.on_launched is not None:
                self.on_launched()
            for i, c in enumerate(sampled if extend else ()):
                self.spec.extend_context(c.seq, c.start, [f[i:i + 1] for f in features])
        except Exception as exc:  # noqa: BLE001 - isolated below, or reported for the one sequence
            if len(chunks) == 1:
                failed[chunks[0].seq] = exc
                return [], [], []
            log.warning("a step of %d chunks failed (%s); running them one by one", len(chunks), exc)
            all_sampled: list[Chunk] = []
            all_tokens: list[int] = []
            all_lps: list[TokenLogprobs | None] = []
            for c in chunks:
                one, toks, lps = self._forward_and_sample([c], failed, extend)
                all_sampled += one
                all_tokens += toks
                all_lps += lps
            return all_sampled, all_tokens, all_lps
        rows = [self._row(c) for c in sampled]
        # The grammars' masks are computed here, while the device still runs the forward pass.
        bitmasks = self._bitmasks(sampled)
        if all(r.params.greedy and not r.params.has_penalties and r.params.logprobs is None for r in rows):
            if bitmasks is None and argmax is not None:
                return sampled, argmax.tolist(), [None] * len(rows)
            if bitmasks is not None:
                return sampled, greedy_tokens(logits, bitmasks), [None] * len(rows)
        allowed = None if bitmasks is None else expand_masks(bitmasks, logits.shape[-1], logits.device)
        try:
            tokens, logprobs = sample(logits, rows, allowed)
        except Exception:  # noqa: BLE001 - the sampler raises before drawing: retry row by row
            tokens, logprobs = [], []
            for i, (c, row) in enumerate(zip(sampled, rows)):
                try:
                    t, lp = sample(logits[i: i + 1], [row], None if allowed is None else allowed[i: i + 1])
                except Exception as exc:  # noqa: BLE001 - this row's own failure
                    failed[c.seq] = exc
                    t, lp = [0], [None]
                tokens += t
                logprobs += lp
        return sampled, tokens, logprobs

    @staticmethod
    def _bitmasks(sampled: list[Chunk]) -> np.ndarray | None:
        """[rows, words] int32: what each sampling row's grammar allows as a bitmask (every bit set for a row
        without one); None when no row has a grammar."""
        held = [(i, c.seq.constraint) for i, c in enumerate(sampled) if c.seq.constraint is not None]
        if not held:
            return None
        out = np.full((len(sampled), held[0][1].words), -1, dtype=np.int32)
        out[[i for i, _ in held]] = fill_masks([g for _, g in held])
        return out

    def _allowed(self, sampled: list[Chunk], logits: torch.Tensor) -> torch.Tensor | None:
        """[rows, vocab] bool: `_bitmasks` unpacked on the logits' device."""
        bitmasks = self._bitmasks(sampled)
        return None if bitmasks is None else expand_masks(bitmasks, logits.shape[-1], logits.device)

    def _fail(self, seq: Sequence, exc: Exception) -> StepOutput:
        """End one sequence whose step raised, with finish reason "error"; the rest of the batch goes on."""
        log.warning("request %d failed in the engine step (%s: %s); the other sequences continue", seq.seq_id,
                    type(exc).__name__, exc, exc_info=None if isinstance(exc, SamplingError) else exc)
        self.scheduler.abort(seq, "error")
        return StepOutput(seq, [], True)

    def _spec_step(self, chunks: list[Chunk]) -> list[StepOutput]:
        """Draft for the decoding sequences that speculate, verify every draft and run the prefill chunks and
        the other decodes (sequences whose drafts do not pay now: spec/adaptive.py) in one forward; a step
        where nothing drafts or prefills is a plain step.

        The target's choices are made one sequence at a time (`_chooser`), so a sequence whose sampling
        raises ends alone with "error"; a failed drafter or target pass (before any sequence changed)
        is run again chunk by chunk, and a chunk that still fails ends its sequence alone."""
        spec, adaptive = self.spec, self.adaptive
        assert spec is not None and adaptive is not None
        decodes = [c for c in chunks if is_decode(c)]
        others = [c for c in chunks if not is_decode(c)]
        # A sequence drafts once its drafter context reaches its last token (one returning to speculation
        # first re-runs its plain stretch: a longer chunk, among `others`).
        drafting = [c for c in decodes if adaptive.speculates(c.seq) and c.seq.draft_len == c.start]
        plain = [c for c in decodes if not (adaptive.speculates(c.seq) and c.seq.draft_len == c.start)]
        for c in plain:
            if not adaptive.speculates(c.seq):
                adaptive.plain_token(c.seq)
        lazy = self._lazy_context
        if not drafting and not others:  # (a hybrid's plain rows extend the drafter context as they go)
            return self._plain_step(plain, extend=not lazy)
        outputs = []
        failed: dict[Sequence, Exception] = {}
        if drafting and spec.static is not None:
            step_lps: dict[int, list[TokenLogprobs | None]] = {}

            def chooser(chunk: Chunk, logits: torch.Tensor, best: list[int]) -> Callable[[int, list[int]], int]:
                if _argmax_only(chunk.seq):
                    return lambda row, accepted: best[row]
                return self._chooser(chunk.seq, logits.float(), step_lps.setdefault(chunk.seq.seq_id, []), failed)

            try:
                argmax = all(_argmax_only(c.seq) and not c.seq.forced_tokens for c in drafting)
                committed = spec.static.step(drafting, chooser, argmax=argmax)
            except Exception as exc:  # noqa: BLE001 - no sequence has changed yet: isolate the failing one
                return self._spec_one_by_one(chunks, exc)
            if committed is not None:
                for c, tokens in zip(drafting, committed):
                    adaptive.observe(c.seq, len(tokens), len(decodes))
                    if c.seq in failed:
                        outputs.append(self._fail(c.seq, failed[c.seq]))
                        continue
                    n_before = len(c.seq.token_ids)
                    lps = step_lps.get(c.seq.seq_id)
                    finished = self._commit_verified(c, tokens, lps)
                    outputs.append(StepOutput(c.seq, c.seq.token_ids[n_before:], finished))
                drafting = []
                if not others:  # the plain rows alone: the plain path (a decode graph's replay)
                    return outputs + (self._plain_step(plain, extend=not lazy) if plain else [])
        try:
            verify = spec.propose(drafting) if drafting else []
            graphs = self.runner.prefill_graphs  # no verification: prompt or catch-up chunks (and plain rows)
            result = (graphs.run_step(others + plain) if graphs is not None and not verify
                      and graphs.capture == tuple(spec.capture) else None)
            if result is None:
                result = self.runner.forward(self.runner.prepare(verify + others + plain), capture=spec.capture)
        except Exception as exc:  # noqa: BLE001 - no sequence has changed yet: isolate the failing one
            return outputs + self._spec_one_by_one(drafting + others + plain, exc)
        plain_rows = {id(c) for c in plain}
        for i, c in enumerate(result.inputs.order):
            seq = c.seq
            n_before = len(seq.token_ids)
            if c.verify:
                lps: list[TokenLogprobs | None] = []
                choose = self._chooser(seq, result.chunk_logits(i), lps, failed)
                tokens = spec.accept(c, result.chunk_logits(i), result.chunk_features(i), choose)
                adaptive.observe(seq, len(tokens), len(decodes))
                if seq in failed:
                    outputs.append(self._fail(seq, failed[seq]))
                    continue
                finished = self._commit_verified(c, tokens, lps)
            else:
                # (lazy: a plain row, or a chunk after one, leaves the drafter context where it is)
                if not lazy or (id(c) not in plain_rows and seq.draft_len == c.start):
                    spec.extend_context(seq, c.start, result.chunk_features(i))
                seq.num_computed = c.start + c.n
                if not c.wants_logits:
                    continue
                try:
                    logits = result.chunk_logits(i)
                    toks, lps = sample(logits, [self._row(c)], self._allowed([c], logits))
                except Exception as exc:  # noqa: BLE001 - this sequence's own failure
                    outputs.append(self._fail(seq, exc))
                    continue
                finished = self.scheduler.commit(seq, toks, lps)
            outputs.append(StepOutput(seq, seq.token_ids[n_before:], finished))
        return outputs

    def _spec_one_by_one(self, chunks: list[Chunk], exc: Exception) -> list[StepOutput]:
        """A speculative step over `chunks` raised before changing them: run each alone; one that still
        raises ends its sequence with "error"."""
        if len(chunks) == 1:
            return [self._fail(chunks[0].seq, exc)]
        log.warning("a speculative step of %d chunks failed (%s); running them one by one", len(chunks), exc)
        return [out for c in chunks for out in self._spec_step([c])]

    def _commit_verified(self, c: Chunk, tokens: list[int], lps: list[TokenLogprobs | None] | None) -> bool:
        """Commit a verification's tokens; True if the sequence finished.

        Forced tokens (a thinking budget's `</think>`) replace the verified ones, as in plain decoding:
        then only the last known token's KV and drafter context stay, and the forced ones are prefilled."""
        seq = c.seq
        if seq.forced_tokens:
            seq.num_computed = seq.draft_len = c.start + 1
        return self.scheduler.commit(seq, self._within_limit(seq, tokens), lps)

    def _chooser(self, seq: Sequence, logits: torch.Tensor, lps: list[TokenLogprobs | None],
                 failed: dict[Sequence, Exception]) -> Callable[[int, list[int]], int]:
        """The target's choice at a verified row, as plain decoding would make it there.

        If sampling raises for this sequence, the error goes into `failed` and the choice is -1,
        which no draft token equals, so the walk ends there (the caller then fails the sequence)."""
        p = seq.params
        grammar = seq.constraint
        if _argmax_only(seq):
            best = logits.argmax(-1).tolist()
            return lambda row, accepted: best[row]

        def choose(row: int, accepted: list[int]) -> int:
            history = seq.output_ids + accepted if p.has_penalties else []
            # A grammar's mask at this row: after the tokens this verification accepted before it.
            allowed = None if grammar is None else expand_masks(grammar.mask_after(accepted)[None],
                                                                logits.shape[-1], logits.device)
            try:
                toks, lp = sample(logits[row: row + 1],
                                  [SampleRow(p, seq.prompt_ids, history, p.seed, seq.num_output + len(accepted))],
                                  allowed)
            except Exception as exc:  # noqa: BLE001 - handed to the caller through `failed`
                failed[seq] = exc
                return -1
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
        return SampleRow(s.params, s.prompt_ids, s.output_ids if s.params.has_penalties else [], s.params.seed,
                         s.num_output)

    # ----- conveniences (CLI, tests, benchmarks) -----------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Run prompts to completion together (batched); returns the output ids."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.add(p, sp) for p, sp in zip(prompts, plist)]
        while any(not s.is_finished for s in seqs):
            self.step()
        self.settle()  # a step launched ahead for these finished sequences: resolved, so the engine is idle
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

    def token_importance(self, ids: list[int], cfg: Any) -> torch.Tensor:
        """PFlash's scores of a prompt with this engine's model as its own scorer (pflash/scorer.py; a
        tensor-parallel engine runs it on every rank's shard)."""
        from lucebox.engine.pflash.scorer import token_importance

        return token_importance(self.loaded.model, ids, cfg)

    @torch.inference_mode()
    def score(self, token_ids: list[int], rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [len, vocab] (fp32) at every position of one prompt, for parity tests; `rows`: those
        positions' only (a long prompt's full logits over a 262K vocabulary are GBs)."""
        seq = Sequence(list(token_ids), SamplingParams())
        seq.block_table = self.kv.pool.allocate(self.kv.blocks_for(len(token_ids)))
        if self.kv.states is not None:
            seq.state_slot = self.kv.states.allocate()
        try:
            inputs = self.runner.prepare([Chunk(seq, 0, len(token_ids))])
            extra = {} if inputs.state is None else {"state": inputs.state}
            hidden, _ = self.loaded.model(inputs.input_ids, inputs.positions, self.kv.data, inputs.meta, **extra)
            return self.loaded.model.logits(hidden if rows is None else hidden[rows.to(hidden.device)]).float()
        finally:
            self.kv.pool.decref(seq.block_table)
            if seq.state_slot:
                self.kv.states.free(seq.state_slot)  # type: ignore[union-attr]


def _argmax_only(seq: Sequence) -> bool:
    """The target's choice at a verified row is its argmax: greedy, no penalties, logprobs or grammar."""
    p = seq.params
    return p.greedy and not p.has_penalties and p.logprobs is None and seq.constraint is None
