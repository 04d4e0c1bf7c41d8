"""The fast drafter trainer (issue 15): the packed step equals the per-sequence step, the flex BlockMask is the
dense mask, target features are captured once into a memory-mapped store, checkpoints come in small shards.

Everything runs on the CPU in fp32 (one thread: on a shared 2-core machine more threads make these small ops
slower); the flex_attention checks run its eager forward, the CPU has no flex backward.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from lucebox.cli import build_parser
from lucebox.engine.spec.drafter import DFlashDrafter, drafter_config_for, load_drafter
from lucebox.engine.weights.loader import load_model
from lucebox.errors import LuceboxError
from lucebox.train.checkpoint import SHARD_BYTES, read_checkpoint, write_checkpoint
from lucebox.train.command import BENCH, main
from lucebox.train.examples import Example, generate_examples, generation_engine
from lucebox.train.features import FeatureStore, TargetFeatures
from lucebox.train.loss import block_loss, position_weights, sample_anchors
from lucebox.train.packed import (
    TILE,
    attention_masks,
    dense_mask,
    mask_mod,
    pack,
    packed_hidden,
    packed_loss,
    tile_block_mask,
)
from lucebox.train.trainer import CHECKPOINT, FEATURES, TrainConfig, Trainer, export_drafter

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def setup(tiny_gguf):
    """A tiny gemma3 target (sliding window), its greedy responses to 6 prompts and their features."""
    loaded = load_model(tiny_gguf("gemma3", "F32", sliding_window=8), device="cpu", dtype=torch.float32, quiet=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(4, 12))] for _ in range(6)]
    engine = generation_engine(loaded, 8, 12, 40)
    examples = generate_examples(loaded, prompts, max_new_tokens=rng.choice([30, 40]), batch=8, engine=engine,
                                 quiet=True)
    cfg = loaded.config
    dcfg = drafter_config_for(cfg, layers=2, block_size=6, mask_token_id=cfg.vocab_size - 1,
                              target_layers=[0, cfg.num_layers - 1], kv_heads=1)
    dcfg.layer_types, dcfg.sliding_window = ["sliding_attention", "full_attention"], 5
    feats = TargetFeatures(engine, dcfg.target_layer_ids)([e.tokens for e in examples])
    return loaded, engine, examples, dcfg, feats


def anchors_of(examples: list[Example], block: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [sample_anchors(e.prompt_len, len(e.tokens), block, n, g) for e in examples]


def test_packed_loss_and_gradients_equal_the_per_sequence_step(setup):
    """One packed forward over every sequence == block_loss sequence by sequence (fp32): the speedup is lossless."""
    loaded, _, examples, dcfg, feats = setup
    target, b = loaded.model, dcfg.block_size
    anchors = anchors_of(examples, b, 12)
    assert dcfg.num_heads > dcfg.num_kv_heads == 1  # grouped heads read through enable_gqa
    pos_w = position_weights(b, 7.0)
    total_w = float(sum(len(a) for a in anchors)) * float(pos_w.sum())

    def run(packed: bool) -> tuple[float, torch.Tensor, dict[str, torch.Tensor]]:
        d = DFlashDrafter.random(dcfg, seed=1, std=0.2).requires_grad_(True)
        d.init_rotary("cpu")
        if packed:
            px = pack([e.tokens for e in examples], anchors, b, dcfg.mask_token_id)
            ctx = torch.cat([torch.cat(f, -1)[:c] for f, c in zip(feats, px.ctx_lens)])
            loss, correct = packed_loss(d, target, ctx, px, attention_masks(d, px, px, flex=False), pos_w,
                                        1.0 / total_w)
            loss.backward()
        else:
            loss, parts = torch.zeros(()), []
            for e, a, f in zip(examples, anchors, feats):
                part, c = block_loss(d, target, f, torch.tensor(e.tokens), a, pos_w, scale=1.0 / total_w)
                part.backward()
                loss, parts = loss + part.detach(), parts + [c]
            correct = torch.cat(parts)
        return float(loss.detach()), correct, {n: p.grad.clone() for n, p in d.named_parameters()}

    ref_loss, ref_correct, ref_grad = run(False)
    loss, correct, grad = run(True)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert torch.equal(correct, ref_correct)
    for name, g in ref_grad.items():
        assert g.abs().max() > 0, name  # every weight takes part
        assert torch.allclose(grad[name], g, rtol=1e-4, atol=1e-6 * float(g.abs().max())), name


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window", [None, 5])
def test_tile_block_mask_is_the_dense_mask_and_flex_equals_sdpa(setup, window):
    """The BlockMask built from row ranges == torch's create_block_mask of the same mask_mod (tile by tile, and
    its dense form == dense_mask); flex_attention over it == SDPA with the dense mask."""
    dcfg = setup[3]
    # Blocks of 6 rows straddle the 128-row tiles; sequences long enough for tiles that are full, partial, empty.
    rng = random.Random(1)
    ex = [Example(5, [rng.randrange(3, 300) for _ in range(n)]) for n in (1500, 90, 400, 16, 300)]
    px = pack([e.tokens for e in ex], anchors_of(ex, 6, 80), 6, dcfg.mask_token_id)
    assert px.q_len % TILE and px.kv_len % TILE and px.q_len // TILE >= 4  # last tiles shorter
    ours = attention_masks(DFlashDrafter(dcfg), px, px, flex=True)[window is not None]
    ref = create_block_mask(mask_mod(px, window), None, None, px.q_len, px.kv_len, device="cpu")
    dense = dense_mask(px, window)
    assert torch.equal(ours.to_dense(), ref.to_dense())
    assert torch.equal(ours.full_kv_num_blocks, ref.full_kv_num_blocks)
    assert (ours.full_kv_num_blocks.sum() > 2) == (window is None)  # a window (< TILE) leaves no tile full
    nq, nk = -(-px.q_len // TILE) * TILE, -(-px.kv_len // TILE) * TILE
    tiles = torch.nn.functional.pad(dense, (0, nk - px.kv_len, 0, nq - px.q_len))
    tiles = tiles.view(nq // TILE, TILE, nk // TILE, TILE).any(3).any(1)
    assert torch.equal(ours.to_dense()[0, 0].bool(), tiles)
    assert 0.1 < tiles.float().mean() < 0.6  # sparse: that is the point
    # flex_attention (eager, forward only on the CPU) over our BlockMask vs SDPA with the dense mask.
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, ln, 16, generator=g) for n, ln in ((4, px.q_len), (2, px.kv_len), (2, px.kv_len)))
    from torch.nn.attention.flex_attention import flex_attention

    got = flex_attention(q, k, v, block_mask=ours, enable_gqa=True)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)
    assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_packed_flex_forward_equals_the_dense_one(setup):
    """The drafter forward through flex_attention and the BlockMask == through SDPA and the dense mask."""
    loaded, _, examples, dcfg, feats = setup
    anchors = anchors_of(examples, dcfg.block_size, 12)
    d = DFlashDrafter.random(dcfg, seed=1, std=0.2)
    d.init_rotary("cpu")
    out = []
    with torch.no_grad():
        for flex in (False, True):
            px = pack([e.tokens for e in examples], anchors, dcfg.block_size, dcfg.mask_token_id)
            ctx = torch.cat([torch.cat(f, -1)[:c] for f, c in zip(feats, px.ctx_lens)])
            out.append(packed_hidden(d, loaded.model, ctx, px, attention_masks(d, px, px, flex)))
    assert torch.allclose(out[0], out[1], atol=1e-5)


# ----- the trainer: features captured once, the packed step, checkpoints in shards ----------------------------


def count_target_forwards(model: torch.nn.Module) -> tuple[list[int], object]:
    calls = [0]

    def hook(*_: object) -> None:
        calls[0] += 1

    return calls, model.register_forward_hook(hook)


def make_trainer(setup, folder: Path | None, feature_cache: str = "auto", max_rows: int | None = None) -> Trainer:
    loaded, engine, examples, dcfg, _ = setup
    return Trainer(loaded, engine, examples, DFlashDrafter.random(dcfg, seed=2), TrainConfig(
        steps=4, batch=3, anchors=16, lr=3e-3, save_dtype="float32"), feature_cache, folder, max_rows)


def test_target_runs_once_per_example_and_never_in_later_epochs(setup, tmp_path):
    """The target's forward (counted by a hook on the real module) runs while the store is captured, never
    during the steps of epochs 1 and 2, and not at all for a second trainer on the same folder."""
    loaded, engine, examples, dcfg, feats = setup
    calls, handle = count_target_forwards(loaded.model)
    try:
        tr = make_trainer(setup, tmp_path)
        assert calls[0] >= 1 and (tmp_path / f"{FEATURES}.bin").stat().st_size == tr.feature_bytes()
        for i, f in enumerate(feats):  # the store holds what TargetFeatures gives, layers concatenated
            assert torch.equal(tr.store.example(i), torch.cat(f, -1))
        captured = calls[0]
        epochs = set()
        for _ in range(4):  # 6 examples, 3 a step: epochs 0 and 1
            epochs.add(tr.step * tr.cfg.batch // len(tr.examples))
            tr.train_step()
        assert epochs == {0, 1} and calls[0] == captured
        again = make_trainer(setup, tmp_path)
        assert calls[0] == captured and torch.equal(again.store.rows, tr.store.rows)  # reopened, not recaptured
        off = make_trainer(setup, None, feature_cache="off")
        off.train_step()
        assert off.store is None and calls[0] > captured  # the hook does see the target when it runs
    finally:
        handle.remove()


def test_trainer_packed_step_equals_its_per_sequence_step(setup):
    """Trainer.bench runs both steps from the same start on the same data: the same losses, restored after."""
    tr = make_trainer(setup, None)
    before = {k: v.clone() for k, v in tr.drafter.state_dict().items()}
    res = tr.bench(3, warmup=1)
    assert res["sequential"]["rows"] == res["packed"]["rows"] > 0 and res["packed"]["rows_s"] > 0
    assert res["max_loss_rel_diff"] < 1e-5 and len(res["packed"]["losses"]) == 3
    assert tr.step == 0 and all(torch.equal(v, before[k]) for k, v in tr.drafter.state_dict().items())
    # A step split into several forwards (max_rows) is the same step.
    split = make_trainer(setup, None, max_rows=100)
    a, b = tr.train_step(), split.train_step()
    assert b.mean_loss == pytest.approx(a.mean_loss, rel=1e-6) and b.correct == a.correct
    loaded, engine, examples, dcfg, _ = setup
    with pytest.raises(LuceboxError, match="flex_attention has no backward on the CPU"):
        Trainer(loaded, engine, examples, DFlashDrafter.random(dcfg), TrainConfig(steps=1), attention="flex")
    grads = dict(split.drafter.named_parameters())
    for k, p in tr.drafter.named_parameters():  # the step's (clipped) gradients stay until the next step
        assert torch.allclose(grads[k].grad, p.grad, rtol=1e-4, atol=1e-6 * float(p.grad.abs().max())), k


def test_checkpoint_shards_round_trip_and_are_checked(tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {"step": 7, "nested": {0: {"m": torch.randn(300, 7, generator=g), "s": torch.tensor(3.0)}},
             "bf16": torch.randn(2000, generator=g).to(torch.bfloat16), "ids": torch.arange(5), "empty": torch.zeros(0),
             "flags": torch.tensor([True, False]), "rows": [{"loss": 1.5, "acc": [0.1, float("nan")]}], "none": None}
    write_checkpoint(tmp_path / "ck", state, shard_bytes=4096)
    files = sorted((tmp_path / "ck").iterdir())
    shards = [f for f in files if f.name != "index.json"]
    assert len(shards) == -(-(300 * 7 * 4 + 4 + 4000 + 40 + 2) // 4096)
    assert all(f.stat().st_size <= 4096 for f in shards)
    back = read_checkpoint(tmp_path / "ck")
    assert back["step"] == 7 and back["none"] is None and list(back["nested"]) == [0]
    for key in ("bf16", "ids", "empty", "flags"):
        assert back[key].dtype == state[key].dtype and torch.equal(back[key], state[key])
    assert torch.equal(back["nested"][0]["m"], state["nested"][0]["m"]) and back["nested"][0]["s"].shape == ()
    assert back["rows"][0]["loss"] == 1.5 and back["rows"][0]["acc"][1] != back["rows"][0]["acc"][1]  # nan
    write_checkpoint(tmp_path / "ck", {"step": 8}, shard_bytes=4096)  # replaced whole: no stale shards
    assert sorted(f.name for f in (tmp_path / "ck").iterdir()) == ["index.json"]
    write_checkpoint(tmp_path / "ck", state, shard_bytes=4096)
    data = bytearray(shards[1].read_bytes())
    data[10] ^= 1
    shards[1].write_bytes(bytes(data))
    with pytest.raises(LuceboxError, match="shard-00001.bin is damaged"):
        read_checkpoint(tmp_path / "ck")


def test_resume_and_export_from_the_sharded_checkpoint(setup, tmp_path):
    """save -> resume gives the same drafter, optimizer state and step; export rebuilds the public layout."""
    loaded, engine, examples, dcfg, _ = setup
    tr = make_trainer(setup, tmp_path)
    for _ in range(2):
        tr.train_step()
    tr.save(tmp_path)
    assert all(f.stat().st_size <= SHARD_BYTES for f in (tmp_path / CHECKPOINT).iterdir())
    back = Trainer.resume(loaded, engine, examples, tmp_path)
    assert back.step == 2
    for k, v in tr.drafter.state_dict().items():
        assert torch.equal(back.drafter.state_dict()[k], v)
    opt_a, opt_b = tr.opt.state_dict()["state"], back.opt.state_dict()["state"]
    assert opt_a.keys() == opt_b.keys() and all(torch.equal(opt_a[i]["exp_avg_sq"], opt_b[i]["exp_avg_sq"])
                                                for i in opt_a)
    assert back.train_step().mean_loss == pytest.approx(tr.train_step().mean_loss, rel=1e-6)
    (tmp_path / "model.safetensors").unlink()
    export_drafter(tmp_path)
    d = load_drafter(tmp_path, loaded.config, "cpu", torch.float32)
    for k, v in d.state_dict().items():  # written in the run's save dtype (float32 here): the weights exactly
        assert torch.equal(v, read_checkpoint(tmp_path / CHECKPOINT)["model"][k])


def test_command_bench_trainer_and_export(tiny_gguf, tmp_path, capsys):
    """`train-drafter --bench-trainer N` prints rows/s of both steps and trains nothing; `--export` rebuilds the
    drafter folder from the checkpoint shards alone."""
    prompts = tmp_path / "prompts.jsonl"
    rng = random.Random(1)
    words = "the cat sat on a mat while two dogs ran far away from home and then came back".split()
    prompts.write_text("".join(json.dumps({"prompt": " ".join(rng.choices(words, k=rng.randrange(3, 9)))}) + "\n"
                               for _ in range(8)))
    out = tmp_path / "run"

    def args(*extra: str):
        return build_parser().parse_args([
            "train-drafter", "--target", str(tiny_gguf("llama", "F32")), "--out", str(out), "--device", "cpu",
            "--prompts", str(prompts), "--sources", "file", "--max-new-tokens", "24", "--layers", "1",
            "--block-size", "4", "--target-layers", "0,1", "--batch", "4", "--anchors", "8", "--steps", "4",
            "--save-every", "4", "--eval-prompts", "0", "--save-dtype", "float32", *extra])

    capsys.readouterr()
    assert main(args("--bench-trainer", "2")) == 0
    err = capsys.readouterr().err
    res = json.loads((out / BENCH).read_text())
    assert res["sequential"]["rows"] == res["packed"]["rows"] > 0 and res["max_loss_rel_diff"] < 1e-5
    assert "rows/s" in err and "packed / per-sequence" in err and not (out / CHECKPOINT).exists()
    assert main(args("--log-every", "2")) == 0
    progress = [x for x in capsys.readouterr().err.splitlines() if x.startswith("step ")]
    assert len(progress) == 2 and all(" rows/s eta " in x for x in progress)  # throughput and ETA
    saved = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").unlink()
    assert main(build_parser().parse_args(["train-drafter", "--out", str(out), "--export"])) == 0
    assert (out / "model.safetensors").read_bytes() == saved


def test_an_interrupted_feature_capture_continues_where_it_stopped(setup, tmp_path):
    loaded, engine, examples, dcfg, feats = setup
    seqs = [e.tokens for e in examples]
    width = len(dcfg.target_layer_ids) * dcfg.hidden_size
    tf = TargetFeatures(engine, dcfg.target_layer_ids)

    def stop_after_first(done: int, total: int) -> None:
        if done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        FeatureStore.build(tf, seqs, width, torch.float32, torch.device("cpu"), tmp_path / "f", "fp", group=2,
                           progress=stop_after_first)
    assert json.loads((tmp_path / "f.json").read_text())["done"] == 2
    calls, handle = count_target_forwards(loaded.model)
    try:
        store = FeatureStore.build(tf, seqs, width, torch.float32, torch.device("cpu"), tmp_path / "f", "fp", group=2)
    finally:
        handle.remove()
    assert calls[0] == 2  # the two groups left, one forward each
    for i, f in enumerate(feats):
        assert torch.equal(store.example(i), torch.cat(f, -1))
    other = FeatureStore.build(tf, seqs[:2], width, torch.float32, torch.device("cpu"), tmp_path / "f", "other")
    assert torch.equal(other.example(1), torch.cat(feats[1], -1))  # another fingerprint: captured anew


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_compiled_flex_over_changing_batches_settles_on_one_dynamic_graph():
    """What CUDA runs, traced on the CPU (dynamo + AOT autograd with the aot_eager backend, forward): new shapes
    and a new mask_mod closure every step recompile twice at most, then never; the outputs equal eager's."""
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(flex_attention, dynamic=True, backend="aot_eager")
    rng = random.Random(0)
    graphs = []
    try:
        for step in range(6):
            toks = [[rng.randrange(3, 300) for _ in range(rng.randrange(150, 300))] for _ in range(rng.randrange(2, 4))]
            g = torch.Generator().manual_seed(step)
            px = pack(toks, [sample_anchors(20, len(t), 8, 20, g) for t in toks], 8, 1)
            bm = tile_block_mask(px, px, None)
            q = torch.randn(1, 4, px.q_len, 16, generator=g)
            k, v = (torch.randn(1, 2, px.kv_len, 16, generator=g) for _ in range(2))
            got = compiled(q, k, v, block_mask=bm, enable_gqa=True)
            assert torch.allclose(got, flex_attention(q, k, v, block_mask=bm, enable_gqa=True), atol=1e-6)
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    finally:
        torch._dynamo.reset()
    assert graphs[-1] <= 4 and graphs[2:] == [graphs[2]] * 4  # settled by the third batch, never recompiled after
