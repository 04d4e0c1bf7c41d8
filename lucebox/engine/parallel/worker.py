"""One process per rank: rank 0 runs the engine (scheduler, sampling, the server above it) on its shard and
sends each step's plan; every other rank runs the same forward on its shard, from the plan.

Processes: `-tp N` on one host spawns ranks 1..N-1 from rank 0 (torch.multiprocessing, start method spawn);
under `torchrun` (several hosts, or one) every rank is started by torchrun and finds the others through its
environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK), and ranks other than 0 enter
`follower_main` from the CLI instead of serving.

Each step: rank 0's runner broadcasts the step's chunks as one compact array (plan.py) before its forward;
the others rebuild the chunks, run ModelRunner.prepare and forward on them (the same rows, slots and
attention groups), and meet rank 0 in every collective of the forward. Each rank's KV cache holds its own
K/V heads at the same slots, so blocks the prefix cache shares on rank 0 hold the right K/V on every rank.

Failure: a rank that exits is seen by rank 0's watchdog (spawned ranks) or by the next collective, and a
spawned rank watches its parent; either way the process that notices exits non-zero with the reason
(group.fatal), never waits forever.

Hybrid models (qwen35, qwen35moe): each rank's recurrent state slots hold its DeltaNet channels and heads
(shard.py), at the slot numbers rank 0's scheduler hands out (each chunk's slot is in the plan); every state
change rank 0 makes outside the forward reaches the others in a plan, and the prefix cache's captures inside
it are named in the step's plan (kv.py).

Speculative decoding: a DFlash chain or a DDTree, its drafter on rank 0 alone (WholeHeads says why); a draft
tree and its parents (the attention mask) travel in the verification's plan, and the K/V moves of the accepted
paths and a hybrid's accepted rows in the next plan (kv.py). The prefix cache: all three tiers; a RAM or disk
snapshot holds every rank's K/V heads and recurrent states (kv.py).

PFlash: the default scorer, the target itself, scores through the sharded target on every rank
(`TPEngine.token_importance`, a SCORE plan), since running it on rank 0 alone would need the whole target
there; each rank's tail attention covers its query heads and the scorer's max over heads becomes one max over
the ranks (`sharded_importance`), so the scores are one rank's. A separate scorer (--prefill-drafter) is
small and runs whole on rank 0, as the DFlash drafter does. The compressed prompt then prefills as any other.

Spark: each rank places its own experts (those shard.py gave it) from the same profile, with its share of the
budget, the cold ones in its host memory (spark/engine.py); rank 0's Spark is the one /props and /metrics show.

Not under tensor parallelism yet (switched off with a log line): CUDA graphs (decode runs eagerly).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.multiprocessing as mp
from torch import nn

from lucebox.engine.models.config import ModelConfig
from lucebox.engine.models.decoder import DecoderModel
from lucebox.engine.parallel.group import Comm, close_group, fatal, init_group
from lucebox.engine.parallel.kv import (
    LeaderSpec,
    ShardedKV,
    ShardedStates,
    capture_states,
    load_rows,
    move_rows,
    save_rows,
    scatter_state,
    send_captures,
    step_captures,
    write_rows,
)
from lucebox.engine.parallel.plan import (
    LOAD,
    LOAD_STATE,
    SAVE,
    SCORE,
    PlanSender,
    SpecChanges,
    decode_plan,
    encode_score,
    encode_step,
)
from lucebox.engine.parallel.shard import check_shardable, shard_model
from lucebox.engine.pflash.config import PFlashConfig
from lucebox.engine.pflash.scorer import token_importance
from lucebox.engine.runtime.llm_engine import EngineConfig, LLMEngine
from lucebox.engine.runtime.model_runner import ModelRunner, StepInputs, StepResult
from lucebox.engine.spark.engine import Spark, SparkConfig, place_experts
from lucebox.engine.weights.loader import LoadedModel, load_model, read_model_config
from lucebox.errors import LuceboxError

log = logging.getLogger(__name__)

WATCH_S = 0.2  # how often rank 0 checks its spawned ranks (and they their parent)


class LeaderRunner(ModelRunner):
    """Rank 0's runner: every forward first sends its plan, so the other ranks run the same one; a hybrid's
    state captures of the step are gathered from every rank right after it."""

    sender: PlanSender
    states: ShardedStates | None = None

    def forward(self, inputs: StepInputs, capture: tuple[int, ...] = ()) -> StepResult:
        captures = step_captures(inputs.state)
        with self.sender.turn(encode_step(inputs.order, tuple(capture), self.kv.block_size,
                                          [(slot, c.position) for slot, c in captures])):
            try:
                result = super().forward(inputs, capture)
                if captures:
                    assert self.states is not None
                    self.states.gather([c for _, c in captures])
                return result
            except Exception as exc:  # noqa: BLE001 - the other ranks ran this step: a retry would be out of step
                fatal(f"rank 0: a forward failed after its plan was sent ({type(exc).__name__}: {exc})")


class TPEngine(LLMEngine):
    """LLMEngine on rank 0 of a tensor-parallel group: the same scheduler and sampling over the sharded model."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig, group: TPGroup, full: ModelConfig,
                 heads: WholeHeads | None = None, spark: Spark | None = None) -> None:
        # before LLMEngine's __init__: it enables speculation with the heads, whose decoder's moves the plans carry
        self.heads = heads
        self.spark = spark  # rank 0's placed experts (spark/engine.py), when Spark placed them
        self.tp = group
        self.full_config = full  # the unsharded model's (a snapshot holds all its K/V heads and state heads)
        self.sender = PlanSender(group.comm, self._changes)
        super().__init__(loaded, config)
        # a hybrid's states as its snapshots see them: every rank's
        self.states = ShardedStates(self.kv.states, self.sender, full) if self.kv.states is not None else None
        runner = LeaderRunner(loaded.model, self.kv, loaded.dtype)
        runner.sender, runner.states = self.sender, self.states
        self.runner = runner

    def _changes(self) -> SpecChanges:
        return self.spec.take_changes() if isinstance(self.spec, LeaderSpec) else SpecChanges()

    def spec_decoder_class(self) -> type[LeaderSpec]:
        return LeaderSpec

    def snapshot_kv(self) -> ShardedKV:
        return ShardedKV(self.kv, self.sender, self.full_config.num_kv_heads, self.states)

    @property
    def drafter_target(self) -> Any:
        if self.heads is None:
            raise LuceboxError("speculation under --tensor-parallel needs --draft at load (the whole embedding and "
                               "head are kept for it then)")
        return self.heads

    def score(self, token_ids: list[int]) -> torch.Tensor:
        raise LuceboxError("score() runs the model outside a step; not available with --tensor-parallel")

    def token_importance(self, ids: list[int], cfg: PFlashConfig) -> torch.Tensor:
        """PFlash with the target as its own scorer: its forward on every rank's shard (a SCORE plan), not on
        rank 0 alone, which would need the whole target there. Called from PFlash's worker thread: the plan
        lock runs it between two of the engine thread's messages (decode steps wait for the pass)."""
        with self.sender.turn(encode_score(ids), changes=False):
            try:
                self.tp.comm.broadcast_object(cfg)
                return sharded_importance(self.loaded.model, ids, cfg, self.tp.comm)
            except Exception as exc:  # noqa: BLE001 - as in LeaderRunner.forward
                fatal(f"rank 0: a PFlash scorer pass failed after its plan was sent ({type(exc).__name__}: {exc})")

    def close(self) -> None:
        """Let the other ranks drop this engine (they then wait for the next load)."""
        self.tp.release(self)


class WholeHeads(nn.Module):
    """The target's embedding and LM head, unsharded, on rank 0: what the DFlash drafter reads (its input rows
    are target embeddings, its logits the target's head). The drafter runs on rank 0 alone: it is small, its
    other input (the target's captured hidden states) is whole on every rank after the all-reduces, and its
    proposals reach the other ranks inside the verification's plan, so it needs no collective, no copy per
    rank and no drafter KV on the others; the price is one whole embedding (and untied head) on rank 0."""

    embed = DecoderModel.embed
    lm_head = DecoderModel.lm_head

    def __init__(self, model: DecoderModel) -> None:
        super().__init__()
        self.cfg = model.cfg
        self.token_embd = model.token_embd
        if not model.cfg.tie_word_embeddings:
            self.output = model.output


def sharded_importance(model: DecoderModel, ids: list[int], cfg: PFlashConfig, comm: Comm) -> torch.Tensor:
    """PFlash's token importance over this rank's shard, every rank in step (pflash/scorer.py): each rank's
    tail attention covers its query heads, and the max over all heads is the max of the ranks' maxima."""
    return token_importance(model, ids, cfg, rank_max=lambda x: torch.stack(comm.all_gather(x)).amax(0))


def load_shard(path: Path, config: EngineConfig, comm: Comm, quiet: bool = False, keep_heads: bool = False,
               spark: SparkConfig | None = None) -> tuple[LoadedModel, WholeHeads | None, Spark | None]:
    """This rank's shard: the model read on the host, split (shard.py), then moved to the rank's device, so a
    device only ever holds its share (and, `keep_heads`, the whole embedding and head for a drafter); with
    `spark`, the rank's experts are placed by Spark instead (its share of the budget on the device, the cold
    ones in host memory: spark/engine.py). GGUF blocks stay quantized on CUDA unless --weights dense (shards hold
    blocks only: --weights both is quantized here)."""
    device = comm.device
    dtype = config.resolve_dtype(device)
    weights = "dense" if config.weights == "dense" or (config.weights == "auto" and device.type != "cuda") else \
        "quantized"
    loaded = load_model(path, device="cpu", dtype=dtype, quiet=quiet, weights=weights)
    heads = WholeHeads(loaded.model) if keep_heads else None
    loaded.config = shard_model(loaded.model, comm)
    placed = None
    if spark is not None:
        placed = place_experts(loaded, device, spark, quiet)  # the rest of the model moves to the device
    else:
        loaded.model.to(device)
    if heads is not None:
        heads.to(device)
    loaded.device = device
    return loaded, heads, placed


class TPGroup:
    """Rank 0's side of the group: the spawned ranks, their watchdog, and the load/plan messages."""

    current: ClassVar[TPGroup | None] = None

    def __init__(self, world: int, device_type: str) -> None:
        self.world, self.procs, self.closing, self.engaged = world, [], False, False
        self.active: TPEngine | None = None
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
            if int(os.environ["WORLD_SIZE"]) != world or int(os.environ["RANK"]) != 0:
                raise LuceboxError(f"--tensor-parallel {world} under torchrun needs WORLD_SIZE={world} "
                                   f"(got {os.environ['WORLD_SIZE']}) and the engine on RANK 0")
            self.comm = init_group(0, world, device_type)
        else:
            init = f"tcp://127.0.0.1:{_free_port()}"
            ctx = mp.get_context("spawn")
            for rank in range(1, world):
                p = ctx.Process(target=follower_main, args=(rank, world, device_type, init), daemon=True,
                                name=f"lucebox-tp{rank}")
                p.start()
                self.procs.append(p)
            threading.Thread(target=self._watch, name="lucebox-tp-watchdog", daemon=True).start()
            self.comm = init_group(0, world, device_type, init)
        atexit.register(self.close)

    @classmethod
    def get(cls, world: int, device_type: str) -> TPGroup:
        """The process's group of `world` ranks, started on first use."""
        if cls.current is None:
            cls.current = TPGroup(world, device_type)
        elif cls.current.world != world or cls.current.comm.device.type != device_type:
            raise LuceboxError(f"a tensor-parallel group of {cls.current.world} ranks on "
                               f"{cls.current.comm.device.type} is running already")
        return cls.current

    @property
    def pids(self) -> list[int]:
        """The spawned ranks' process ids (rank 1 first)."""
        return [p.pid for p in self.procs]

    def load(self, path: Path, config: EngineConfig, quiet: bool = False, spark: SparkConfig | None = None) -> TPEngine:
        """Load `path` on every rank (each its shard; `spark`: each rank's experts placed by Spark) and return
        rank 0's engine; a previous one is released."""
        full = check_config(path, config)
        config = dataclasses.replace(config, cuda_graphs=False, spec_static=False)
        self.release()
        self.comm.broadcast_object(("load", str(path), dataclasses.replace(config, draft=None), spark))
        try:
            loaded, heads, placed = load_shard(path, config, self.comm, quiet, bool(config.draft), spark)
            engine: TPEngine | None = TPEngine(loaded, config, self, full, heads, placed)
            error = None
        except LuceboxError as exc:  # the same file refused on every rank, most likely: say which
            engine, error = None, str(exc)
        errors = self.comm.gather_objects(error)
        failed = next((f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None), None)
        if failed is not None:
            raise LuceboxError(failed)
        self.engaged, self.active = True, engine
        log.info("tensor parallelism: %d ranks (%s), rank 0 serves", self.world, self.comm.device.type)
        return self.active

    def release(self, engine: TPEngine | None = None) -> None:
        """Close the engine the other ranks run plans for (`engine`: only if it is that one)."""
        if engine is not None and engine is not self.active:
            return
        if self.active is not None:
            with self.active.sender.lock:  # after a PFlash scorer pass in flight; none starts after it
                self.active.sender.closed = True
            self.active = None
        if self.engaged:
            self.comm.send_plan(None)
            self.engaged = False

    def close(self) -> None:
        """Stop every rank (at exit, or when done with the group)."""
        if self.closing:
            return
        self.closing = True
        self.release()
        self.comm.broadcast_object(("exit",))
        for p in self.procs:
            p.join(timeout=30)
        close_group()
        if TPGroup.current is self:
            TPGroup.current = None

    def _watch(self) -> None:
        while not self.closing:
            for rank, p in enumerate(self.procs, start=1):
                if p.exitcode is not None and not self.closing:
                    fatal(f"rank {rank} (pid {p.pid}) exited with code {p.exitcode}")
            time.sleep(WATCH_S)


def tensor_parallel_engine(path: Path, config: EngineConfig, quiet: bool = False,
                           spark: SparkConfig | None = None) -> TPEngine:
    """LLMEngine.from_path (spark: spark_engine) for --tensor-parallel N > 1: rank 0's engine, the other ranks
    started and loaded."""
    device = config.resolve_device()
    check_config(path, config)  # before any process starts
    return TPGroup.get(config.tensor_parallel, device.type).load(path, config, quiet, spark)


def check_config(path: Path, config: EngineConfig) -> ModelConfig:
    """Refuse, with the reason, what tensor parallelism cannot run (yet); returns the model's config."""
    cfg = read_model_config(path)
    check_shardable(cfg, config.tensor_parallel)
    if config.resolve_device().type == "cuda" and not config.kv_tokens:
        raise LuceboxError("--tensor-parallel on CUDA needs --kv-tokens (the memory plan is one device's)")
    return cfg


def follower_main(rank: int, world: int, device_type: str, init_method: str = "env://") -> int:
    """A rank other than 0: join the group, then load each model rank 0 loads and run its steps' plans."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rank {rank} %(levelname).1s %(name)s: "
                            "%(message)s", datefmt="%H:%M:%S")
    if init_method != "env://":  # spawned by rank 0: end with it, and when it decides (Ctrl-C reaches both)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        parent = os.getppid()
        threading.Thread(target=_watch_parent, args=(parent, rank), name="lucebox-tp-parent", daemon=True).start()
    if device_type == "cpu":  # the ranks share the host's cores (rank 0 keeps its own setting)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    comm = init_group(rank, world, device_type, init_method)
    engine: LLMEngine | None = None
    while True:
        msg = comm.broadcast_object()
        if msg[0] == "exit":
            break
        _, path, config, spark = msg
        engine = None  # the previous model's memory goes before the next one loads
        try:
            engine, error = LLMEngine(load_shard(Path(path), config, comm, True, spark=spark)[0], config), None
        except LuceboxError as exc:  # told to rank 0, which raises it; wait for the next load
            error = str(exc)
        if any(e is not None for e in comm.gather_objects(error)):
            engine = None
            continue
        assert engine is not None
        run_plans(engine.runner, comm)
    close_group()
    return 0


def run_plans(runner: ModelRunner, comm: Comm) -> None:
    """Run rank 0's steps, snapshot copies and state restores on this rank's shard until it closes the engine."""
    kv, states = runner.kv, runner.kv.states
    while (words := comm.recv_plan()) is not None:
        plan = decode_plan(words)
        move_rows(kv, *plan.moves)
        for slot, row in plan.accepts:
            assert states is not None
            states.accept(slot, row)
        if plan.op == SAVE:
            comm.gather_to_root(save_rows(kv, plan.blocks, plan.end))
        elif plan.op == LOAD:
            write_rows(kv, plan.blocks, plan.start, plan.end,
                       comm.scatter_from_root(load_rows(kv, plan.start, plan.end)))
        elif plan.op == LOAD_STATE:
            assert states is not None
            states.write_slot(plan.slot, *scatter_state(comm, states))
        elif plan.op == SCORE:
            sharded_importance(runner.model, plan.ids, comm.broadcast_object(), comm)
        else:
            captures = capture_states(states, plan.states) if states is not None else []
            runner.forward(runner.prepare(plan.chunks), plan.capture)
            if captures:
                send_captures(comm, states, captures)


def _watch_parent(parent: int, rank: int) -> None:
    while os.getppid() == parent:
        time.sleep(WATCH_S)
    fatal(f"rank {rank}: rank 0 (pid {parent}) is gone")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
