"""`python -m lucebox [serve]`: configuration, start-up, and the wiring of the HTTP app.

Start-up binds the socket first, then loads the model and warms it up in a
thread (every CUDA graph captured, every kernel compiled: lucebox/engine/runtime/warmup.py),
so `/health` answers 503 `loading` until the engine serves at full speed.
Configuration precedence: CLI flag > environment (`LUCEBOX_*`) > model card > built-in default; the
resolved configuration is logged at start and shown at `/props`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lucebox.api.common import ServerContext
from lucebox.engine.pflash.config import PFlashConfig
from lucebox.engine.pflash.service import MODES as PFLASH_MODES
from lucebox.errors import LuceboxError
from lucebox.http import Router, run
from lucebox.metrics import thread_cpu_counter
from lucebox.model_cards import CardError, ModelCard, card_dirs, find_card, load_card

log = logging.getLogger("lucebox.serve")


@dataclass
class ServerConfig:
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    cors: bool = True
    cors_origins: list[str] = dataclasses.field(default_factory=list)  # browser origins besides loopback ones
    allowed_hosts: list[str] = dataclasses.field(default_factory=list)  # Host names besides loopback and --host
    max_connections: int | None = None  # None = from the open-file limit (lucebox.http.server)
    request_timeout: float = 60.0  # seconds to receive a whole request, head and body
    max_body_mb: int = 16  # larger request bodies get 413
    device: str = "auto"
    dtype: str = "auto"
    weights: str = "auto"  # GGUF quant blocks on the device: auto | quantized | dense
    kv_dtype: str = "auto"  # KV cache storage: auto (the model's dtype) | bf16 | q8_0
    n_ctx: int | None = None
    gpu_memory: float | None = None  # GB the process may use on the device; None = what is free
    warm_up: bool = True  # capture every graph and compile every kernel before /health says ready
    chat_template_file: Path | None = None
    model_card: Path | None = None
    max_num_seqs: int = 16
    max_queue: int = 256
    stream_pace_us: float = 200.0  # per active stream: the least gap between one stream's events (AsyncEngine.stream)
    max_step_tokens: int = 2048
    prefill_pacing: bool = False  # cap prefill chunks while streams decode (engine/runtime/pacing.py)
    ahead: bool | None = None  # greedy decode steps one step ahead (engine/runtime/ahead.py); None: with CUDA graphs
    kv_tokens: int | None = None
    tensor_parallel: int = 1  # ranks (GPUs) the model is split over (engine/parallel)
    draft: str | None = None  # DFlash drafter folder; None = plain decoding (see drafter_hint)
    no_draft: bool = False
    ddtree: bool = False
    ddtree_budget: int = 22
    spec_adaptive: bool = True  # per request, plain decoding while drafts do not pay (engine/spec/adaptive.py)
    spec_static: bool | None = None  # fixed-shape speculative steps (spec/static.py); None: on CUDA (tests: the CPU)
    spark: Path | None = None  # Spark placement profile (lucebox/engine/spark); None: experts all on the device
    expert_gpu_budget: str | None = None  # GB or N% of the expert bytes on the device (alone: uniform placement)
    spark_ring: int | None = None  # ring slots per MoE layer; None: Spark's default
    spark_cpu_rows: int | None = None  # the CPU rule's rows; None: measured at load
    router_skew: str | None = None  # `zipf:S`: a routing SIMULATION for random-weight MoE models (spark/simulate.py)
    prefix_cache: bool = True
    gpu_prefix_cache: bool = True
    prefix_cache_slots: int = 32
    prefill_cache_slots: int = 4
    cache_ram: int = 4096  # MiB of RAM for the snapshot tiers together; 0: none (nor disk, which they feed)
    kv_cache_dir: Path | None = None
    kv_cache_budget: int = 4096  # MB
    kv_cache_min_tokens: int = 256
    prefill_compression: str = "auto"  # PFlash: off | auto | always
    prefill_threshold: int | None = None  # auto compresses longer prompts; None = DEFAULT_THRESHOLD (32000)
    prefill_keep_ratio: float = PFlashConfig.keep_ratio
    prefill_drafter: str | None = None  # the scorer; None = the model itself
    prefill_skip_park: bool = False
    grace: float = 10.0  # seconds in-flight requests get after SIGTERM; open streams then end with an error event

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerConfig:
        env = os.environ

        def pick(name: str, env_name: str, cast: Any, default: Any) -> Any:
            value = getattr(args, name, None)
            if value is not None:
                return value
            raw = env.get(env_name)
            if raw is None:
                return default
            try:
                return cast(raw)
            except ValueError:
                raise LuceboxError(f"environment {env_name}={raw!r} is not a valid {cast.__name__}") from None

        return cls(
            model=pick("model", "LUCEBOX_MODEL", str, None),
            host=pick("host", "LUCEBOX_HOST", str, "127.0.0.1"),
            port=pick("port", "LUCEBOX_PORT", int, 8080),
            api_key=_api_key(getattr(args, "api_key", None)),
            cors=not getattr(args, "no_cors", False),
            cors_origins=_names(pick("cors_origins", "LUCEBOX_CORS_ORIGINS", str, "")),
            allowed_hosts=_names(pick("allowed_hosts", "LUCEBOX_ALLOWED_HOSTS", str, "")),
            max_connections=pick("max_connections", "LUCEBOX_MAX_CONNECTIONS", int, None),
            request_timeout=pick("request_timeout", "LUCEBOX_REQUEST_TIMEOUT", float, 60.0),
            max_body_mb=pick("max_body_mb", "LUCEBOX_MAX_BODY_MB", int, 16),
            grace=pick("shutdown_grace", "LUCEBOX_SHUTDOWN_GRACE", float, 10.0),
            device=args.device,
            dtype=args.dtype,
            weights=getattr(args, "weights", "auto"),
            kv_dtype=pick("kv_dtype", "LUCEBOX_KV_DTYPE", str, "auto"),
            n_ctx=args.n_ctx,
            gpu_memory=_number("--gpu-memory", float, pick("gpu_memory", "LUCEBOX_GPU_MEMORY", str, None)),
            chat_template_file=args.chat_template_file,
            model_card=getattr(args, "model_card", None),
            max_num_seqs=pick("max_num_seqs", "LUCEBOX_MAX_NUM_SEQS", int, 16),
            max_queue=pick("max_queue", "LUCEBOX_MAX_QUEUE", int, 256),
            stream_pace_us=_pace(pick("stream_pace_us", "LUCEBOX_STREAM_PACE_US", float, 200.0)),
            max_step_tokens=pick("max_step_tokens", "LUCEBOX_MAX_STEP_TOKENS", int, 2048),
            prefill_pacing=bool(getattr(args, "prefill_pacing", False)),
            kv_tokens=pick("kv_tokens", "LUCEBOX_KV_TOKENS", int, None),
            tensor_parallel=pick("tensor_parallel", "LUCEBOX_TENSOR_PARALLEL", int, 1),
            draft=pick("draft", "LUCEBOX_DRAFT", str, None),
            no_draft=bool(getattr(args, "no_draft", False)),
            ddtree=bool(getattr(args, "ddtree", False)),
            ddtree_budget=pick("ddtree_budget", "LUCEBOX_DDTREE_BUDGET", int, 22),
            spec_adaptive=getattr(args, "spec_adaptive", None) is not False,
            spark=pick("spark", "LUCEBOX_SPARK", Path, None),
            expert_gpu_budget=pick("expert_gpu_budget", "LUCEBOX_EXPERT_GPU_BUDGET", str, None),
            spark_ring=pick("spark_ring", "LUCEBOX_SPARK_RING", int, None),
            spark_cpu_rows=pick("spark_cpu_rows", "LUCEBOX_SPARK_CPU_ROWS", int, None),
            router_skew=pick("router_skew", "LUCEBOX_ROUTER_SKEW", str, None),
            prefix_cache=not getattr(args, "no_prefix_cache", False),
            gpu_prefix_cache=not getattr(args, "no_gpu_prefix_cache", False),
            prefix_cache_slots=pick("prefix_cache_slots", "LUCEBOX_PREFIX_CACHE_SLOTS", int, 32),
            prefill_cache_slots=pick("prefill_cache_slots", "LUCEBOX_PREFILL_CACHE_SLOTS", int, 4),
            cache_ram=pick("cache_ram", "LUCEBOX_CACHE_RAM", int, 4096),
            kv_cache_dir=pick("kv_cache_dir", "LUCEBOX_KV_CACHE_DIR", Path, None),
            kv_cache_budget=pick("kv_cache_budget", "LUCEBOX_KV_CACHE_BUDGET", int, 4096),
            kv_cache_min_tokens=pick("kv_cache_min_tokens", "LUCEBOX_KV_CACHE_MIN_TOKENS", int, 256),
            prefill_compression=pick("prefill_compression", "LUCEBOX_PREFILL_COMPRESSION", str, "auto"),
            prefill_threshold=_number("--prefill-threshold", int, pick("prefill_threshold",
                                                                        "LUCEBOX_PREFILL_THRESHOLD", str, None)),
            prefill_keep_ratio=_number("--prefill-keep-ratio", float, pick(
                "prefill_keep_ratio", "LUCEBOX_PREFILL_KEEP_RATIO", str, PFlashConfig.keep_ratio)),
            prefill_drafter=pick("prefill_drafter", "LUCEBOX_PREFILL_DRAFTER", str, None),
            prefill_skip_park=bool(getattr(args, "prefill_skip_park", False)) or _env_flag("PREFILL_SKIP_PARK"),
        ).validate()

    def validate(self) -> ServerConfig:
        """Raise LuceboxError naming the first bad setting (checked before anything loads)."""
        from lucebox.fetch import KNOWN_MODELS
        from lucebox.http.security import parse_origins

        try:
            parse_origins(self.cors_origins)
        except ValueError as exc:
            raise LuceboxError(str(exc)) from None
        if self.gpu_memory is not None and not self.gpu_memory > 0:
            raise LuceboxError(f"--gpu-memory must be a positive number of GB, got {self.gpu_memory}")
        if self.tensor_parallel < 1:
            raise LuceboxError(f"--tensor-parallel must be at least 1, got {self.tensor_parallel}")
        if self.max_connections is not None and self.max_connections < 1:
            raise LuceboxError(f"--max-connections must be at least 1, got {self.max_connections}")
        if not self.request_timeout > 0:
            raise LuceboxError(f"--request-timeout must be a number of seconds > 0, got {self.request_timeout}")
        if self.max_body_mb < 1:
            raise LuceboxError(f"--max-body-mb must be at least 1, got {self.max_body_mb}")
        if not self.grace >= 0:
            raise LuceboxError(f"--shutdown-grace must be a number of seconds >= 0, got {self.grace}")
        for flag, value in (("--prefix-cache-slots", self.prefix_cache_slots),
                            ("--prefill-cache-slots", self.prefill_cache_slots), ("--cache-ram", self.cache_ram),
                            ("--kv-cache-budget", self.kv_cache_budget),
                            ("--kv-cache-min-tokens", self.kv_cache_min_tokens)):
            if value < 0:
                raise LuceboxError(f"{flag} must be >= 0, got {value}")
        if self.router_skew is not None:
            from lucebox.engine.spark.simulate import parse_skew

            parse_skew(self.router_skew, self.tensor_parallel)
        spark = self.spark_config()
        if spark is not None:
            spark.validate()
            if self.spark is not None and not self.spark.is_file():
                raise LuceboxError(f"--spark {self.spark}: no such profile file")

        if self.prefill_compression not in PFLASH_MODES:
            raise LuceboxError(f"--prefill-compression must be one of {', '.join(PFLASH_MODES)}, "
                               f"got {self.prefill_compression!r}")
        if self.prefill_threshold is not None and self.prefill_threshold < 0:
            raise LuceboxError(f"--prefill-threshold must be a token count >= 0, got {self.prefill_threshold}")
        if not 0.0 < self.prefill_keep_ratio <= 1.0:
            raise LuceboxError(f"--prefill-keep-ratio must be in (0, 1], got {self.prefill_keep_ratio}")
        drafter = self.prefill_drafter
        if drafter is not None and drafter not in KNOWN_MODELS and not Path(drafter).expanduser().exists():
            raise LuceboxError(f"--prefill-drafter {drafter!r} is neither a file or folder nor a known name "
                               f"({', '.join(KNOWN_MODELS)})")
        return self

    def spark_config(self) -> Any:
        """Spark's settings (lucebox.engine.spark.engine.SparkConfig), or None when the experts stay on the device."""
        if self.spark is None and self.expert_gpu_budget is None:
            return None
        from lucebox.engine.spark.engine import SparkConfig

        return SparkConfig(profile=self.spark, budget=self.expert_gpu_budget, ring=self.spark_ring,
                           cpu_rows=self.spark_cpu_rows)

    def public(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["api_key"] = "***" if self.api_key else None
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in d.items()}


def _pace(us: float) -> float:
    """--stream-pace-us: 0 (every step its own event) up to 10,000 us a stream."""
    if not 0 <= us <= 10_000:  # also refuses nan
        raise LuceboxError(f"--stream-pace-us must be between 0 and 10000 microseconds, not {us}")
    return us


def _api_key(flag: str | None) -> str | None:
    """`--api-key`, else LUCEBOX_API_KEY; an empty one is refused: it must never quietly mean "no auth"."""
    for source, value in (("--api-key", flag), ("LUCEBOX_API_KEY", os.environ.get("LUCEBOX_API_KEY"))):
        if value is None:
            continue
        if not value.strip():
            raise LuceboxError(f"{source} is set but empty; give the key clients must send, or unset it to serve "
                               "without one")
        return value.strip()
    return None


def _names(raw: str) -> list[str]:
    """A comma-separated flag or environment value as a list (`a, b,` -> ["a", "b"])."""
    return [n.strip() for n in raw.split(",") if n.strip()]


def _number(flag: str, cast: type, raw: Any) -> Any:
    """A flag's value as int/float (None stays None), or a one-line LuceboxError."""
    if raw is None or isinstance(raw, cast):
        return raw
    try:
        value = cast(raw)
    except (TypeError, ValueError):
        kind = "an integer" if cast is int else "a number"
        raise LuceboxError(f"{flag} must be {kind}, got {raw!r}") from None
    if cast is float and value != value:  # NaN
        raise LuceboxError(f"{flag} must be a number, got {raw!r}")
    return value


def resolve_card(cfg: ServerConfig, names: list[str]) -> ModelCard | None:
    from lucebox.fetch import lucebox_home

    if cfg.model_card is not None:
        try:
            card = load_card(cfg.model_card)
        except CardError as exc:
            log.warning("%s; continuing without a model card", exc)
            return None
    else:
        card = find_card(names, card_dirs(lucebox_home()))
    log.info("model card: %s", card.path if card else "none found")
    return card


def load_into(ctx: ServerContext, cfg: ServerConfig) -> Any:
    """Blocking: resolve and load the model, fill `ctx` (runs in a worker thread); returns the LLMEngine."""
    from lucebox.chat.prompt import PromptBuilder
    from lucebox.engine.runtime.llm_engine import EngineConfig, LLMEngine
    from lucebox.fetch import resolve_model

    path = resolve_model(cfg.model)
    draft = None if cfg.no_draft else cfg.draft
    # the drafter is loaded with the engine, so the memory plan counts it
    engine_cfg = EngineConfig(device=cfg.device, dtype=cfg.dtype, weights=cfg.weights, kv_dtype=cfg.kv_dtype,
                              n_ctx=cfg.n_ctx,
                              kv_tokens=cfg.kv_tokens, gpu_memory=cfg.gpu_memory, max_num_seqs=cfg.max_num_seqs,
                              max_step_tokens=cfg.max_step_tokens, prefill_pacing=cfg.prefill_pacing, draft=draft,
                              ddtree=cfg.ddtree, ddtree_budget=cfg.ddtree_budget, spec_adaptive=cfg.spec_adaptive,
                              spec_static=cfg.spec_static, tensor_parallel=cfg.tensor_parallel, ahead=cfg.ahead)
    if cfg.spark_config() is not None:
        from lucebox.engine.spark.engine import spark_engine

        engine, spark = spark_engine(path, engine_cfg, cfg.spark_config())
        ctx.props["spark"] = spark.props
        spark.register_metrics(ctx.metrics)
    else:
        engine, spark = LLMEngine.from_path(path, engine_cfg), None
    loaded = engine.loaded
    if cfg.router_skew is not None:  # before the warm-up captures any graph
        from lucebox.engine.spark.profile import moe_layers
        from lucebox.engine.spark.simulate import apply_router_skew, parse_skew

        skew = parse_skew(cfg.router_skew, cfg.tensor_parallel)
        if skew is not None:
            moe_layers(loaded.model)  # a dense model: one clear error, not a silent no-op
            apply_router_skew(loaded.model, skew, loaded.dtype)
            log.warning("router skew zipf:%g: a SIMULATION of expert popularity; the model's outputs change", skew)
            ctx.props["router_skew"] = f"zipf:{skew:g} (simulation)"
    if spark is not None and spark.info["profile"] is not None:  # a profile measured under another routing
        calibrated = spark.info["calibrated_router_skew"]  # placed the experts for other traffic
        served = ctx.props.get("router_skew")
        if calibrated != served:
            log.warning("--spark %s was calibrated under router skew %s, served under %s: its placement does not "
                        "match this routing", cfg.spark, calibrated or "none", served or "none")
    names = [loaded.config.name, path.stem, path.stem.split(".")[0], path.name]
    card = resolve_card(cfg, names)
    template_file = cfg.chat_template_file
    if template_file is None and card and card.chat_template:
        template_file = Path(card.chat_template)
    ctx.prompt = PromptBuilder.for_model(loaded, override_file=template_file)
    ctx.card = card
    ctx.n_ctx = engine.n_ctx
    ctx.model_id = path.stem
    if not draft:
        drafter_hint(card)
    if cfg.prefix_cache:
        from lucebox.cache.manager import CacheConfig

        engine.enable_prefix_cache(CacheConfig(
            gpu=cfg.gpu_prefix_cache, prefix_slots=cfg.prefix_cache_slots, exact_slots=cfg.prefill_cache_slots,
            ram_bytes=cfg.cache_ram << 20, disk_dir=cfg.kv_cache_dir, disk_budget=cfg.kv_cache_budget << 20,
            disk_min_tokens=cfg.kv_cache_min_tokens), ctx.prompt.template)
    ctx.pflash = enable_pflash(engine, cfg)
    if ctx.pflash is not None:
        ctx.props["pflash"] = ctx.pflash.props
    ctx.props.update(model_props(engine, card, cfg))
    ctx.props["speculative"] = lambda: speculative_props(engine, draft, cfg)
    ctx.props["prefix_cache"] = lambda: prefix_cache_props(engine, cfg)
    ctx.props["warm_up"] = engine.warm_up_props
    ctx.props["constrained_decoding"] = lambda: constrained_props(ctx)
    if engine.memory_plan is not None:
        ctx.props["memory_plan"] = engine.memory_plan.props()
    if cfg.warm_up:
        engine.warm_up()  # still 503 `loading`: ctx.engine is set only once this returns
        if spark is not None:
            spark.stats.reset()  # the counters start with the first request, not the warm-up's dummy steps
    prepare_grammars(engine)
    return engine


def prepare_grammars(engine: Any) -> None:
    """Build the tokenizer's llguidance view now (0.3 s for a 49K vocabulary, 3 s for 262K), not at the first
    constrained request, where it would hold the GIL while other requests decode."""
    from lucebox.engine.runtime.grammar import GrammarError, compiler_for

    t = time.monotonic()
    try:
        compiler_for(engine.tokenizer, engine.model_config.vocab_size)
    except GrammarError as exc:
        log.warning("constrained decoding is off: %s", exc)
        return
    log.info("constrained decoding: llguidance tokenizer ready in %.1fs", time.monotonic() - t)


def enable_pflash(engine: Any, cfg: ServerConfig) -> Any:
    """The PFlash service for `--prefill-compression auto|always` (None when off); loads the scorer."""
    from lucebox.engine.pflash import PFlash
    from lucebox.engine.pflash.service import DEFAULT_THRESHOLD, PFlashService
    from lucebox.engine.weights.loader import load_model
    from lucebox.fetch import resolve_model

    cfg.validate()
    if cfg.prefill_compression == "off":
        return None
    target = engine.loaded
    scorer = target
    if cfg.prefill_drafter is not None:
        path = resolve_model(cfg.prefill_drafter)
        if path.resolve() != Path(target.path).resolve():
            scorer = load_model(path, device=target.device, dtype=target.dtype, quiet=True)
    if scorer.config.is_hybrid:  # the scorer runs DecoderBlock's attention methods, which hybrid layers lack
        log.warning("PFlash is off: its scorer %s is a hybrid (recurrent) model; --prefill-drafter names a dense "
                    "one", "(the model itself)" if scorer is target else scorer.path)
        return None
    threshold = cfg.prefill_threshold if cfg.prefill_threshold is not None else DEFAULT_THRESHOLD
    if cfg.prefill_compression == "auto" and threshold >= engine.n_ctx:
        log.info("PFlash auto compresses prompts over %d tokens, more than this model's context (%d): it will not "
                 "fire here (a longer prompt is rejected, not compressed); --prefill-threshold lowers it",
                 threshold, engine.n_ctx)
    # The target as its own scorer runs through the engine (under -tp on every rank's shard); a separate
    # scorer runs whole in this process (on rank 0 under -tp, as the DFlash drafter does).
    pflash = PFlash.for_model(target, scorer, PFlashConfig(keep_ratio=cfg.prefill_keep_ratio),
                              importance=engine.token_importance if scorer is target else None)
    service = PFlashService(pflash, mode=cfg.prefill_compression, threshold=threshold,
                            keep_ratio=cfg.prefill_keep_ratio, cache=engine.cache, scorer_name=str(scorer.path),
                            target_model=target.model, park=not cfg.prefill_skip_park)
    log.info("PFlash: %s, threshold %d tokens, keep ratio %g, scorer %s%s", cfg.prefill_compression, threshold,
             cfg.prefill_keep_ratio, "the model itself" if scorer is target else scorer.path,
             ", parked when idle" if service.parking.enabled else "")
    return service


def prefix_cache_props(engine: Any, cfg: ServerConfig) -> dict[str, Any]:
    cache = engine.cache
    if cache is None:
        return {"enabled": False, "slots": 0, "in_use": 0, "hits": 0, "exact_slots": 0,
                "disk": {"dir": None, "bytes": 0, "budget": 0}}
    s = cache.stats()
    return {"enabled": True, "slots": s["prefix"]["slots"], "in_use": s["prefix"]["entries"],
            "hits": s["gpu"]["hits"] + s["prefix"]["hits"] + s["exact"]["hits"],
            "exact_slots": s["exact"]["slots"], "disk": s["disk"], "tiers": s}


def drafter_hint(card: Any) -> None:
    """Plain decoding unless `--draft` asks for a drafter, on every device: the shipped drafter is slower than
    plain decoding in `bench spec` (README), so none is on by default until a benchmark shows a speedup.
    Says once, at start-up, how to turn it on."""
    path = card.drafter_path() if card else None
    if path:
        log.info("speculative decoding off (plain decoding); the model card's drafter turns it on: --draft %s", path)
    else:
        log.info("speculative decoding off (plain decoding); --draft DIR turns it on with a DFlash drafter")


def speculative_props(engine: Any, draft: str | None, cfg: ServerConfig) -> dict[str, Any]:
    spec = engine.spec
    if spec is None:
        return {"enabled": False, "drafter": None, "block_size": None, "ddtree": False, "ddtree_budget": None}
    s = spec.stats
    return {"enabled": True, "drafter": str(draft), "block_size": spec.block, "ddtree": spec.ddtree,
            "ddtree_budget": spec.budget if spec.ddtree else None, "steps": s.steps,
            "committed_tokens": s.committed, "drafted_tokens": s.drafted,
            "acceptance": round(s.acceptance_length, 3) if s.steps else None,
            **(engine.adaptive.props() if engine.adaptive is not None else {})}


def model_props(engine: Any, card: ModelCard | None, cfg: ServerConfig) -> dict[str, Any]:
    loaded = engine.loaded
    mc = loaded.config
    return {
        "model": {"path": str(loaded.path), "arch": mc.arch, "name": mc.name, "n_ctx": engine.n_ctx,
                  "n_params": mc.n_params(), "quant": loaded.quant, "dtype": str(loaded.dtype).removeprefix("torch."),
                  "device": str(loaded.device), "format": loaded.format},
        "model_card": card.raw if card else None,
        "server": cfg.public(),
    }


def constrained_props(ctx: ServerContext) -> dict[str, Any]:
    """/props `constrained_decoding`: the grammar library, this template's call format, what gets constrained
    and how many generations were, by why (chat/constrain.py)."""
    from lucebox.chat.constrain import call_format
    from lucebox.engine.runtime import grammar

    counts = ctx.metrics.constrained_counts()
    return {"library": f"llguidance {grammar.llguidance.__version__}" if grammar.llguidance else None,
            "call_format": call_format(ctx.prompt.template.source) if ctx.prompt else None,
            "when": ["tool_choice required/any or a named tool: only calls", "tools with tool_choice auto: an "
                     "opened call is well formed (a declared tool, an object of arguments)",
                     "response_format / text.format / output_config.format: "
                     "JSON (a schema's, or any object)"],
            "generations": counts}


def make_app(ctx: ServerContext) -> Router:
    from lucebox.api import register_all

    router = Router()
    register_all(router, ctx)
    return router


def http_options(ctx: ServerContext, cfg: ServerConfig, router: Router) -> dict[str, Any]:
    """HttpServer keyword arguments, including the per-request metrics hook."""
    paths = {path for _, path in router.routes}

    def end_generations() -> None:
        """At the end of the shutdown grace: cancel every generation, so each stream ends in its dialect's way."""
        if ctx.engine is not None:
            ctx.engine.cancel_all()

    def on_request(method: str, path: str, status: int, fields: dict[str, Any]) -> None:
        ctx.metrics.count_request(path if path in paths else "other", status)
        if fields.get("disconnected"):
            ctx.metrics.count_disconnect()

    return {"host": cfg.host, "port": cfg.port, "cors": cfg.cors, "cors_origins": cfg.cors_origins,
            "allowed_hosts": cfg.allowed_hosts, "max_connections": cfg.max_connections,
            "request_timeout": cfg.request_timeout, "max_body": cfg.max_body_mb << 20, "api_key": cfg.api_key,
            "on_request": on_request, "before_cancel": end_generations}


def main(args: argparse.Namespace) -> int:
    # Two busy Python threads (event loop, engine) hand the GIL over every 5 ms by default;
    # a shorter interval keeps the engine thread's steps from waiting on SSE rendering.
    sys.setswitchinterval(0.0005)
    cfg = ServerConfig.from_args(args)
    log.info("configuration: %s", cfg.public())
    ctx = ServerContext(model_id=cfg.model or "lucebox", n_ctx=cfg.n_ctx or 0)
    ctx.raw_system = _env_flag("ANTHROPIC_RAW_SYSTEM")
    ctx.raw_user = _env_flag("ANTHROPIC_RAW_USER")

    async def startup(server: Any) -> None:
        t = time.monotonic()
        await start_engine(ctx, cfg)
        log.info("ready in %.1fs: http://%s:%d (model %s)", time.monotonic() - t, cfg.host, server.port, ctx.model_id)

    async def cleanup() -> None:
        if ctx.engine is not None:
            await ctx.engine.stop()

    router = make_app(ctx)
    return run(router, grace=cfg.grace, startup=startup, cleanup=cleanup, **http_options(ctx, cfg, router))


async def start_engine(ctx: ServerContext, cfg: ServerConfig) -> None:
    """Load the model off the loop, then start the engine loop on it."""
    from lucebox.engine.runtime.async_engine import AsyncEngine

    llm = await asyncio.to_thread(load_into, ctx, cfg)
    engine = AsyncEngine(llm, max_queue=cfg.max_queue, stream_pace=cfg.stream_pace_us * 1e-6)
    await engine.start()
    ctx.engine = engine
    register_engine_metrics(ctx)


def register_engine_metrics(ctx: ServerContext) -> None:
    eng = ctx.engine
    assert eng is not None
    kv = eng.engine.kv
    m = ctx.metrics
    m.gauge("lucebox_requests_waiting", "Requests queued, not yet running", lambda: eng.num_waiting)
    m.gauge("lucebox_requests_running", "Sequences admitted (prefilling or decoding)", lambda: eng.num_running)
    m.gauge("lucebox_kv_blocks_used", "KV cache blocks in use", lambda: kv.pool.num_used)
    m.gauge("lucebox_kv_blocks_free", "KV cache blocks free", lambda: kv.pool.num_free)
    m.counter("lucebox_preemptions_total", "Sequences preempted for lack of KV blocks",
              lambda: eng.engine.scheduler.num_preemptions)
    m.counter("lucebox_engine_steps_total", "Model steps run", lambda: eng.steps)
    if hasattr(time, "pthread_getcpuclockid"):  # where the two threads' CPU clocks can be read (Linux, macOS)
        loop_thread = threading.get_ident()  # this runs on the event loop, which serves /metrics
        m.counter("lucebox_event_loop_cpu_seconds_total",
                  "CPU seconds used by the event-loop thread (HTTP, chat templates, detokenizing, streaming)",
                  thread_cpu_counter(lambda: loop_thread))
        m.counter("lucebox_engine_thread_cpu_seconds_total",
                  "CPU seconds used by the engine thread (scheduling, kernel launches, sampling)",
                  thread_cpu_counter(lambda: eng.thread_ident))
    m.counter("lucebox_graph_captures_after_ready_total",
              "CUDA graphs captured while serving (a request waited for it: the warm-up missed a bucket)",
              lambda: eng.engine.captures_after_ready)
    m.counter("lucebox_kernel_compiles_after_ready_total",
              "Triton kernels compiled while serving (a request waited for it: the warm-up missed a shape)",
              lambda: eng.engine.compiles_after_ready)
    cache = eng.engine.cache
    if cache is not None:
        for tier in ("gpu", "prefix", "exact"):
            m.counter(f"lucebox_prefix_cache_{tier}_hits_total", f"Prefix cache hits, tier {tier}",
                      lambda t=tier: cache.counters[t].hits)
            m.counter(f"lucebox_prefix_cache_{tier}_misses_total", f"Prefix cache misses, tier {tier}",
                      lambda t=tier: cache.counters[t].misses)
            m.counter(f"lucebox_prefix_cache_{tier}_tokens_total", f"Prompt tokens served by tier {tier}",
                      lambda t=tier: cache.counters[t].restored_tokens)
        m.gauge("lucebox_prefix_cache_ram_bytes", "Bytes of KV snapshots in RAM",
                lambda: sum(cache.stats()[t]["bytes"] for t in ("prefix", "exact")))
        m.gauge("lucebox_prefix_cache_disk_bytes", "Bytes of KV snapshots on disk",
                lambda: cache.stats()["disk"]["bytes"])
        m.gauge("lucebox_prefix_cache_gpu_blocks", "KV blocks kept by the GPU prefix index",
                lambda: cache.blocks_held)
    pflash = ctx.pflash
    if pflash is not None:
        s = pflash.stats
        m.counter("lucebox_pflash_compressed_requests_total", "Requests whose prompt PFlash compressed",
                  lambda: s.compressed_requests)
        m.counter("lucebox_pflash_tokens_saved_total", "Prompt tokens PFlash removed before prefill",
                  lambda: s.tokens_saved)
        m.counter("lucebox_pflash_scorer_calls_total", "PFlash scorer passes", lambda: s.scorer_calls)
        m.counter("lucebox_pflash_scorer_seconds_total", "Seconds spent in the PFlash scorer",
                  lambda: s.scorer_seconds)
        m.counter("lucebox_pflash_reused_total", "Compressions reused for a repeated prompt (no scorer pass)",
                  lambda: s.reused)
    spec = eng.engine.spec
    if spec is not None:
        m.counter("lucebox_spec_verify_steps_total", "Speculative verification passes", lambda: spec.stats.steps)
        m.counter("lucebox_spec_committed_tokens_total", "Tokens committed by verification passes",
                  lambda: spec.stats.committed)
        m.counter("lucebox_spec_drafted_tokens_total", "Draft tokens proposed", lambda: spec.stats.drafted)
        m.gauge("lucebox_spec_acceptance_length", "Mean tokens per verification pass (tau)",
                lambda: spec.stats.acceptance_length)
        ad = eng.engine.adaptive
        m.gauge("lucebox_spec_plain_sequences", "Running requests decoding plainly (their drafts did not pay)",
                lambda: ad.stats.plain_now)
        m.counter("lucebox_spec_plain_tokens_total", "Tokens decoded plainly by requests that stopped drafting",
                  lambda: ad.stats.plain_tokens)
        m.counter("lucebox_spec_stops_total", "Times a request stopped drafting (tau below the cost ratio)",
                  lambda: ad.stats.stops)
        m.counter("lucebox_spec_resumes_total", "Probes after which a request drafts again", lambda: ad.stats.resumes)
        m.gauge("lucebox_spec_first_wait_tokens", "Plain tokens before a new request's first probe (grows while "
                "probes fail, back to its minimum when drafts pay)", lambda: ad.first_wait)


def _env_flag(name: str) -> bool:
    """`DFLASH_<name>` or `LUCEBOX_<name>` set to 1/true/yes."""
    for prefix in ("LUCEBOX_", "DFLASH_"):
        if os.environ.get(prefix + name, "").lower() in ("1", "true", "yes"):
            return True
    return False
