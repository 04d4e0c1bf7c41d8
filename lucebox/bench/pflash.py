"""`python -m lucebox bench pflash`: PFlash prompt compression against full prefill of the same engine.

Two modes, each one run, each claim a ratio to the full-prefill baseline measured in that run:

- retention (default): needle-in-a-haystack. A pass key sentence sits at a
  depth of 0-100% in real filler text (SWE-bench issues, or MT-Bench and the
  other benchmark prompts when pyarrow is missing) of a given prompt length;
  the chat-templated question asks for the key. The same model answers
  greedily once with the full prompt and once with the PFlash-compressed
  prompt (scorer: `--scorer`, default the model itself). Reported per length:
  retrieval accuracy of both, the retained fraction (PFlash accuracy / full
  accuracy), the share of full prefill's hits PFlash also got, how often the
  whole needle sentence survived compression, the compression ratio, and TTFT
  of both (PFlash's TTFT includes the scorer). The "no anchors" column is the
  same scores selected without 4-gram anchors (an ablation, no extra scoring).
- speed (`--speed`): TTFT of full prefill vs PFlash at long lengths for a
  target and a scorer of realistic shape (Qwen3-8B and Qwen3-0.6B by default)
  with RANDOM weights written as GGUF files to a temp dir (times only: the
  outputs are meaningless), with PFlash's time split into scorer, selection
  and target prefill. `--target-shape tiny --scorer-shape tiny-scorer` runs
  it on a CPU in seconds.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lucebox.bench.report import environment, print_table, write_json
from lucebox.engine.pflash import PFlash, PFlashConfig
from lucebox.engine.runtime.llm_engine import EngineConfig, LLMEngine
from lucebox.engine.runtime.sampler import SamplingParams
from lucebox.errors import LuceboxError
from lucebox.progress import Progress

INTRO = ("There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the pass key.\n\n")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key?"


def main(args: argparse.Namespace) -> int:
    return speed(args) if args.speed else retention(args)


# ----- shared -------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_prompt(engine: LLMEngine, ids: list[int], max_new: int) -> tuple[float, list[int]]:
    """(seconds to the first token, greedy output ids) for one prompt alone."""
    _sync(engine.device)
    start = time.perf_counter()
    seq = engine.add(ids, SamplingParams(max_tokens=max_new))
    ttft = None
    while not seq.is_finished:
        engine.step()
        if ttft is None and seq.num_output > 0:
            _sync(engine.device)
            ttft = time.perf_counter() - start
    return (ttft if ttft is not None else time.perf_counter() - start), seq.output_ids


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise LuceboxError(f"expected comma-separated integers, got {text!r}") from None


def _documents(data_dir: Path | None) -> tuple[list[str], str]:
    """Filler: SWE-bench issue texts when pyarrow can read them, else the agent prompts and MT-Bench turns.

    Not the math and code prompts of prompts/*.jsonl: a haystack of "Solution: put your answer in
    \\boxed{}" lines makes a small model solve them instead of answering the question.
    """
    import json

    from lucebox.bench.serve import load_documents
    from lucebox.data import data_dir as resolve_data_dir

    data = resolve_data_dir(data_dir)
    docs, source = load_documents(data)
    if source.endswith(".parquet (problem_statement)"):
        return docs, source
    texts = []
    for md in sorted((data / "agent_prompts").glob("*.md")):
        texts += [p.strip() for p in md.read_text(encoding="utf-8").split("\n\n") if len(p.strip()) > 40]
    mt = data / "prompts" / "mt_bench.jsonl"
    if mt.is_file():
        rows = [json.loads(line) for line in mt.read_text(encoding="utf-8").splitlines() if line.strip()]
        texts += [r["turns"][0].strip() for r in rows if r.get("turns")]
    if not texts:
        return docs, source
    return texts, f"{data / 'agent_prompts'}/*.md paragraphs + {mt} first turns"


def _config(args: argparse.Namespace, default_keep: float) -> PFlashConfig:
    cfg = PFlashConfig(keep_ratio=default_keep if args.keep_ratio is None else args.keep_ratio)
    cfg.validate()
    return cfg


# ----- retention: needle in a haystack ------------------------------------------------


class Haystack:
    """Chat prompts of about L tokens: intro, filler with a pass key at a depth, the question."""

    def __init__(self, builder: Any, docs: list[str], max_tokens: int) -> None:
        self.builder, self.tok = builder, builder.tokenizer
        text, enc = "", None
        for i in range(0, len(docs), 64):  # enough filler for the longest prompt, tokenized once
            text += "".join(d.strip() + "\n\n" for d in docs[i:i + 64])
            enc = self.tok.hf.encode_batch([text], add_special_tokens=False)[0]
            if len(enc.ids) >= max_tokens:
                break
        if enc is None or len(enc.ids) < max_tokens:
            held = len(enc.ids) if enc else 0
            raise LuceboxError(f"the filler documents hold {held} tokens, fewer than the {max_tokens} asked")
        self.filler, self.offsets = text, enc.offsets

    def messages(self, filler: str) -> list[dict]:
        return [{"role": "user", "content": f"{INTRO}{filler}\n\n{QUESTION}"}]

    def prompt(self, length: int, depth: float, key: int) -> tuple[str, str, str]:
        """(rendered prompt, user message, needle) of about `length` tokens, the needle at `depth` (0..1)."""
        needle = NEEDLE.format(key=key)
        overhead = len(self.builder.render_ids(self.messages(needle + "\n\n"), add_generation_prompt=True))
        n = max(0, length - overhead)
        filler = self.filler[: self.offsets[n][0]] if n < len(self.offsets) else self.filler
        at = self.offsets[int(depth * n)][0] if int(depth * n) < n else len(filler)
        if 0 < at < len(filler):  # move to the start of the sentence or line it falls in
            cut = max(filler.rfind("\n", 0, at), filler.rfind(". ", 0, at) + 1)
            at = cut + 1 if cut > 0 and at - cut < 400 else at
        haystack = filler[:at] + (" " if at and not filler[at - 1].isspace() else "") + needle + " " + filler[at:]
        messages = self.messages(haystack.strip())
        return self.builder.render(messages, add_generation_prompt=True), messages[-1]["content"], needle


def retention(args: argparse.Namespace) -> int:
    from lucebox.chat.prompt import PromptBuilder
    from lucebox.cli import engine_from_args
    from lucebox.engine.weights.loader import load_model

    lengths, depths = _ints(args.lengths), _ints(args.depths)
    if not lengths or not depths or any(not 0 <= d <= 100 for d in depths):
        raise LuceboxError("--lengths and --depths need values (depths in 0..100)")
    engine = engine_from_args(args, max_num_seqs=1, max_step_tokens=max(args.max_step_tokens, max(lengths) + 64))
    target = engine.loaded
    if max(lengths) + args.max_new >= engine.n_ctx:
        raise LuceboxError(f"--lengths up to {max(lengths)} plus {args.max_new} answer tokens do not fit the "
                           f"model's {engine.n_ctx}-token context")
    scorer = load_model(Path(args.scorer), device=engine.device, dtype=target.dtype) if args.scorer else target
    cfg = _config(args, 0.1)
    pflash = PFlash.for_model(target, scorer, cfg)
    no_anchor_cfg = PFlashConfig(**{**cfg.__dict__, "anchors": False})
    docs, source = _documents(args.data_dir)
    builder = PromptBuilder.for_model(target, override_file=args.chat_template_file)
    hay = Haystack(builder, docs, max(lengths))
    rng = random.Random(args.seed)
    tok = engine.tokenizer

    run_prompt(engine, tok.encode("Hello", add_special=False), 2)  # warm-up
    cases: list[dict[str, Any]] = []
    progress = Progress("bench pflash retention", total=len(lengths) * len(depths) * args.trials, unit="cases")
    for length in lengths:
        for depth in depths:
            for _ in range(args.trials):
                key = rng.randint(10000, 99999)
                text, user, needle = hay.prompt(length, depth / 100, key)
                _sync(engine.device)
                t = time.perf_counter()
                ids = tok.encode(text, add_special=False)
                encode_s = time.perf_counter() - t
                full_ttft, full_out = run_prompt(engine, ids, args.max_new)
                full_ttft += encode_s
                scored = pflash.score(text)
                res = pflash.select(scored, query=user)
                pf_ttft, pf_out = run_prompt(engine, res.ids, args.max_new)
                plain = pflash.select(scored, query=user, config=no_anchor_cfg)
                _, plain_out = run_prompt(engine, plain.ids, args.max_new)
                full_answer, pf_answer = tok.decode(full_out, True), tok.decode(pf_out, True)
                cases.append({
                    "length": length, "tokens": len(ids), "depth": depth, "key": key,
                    "full_correct": str(key) in full_answer, "pflash_correct": str(key) in pf_answer,
                    "no_anchors_correct": str(key) in tok.decode(plain_out, True),
                    "needle_kept": needle in res.text, "compressed_tokens": res.compressed_tokens,
                    "ratio": res.ratio, "full_ttft_s": full_ttft, "pflash_ttft_s": res.total_seconds + pf_ttft,
                    "scorer_s": res.scorer_seconds, "target_ttft_s": pf_ttft,
                    "full_answer": full_answer, "pflash_answer": pf_answer,
                })
                progress.advance()
    progress.close()

    rows, summary = [], []
    for length in lengths + [None]:
        group = [c for c in cases if length is None or c["length"] == length]
        s = _summarize(group)
        summary.append({"length": length or "all", **s})
        rows.append([str(length) if length else "all", len(group), s["full_accuracy"], s["pflash_accuracy"],
                     s["retained"], s["full_hits_kept"], s["no_anchors_accuracy"], s["needle_kept"], s["ratio"],
                     s["full_ttft_s"], s["pflash_ttft_s"], s["scorer_s"], s["ttft_speedup"]])
    title = (f"bench pflash retention: {target.config.name} on {engine.device}, scorer "
             f"{scorer.config.name if scorer is not target else 'the model itself'}, keep ratio {cfg.keep_ratio}, "
             f"depths {depths}%, filler {source}")
    print_table(title, ["length", "cases", "full acc", "pflash acc", "retained", "full hits kept", "no-anchor acc",
                        "needle kept", "ratio", "full TTFT s", "pflash TTFT s", "scorer s", "TTFT speedup"], rows)
    write_json(args.json, {"benchmark": "pflash-retention", "model": str(target.path),
                           "scorer": str(scorer.path), "keep_ratio": cfg.keep_ratio, "config": _jsonable(cfg),
                           "filler": source, "env": environment(engine.device), "summary": summary,
                           "cases": cases})
    return 0


def _summarize(cases: list[dict[str, Any]]) -> dict[str, Any]:
    n = max(1, len(cases))

    def mean(key: str) -> float:
        return sum(float(c[key]) for c in cases) / n

    full, pf = mean("full_correct"), mean("pflash_correct")
    hits = [c for c in cases if c["full_correct"]]
    return {"cases": len(cases), "full_accuracy": full, "pflash_accuracy": pf,
            "retained": pf / full if full else None,
            "full_hits_kept": sum(c["pflash_correct"] for c in hits) / len(hits) if hits else None,
            "no_anchors_accuracy": mean("no_anchors_correct"),
            "needle_kept": mean("needle_kept"), "ratio": mean("ratio"), "full_ttft_s": mean("full_ttft_s"),
            "pflash_ttft_s": mean("pflash_ttft_s"), "scorer_s": mean("scorer_s"),
            "ttft_speedup": mean("full_ttft_s") / mean("pflash_ttft_s")}


def _jsonable(cfg: PFlashConfig) -> dict[str, Any]:
    return {k: (str(v) if k == "anchor_tiers" else v) for k, v in cfg.__dict__.items()}


# ----- speed: realistic shapes, random weights ------------------------------------------


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    tied: bool


SHAPES = {
    "qwen3-8b": Shape(4096, 36, 32, 8, 128, 12288, tied=False),
    "qwen3-0.6b": Shape(1024, 28, 16, 8, 128, 3072, tied=True),
    "tiny": Shape(256, 4, 4, 2, 64, 512, tied=False),
    "tiny-scorer": Shape(128, 2, 2, 1, 64, 256, tied=True),
}


def write_random_gguf(path: Path, shape: Shape, tokenizer_gguf: Path, context: int, name: str,
                      seed: int = 0) -> Path:
    """A Qwen3-architecture GGUF of `shape` with random F16 weights and the tokenizer of `tokenizer_gguf`.

    For timing only. One random matrix per distinct shape is shared by every
    layer (the file is as big as the real model; the math is the same).
    """
    from lucebox.bench.decode import write_random_quant_gguf

    if tokenizer_gguf.is_dir() or tokenizer_gguf.suffix != ".gguf":
        raise LuceboxError(f"--speed copies the tokenizer of a GGUF file; {tokenizer_gguf} is not one")
    return write_random_quant_gguf(path, shape, tokenizer_gguf, mix="F16", name=name, seed=seed, context=context)


def _text_of_length(tok: Any, docs: list[str], n: int) -> str:
    """Real text of about n tokens (the documents repeated as needed)."""
    one_round = "".join(d.strip() + "\n\n" for d in docs)
    text = one_round * (n * 8 // len(one_round) + 1)  # a token is rarely over 8 characters
    enc = tok.hf.encode_batch([text], add_special_tokens=False)[0]
    return text if len(enc.ids) <= n else text[: enc.offsets[n][0]]


def speed(args: argparse.Namespace) -> int:
    from lucebox.engine.weights.loader import load_model
    from lucebox.fetch import resolve_model

    lens = _ints(args.speed_lens)
    for s in (args.target_shape, args.scorer_shape):
        if s not in SHAPES:
            raise LuceboxError(f"unknown shape {s!r} (choose from {', '.join(SHAPES)})")
    if not lens:
        raise LuceboxError("--speed-lens needs at least one length")
    cfg = _config(args, 0.05)
    tokenizer_src = resolve_model(args.model)
    docs, source = _documents(args.data_dir)
    econf = EngineConfig(device=args.device, dtype=args.dtype, max_num_seqs=1, cuda_graphs=False,
                         max_step_tokens=args.max_step_tokens, kv_tokens=max(lens) + 1024)
    device = econf.resolve_device()
    dtype = econf.resolve_dtype(device)
    with tempfile.TemporaryDirectory(prefix="lucebox-pflash-") as tmp:
        t = time.perf_counter()
        context = max(lens) + 2048
        target_path = write_random_gguf(Path(tmp) / "target.gguf", SHAPES[args.target_shape], tokenizer_src,
                                        context, f"random {args.target_shape}", seed=args.seed)
        scorer_path = write_random_gguf(Path(tmp) / "scorer.gguf", SHAPES[args.scorer_shape], tokenizer_src,
                                        context, f"random {args.scorer_shape}", seed=args.seed + 1)
        engine = LLMEngine(load_model(target_path, device=device, dtype=dtype, quiet=True), econf)
        scorer = load_model(scorer_path, device=device, dtype=dtype, quiet=True)
        setup_s = time.perf_counter() - t
    pflash = PFlash.for_model(engine.loaded, scorer, cfg)
    tok = engine.tokenizer

    warm = _text_of_length(tok, docs, min(2048, min(lens)))
    run_prompt(engine, tok.encode(warm, add_special=False), 1)
    pflash.compress(warm)
    head = {"benchmark": "pflash-speed", "random_weights": True, "target_shape": args.target_shape,
            "scorer_shape": args.scorer_shape, "shapes": {k: SHAPES[k].__dict__ for k in
                                                          (args.target_shape, args.scorer_shape)},
            "keep_ratio": cfg.keep_ratio, "config": _jsonable(cfg), "text": source, "setup_s": setup_s,
            "env": environment(device)}
    rows, results = [], []
    progress = Progress("bench pflash speed", total=len(lens), unit="lengths")
    for n in lens:
        text = _text_of_length(tok, docs, n)
        _sync(device)
        t = time.perf_counter()
        ids = tok.encode(text, add_special=False)
        full_ttft = time.perf_counter() - t
        full_ttft += run_prompt(engine, ids, 1)[0]
        pflash.compress(text)  # warm: a new length may compile a new flex_attention kernel
        res = pflash.compress(text)
        target_ttft = run_prompt(engine, res.ids, 1)[0]
        pf_ttft = res.total_seconds + target_ttft
        select_s = res.total_seconds - res.scorer_seconds
        r = {"tokens": len(ids), "full_ttft_s": full_ttft, "pflash_ttft_s": pf_ttft, "scorer_s": res.scorer_seconds,
             "select_s": select_s, "target_ttft_s": target_ttft, "speedup": full_ttft / pf_ttft,
             "compressed_tokens": res.compressed_tokens, "ratio": res.ratio,
             "scorer_share": res.scorer_seconds / pf_ttft}
        results.append(r)
        rows.append([len(ids), full_ttft, pf_ttft, res.scorer_seconds, select_s, target_ttft, r["speedup"],
                     res.compressed_tokens, res.ratio])
        write_json(args.json, {**head, "results": results}, quiet=True)  # a cut-short run keeps its lengths
        progress.advance()
    progress.close()
    title = (f"bench pflash speed on {device} ({str(dtype)[6:]}): target {args.target_shape}-shaped, scorer "
             f"{args.scorer_shape}-shaped, RANDOM weights (times only), keep ratio {cfg.keep_ratio}, "
             f"scorer attention {'block-sparse (flex)' if _flex(cfg, device) else 'dense'}")
    print_table(title, ["tokens", "full TTFT s", "pflash TTFT s", "scorer s", "select s", "target s", "speedup",
                        "kept tokens", "ratio"], rows)
    write_json(args.json, {**head, "results": results})
    return 0


def _flex(cfg: PFlashConfig, device: torch.device) -> bool:
    from lucebox.engine.pflash.sparse import use_flex

    return use_flex(cfg, device)
