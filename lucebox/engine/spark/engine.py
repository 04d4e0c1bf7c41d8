"""A model served with its experts placed by Spark: loaded into host memory, the experts split into device
slots and host memory (offload.py) by a placement (placement.py, from a profile or uniform), everything else
moved to the device, then an LLMEngine over it.

The eager decode step is not one CUDA graph: which experts are resident is decided on the host every layer.
On CUDA (LUCEBOX_SPARK_GRAPHS=0 turns it off, =1 on elsewhere) decode-only steps run as CUDA graph replays
over the resident experts (offload.py's `slot_table`), guarded by `Spark.guarded`: after the replay the host
reads whether any layer routed to an expert that was not resident (`missed`, one sync a step). Such a step is
discarded: the experts it missed are copied into their layers' rings and the step replayed (`refetches`), up to
`REPLAYS` times, then run again eagerly (`redos`), which is also what happens when a ring cannot take them. A
replay that follows a miss routes the layers after the first missing one from different inputs, so it can miss
again: hence the loop.
Prefill and mixed steps stay eager and nothing runs a step ahead (runtime/ahead.py). A hybrid model's
recurrent states, which a step advances in place, are copied before a guarded step and written back before
it runs again (replayed or redone: ModelRunner.run, RecurrentStates.snapshot).

Under tensor parallelism (engine/parallel) each rank holds experts [r E/N, (r+1) E/N) of every MoE layer and
places those alone, from the same profile, on its own device: the budget stays the whole model's (as a
profile's is, and as at -tp 1), and each rank takes its experts' share of it, 1/N (a percentage is then that
percentage of each rank's experts). A rank's hot set is its own experts with the most calibration pairs;
the union over ranks can differ from one device's placement, since a rank cannot lend another its memory.
`Spark` (/props, /metrics) is rank 0's: its experts, its share of the budget, its counters.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from lucebox.engine.spark import placement
from lucebox.engine.spark.offload import LayerOffload, OffloadRule, SparkStats, measure_rule
from lucebox.engine.spark.placement import GB, Budget
from lucebox.engine.spark.profile import check_profile, expert_bytes, moe_layers, read_profile
from lucebox.errors import LuceboxError

log = logging.getLogger("lucebox.spark")
PLACEMENTS = ("auto", "calibrated", "uniform")
T = TypeVar("T")


@dataclass
class SparkConfig:
    """`--spark PROFILE --expert-gpu-budget GB|N% --spark-ring N --spark-cpu-rows N`."""

    profile: Path | None = None  # None: uniform placement
    budget: str | None = None  # None: the profile's calibration budget (uniform: 100%)
    ring: int | None = None  # ring slots per layer; None: n_experts / 8 (at most 32), at most half the budget
    cpu_rows: int | None = None  # None: measured at load (offload.measure_rule)
    promote_after: int = 2
    placement: str = "auto"  # auto: calibrated with a profile, else uniform
    ring_fit: bool = False  # shrink `ring` to what the budget holds instead of refusing (bench spark's rows)
    graphs: bool | None = None  # the graph-resident decode; None: graphs_on (bench spark sets both)

    def validate(self) -> SparkConfig:
        if self.placement not in PLACEMENTS:
            raise LuceboxError(f"--spark-placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}")
        if self.placement == "calibrated" and self.profile is None:
            raise LuceboxError("a calibrated placement needs a profile: --spark PROFILE")
        for name, value in (("--spark-ring", self.ring), ("--spark-cpu-rows", self.cpu_rows)):
            if value is not None and value < 0:
                raise LuceboxError(f"{name} must be >= 0, got {value}")
        if self.budget is not None:
            Budget.parse(self.budget)
        return self


class Spark:
    """The placed experts of one model: its layers' offloads, the counters and what was chosen (/props)."""

    REPLAYS = 2  # replays of a step after copying in what it missed, before running it again eagerly

    def __init__(self, layers: dict[int, LayerOffload], stats: SparkStats, rule: OffloadRule, info: dict[str, Any],
                 missed: torch.Tensor):
        self.layers, self.stats, self.rule, self.info = layers, stats, rule, info
        self.missed = missed  # [MoE layers, experts]: layer i's row is its offload's `missed`

    def guarded(self, step: Callable[[], T | None]) -> T | None:
        """Run a decode step over the resident experts only (a CUDA graph's replay; eagerly, the same sync-free
        path: the CPU tests) and return its result; when it routed to experts that were not resident, copy
        them in and replay it, or return None (the caller runs the step again eagerly, counted in `redos`).
        `step` returning None (no graph for it) is passed on."""
        for replay in range(self.REPLAYS + 1):
            for o in self.layers.values():
                o.optimistic = True
            try:
                out = step()
            except BaseException:
                self.missed.zero_()  # a failed step's marks must not read as the next step's misses
                raise
            finally:
                for o in self.layers.values():
                    o.optimistic = False
            if out is None:
                return None
            if not self.missed.any().item():  # the step's one host sync
                self.stats.graph_steps += 1
                return out
            if replay == self.REPLAYS or not self._fetch_missed():
                break
            self.stats.refetches += 1
        self.missed.zero_()
        self.stats.redos += 1
        return None

    def _fetch_missed(self) -> bool:
        """Copy every layer's missed experts into its ring and clear `missed`; False when a ring could not
        take them (the layers before it have their copies)."""
        rows = self.missed.nonzero().tolist()
        self.missed.zero_()
        offloads = list(self.layers.values())
        by_layer: dict[int, list[int]] = {}
        for layer, expert in rows:
            by_layer.setdefault(layer, []).append(expert)
        return all(offloads[layer].fetch(experts) for layer, experts in sorted(by_layer.items()))

    def props(self) -> dict[str, Any]:
        return {"enabled": True, **self.info,
                "cpu_rule": {"cpu_rows": self.rule.cpu_rows, "promote_after": self.rule.promote_after,
                             **{k: round(v, 7) for k, v in self.rule.measured.items()}},
                "device_expert_bytes": sum(o.device_bytes() for o in self.layers.values()),
                "host_expert_bytes": sum(o.host_bytes() for o in self.layers.values()), **self.stats.props()}

    def register_metrics(self, metrics: Any) -> None:
        """Counters and gauges on the server's /metrics (lucebox.metrics.Metrics)."""
        s = self.stats
        metrics.counter("lucebox_spark_routed_pairs_total", "Routed (token, expert) pairs", lambda: s.routed)
        metrics.counter("lucebox_spark_cold_hits_total", "Routed pairs whose expert was in host memory",
                        lambda: s.cold)
        metrics.counter("lucebox_spark_ring_hits_total", "Routed pairs served by the per-layer ring",
                        lambda: s.ring_hits)
        metrics.counter("lucebox_spark_expert_copies_total", "Experts copied host to device", lambda: s.copies)
        metrics.counter("lucebox_spark_expert_copy_bytes_total", "Bytes of experts copied host to device",
                        lambda: s.copy_bytes)
        metrics.counter("lucebox_spark_cpu_experts_total", "Cold experts computed on the CPU", lambda: s.cpu_experts)
        metrics.counter("lucebox_spark_refetches_total", "Decode steps over the resident experts replayed after "
                        "copying in the experts they missed (the graph-resident decode)", lambda: s.refetches)
        metrics.counter("lucebox_spark_redos_total", "Decode steps over the resident experts run again eagerly "
                        "(the graph-resident decode)", lambda: s.redos)
        metrics.counter("lucebox_spark_cpu_expert_seconds_total", "Seconds spent computing experts on the CPU",
                        lambda: s.cpu_seconds)
        metrics.gauge("lucebox_spark_cold_hit_rate", "Cold hits over routed pairs since start",
                      lambda: s.cold_hit_rate)
        metrics.gauge("lucebox_spark_copies_per_second", "Expert copies per second since start",
                      s.copies_per_second)


def place_experts(loaded: Any, device: torch.device, cfg: SparkConfig, quiet: bool = False) -> Spark:
    """Split `loaded`'s experts (held in host memory) per `cfg` and move the rest of the model to `device`."""
    cfg.validate()
    model = loaded.model
    layers = moe_layers(model)
    sizes = {i: expert_bytes(m) for i, m in layers.items()}
    first = next(iter(layers.values()))
    n_experts, held = first.n_experts, first.held  # held: this rank's experts (all of them on one device)
    per_expert = sum(sizes.values())  # one expert of every MoE layer
    total = len(held) * per_expert
    doc = None
    if cfg.profile is not None and cfg.placement != "uniform":
        doc = read_profile(cfg.profile)
        for warning in check_profile(doc, model, loaded.config.arch, loaded.quant, cfg.profile):
            log.warning("%s", warning)
    budget = Budget.parse(cfg.budget if cfg.budget is not None else
                          (doc["placement"]["budget"] if doc is not None else "100%"))
    budget_bytes = min(budget.bytes(n_experts * per_expert) * len(held) // n_experts, total)  # this rank's share
    ring = cfg.ring
    if ring is not None and cfg.ring_fit:
        ring = min(ring, budget_bytes // per_expert)
    if ring is None:
        ring = min(32, len(held) // 8)
        while ring and ring * per_expert > budget_bytes // 2:
            ring -= 1
    left = placement.hot_budget(budget_bytes, sizes, ring)
    if doc is not None:  # placed by this rank's experts' counts, numbered from 0 ...
        local = placement.calibrated(_held_counts(doc["counts"], held), sizes, left)
        kind = "calibrated"
    else:
        local = placement.uniform(len(held), sizes, left)
        kind = "uniform"
    hot = {i: [held.start + e for e in v] for i, v in local.items()}  # ... then by their ids in the model
    stats = SparkStats()
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    rule = OffloadRule(cfg.cpu_rows or 0, cfg.promote_after)
    missed = torch.zeros(len(layers), n_experts, dtype=torch.bool, device=device)
    offloads = {i: LayerOffload(m, hot[i], ring, device, rule, stats, stream, missed[k])
                for k, (i, m) in enumerate(layers.items())}
    if cfg.cpu_rows is None:
        probe = next((o for o in offloads.values() if o.cold), next(iter(offloads.values())))
        measured = measure_rule(probe, cfg.promote_after)
        rule.cpu_rows, rule.measured = measured.cpu_rows, measured.measured
    model.to(device)
    loaded.device = device
    n_hot = sum(len(v) for v in hot.values())
    info = {"placement": kind, "profile": str(cfg.profile) if doc is not None else None,
            "calibrated_router_skew": doc.get("router_skew") if doc is not None else None,
            "budget": str(budget), "budget_bytes": budget_bytes, "expert_bytes_total": total,
            "hot_experts": n_hot, "experts": len(held) * len(layers), "held_experts": [held.start, held.stop],
            "ring_slots_per_layer": ring,
            "predicted_cold_hit_rate": (placement.cold_hit_rate(
                _held_counts(doc["heldout_counts"] or doc["counts"], held), local) if doc is not None else None)}
    if not quiet:
        log.info("spark: %s placement, %d of %d experts (ids %d-%d of each layer) on %s (%.2f of %.2f GB budget, "
                 "ring %d per layer), cold on the host; CPU rule: cold experts of <= %d rows on the CPU", kind,
                 n_hot, len(held) * len(layers), held.start, held.stop - 1, device, budget_bytes / GB, total / GB,
                 ring, rule.cpu_rows)
    return Spark(offloads, stats, rule, info, missed)


def _held_counts(counts: dict[int, list[int]], held: range) -> dict[int, list[int]]:
    """A profile's counts of the experts `held` only, numbered from 0."""
    return {layer: row[held.start:held.stop] for layer, row in counts.items()}


def spark_engine(path: Path, config: Any, cfg: SparkConfig, quiet: bool = False) -> tuple[Any, Spark]:
    """An LLMEngine (lucebox.engine.runtime.llm_engine) over the model at `path` with its experts placed
    (under --tensor-parallel, rank 0's engine, every rank's experts placed by its own rank)."""
    from lucebox.engine.runtime.llm_engine import WEIGHTS, LLMEngine
    from lucebox.engine.weights.loader import load_model

    device = config.resolve_device()
    if config.weights not in WEIGHTS:
        raise LuceboxError(f"--weights is {config.weights}; choose from {', '.join(WEIGHTS)}")
    if config.tensor_parallel > 1:
        from lucebox.engine.parallel.worker import tensor_parallel_engine

        engine = tensor_parallel_engine(Path(path), config, quiet, spark=cfg)
        assert engine.spark is not None
        return engine, engine.spark
    if config.gpu_memory is not None and device.type == "cuda":
        from lucebox.engine.runtime.memory_plan import apply_cap

        apply_cap(device, config.gpu_memory)
    weights = config.weights
    if weights == "both" or (weights == "auto" and device.type == "cuda"):
        weights = "quantized"  # the experts cross PCIe in their blocks
    loaded = load_model(Path(path), device="cpu", dtype=config.resolve_dtype(device), quiet=quiet,
                        weights=weights)
    spark = place_experts(loaded, device, cfg, quiet)
    graphs = cfg.graphs if cfg.graphs is not None else graphs_on(device)
    guard = spark.guarded if graphs else None
    config = dataclasses.replace(config, cuda_graphs=config.cuda_graphs and guard is not None)
    return LLMEngine(loaded, config, decode_guard=guard), spark


def graphs_on(device: torch.device) -> bool:
    """Whether decode steps run as CUDA graph replays over the resident experts (module docstring): by default
    on CUDA, where the H200 measured them 8.6x the eager offloaded step (bench spark, README); on the CPU there
    are no graphs and the guard only adds redone steps. LUCEBOX_SPARK_GRAPHS=1 / 0 forces it either way."""
    return os.environ.get("LUCEBOX_SPARK_GRAPHS", "1" if device.type == "cuda" else "0") == "1"
