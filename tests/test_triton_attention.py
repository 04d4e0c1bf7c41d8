"""The Triton paged decode kernel against the simple gather + SDPA path.

Runs on CUDA, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1)
when triton is importable; skips otherwise.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

triton_attention = pytest.importorskip("lucebox.engine.kernels.triton_attention")
if triton_attention.triton is None:
    pytest.skip("triton is not installed", allow_module_level=True)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA; set TRITON_INTERPRET=1 to run the kernel on the CPU", allow_module_level=True)


def reference(q, k_cache, v_cache, tables, positions, page, scale, window):
    outs = []
    for b in range(q.shape[0]):
        ctx = int(positions[b]) + 1
        pos = torch.arange(ctx)
        slots = tables[b, pos // page].cpu() * page + pos % page
        k = k_cache[slots.to(k_cache.device)].transpose(0, 1).float()
        v = v_cache[slots.to(v_cache.device)].transpose(0, 1).float()
        mask = torch.ones(1, ctx, dtype=torch.bool, device=q.device)
        if window is not None:
            mask &= (ctx - 1 - pos.to(q.device)) < window
        o = F.scaled_dot_product_attention(q[b][:, None].float(), k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        outs.append(o[:, 0])
    return torch.stack(outs)


@pytest.mark.parametrize("hq,hkv,dim", [(9, 3, 64), (4, 1, 256), (8, 8, 32)])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("max_ctx", [320, 2048])  # 4 / 16 splits, each row's context divided among them
def test_kernel_matches_reference(hq, hkv, dim, window, max_ctx):
    torch.manual_seed(0)
    page, n_blocks, bsz = 16, 64, 3
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    k_cache = torch.randn(n_blocks * page, hkv, dim, device=DEVICE).to(dtype)
    v_cache = torch.randn(n_blocks * page, hkv, dim, device=DEVICE).to(dtype)
    perm = torch.randperm(n_blocks - 1) + 1  # block 0 is scratch
    tables = perm[: bsz * 20].view(bsz, 20).to(DEVICE)
    positions = torch.tensor([0, 77, 300], device=DEVICE)  # contexts 1, 78, 301 tokens
    q = torch.randn(bsz, hq, dim, device=DEVICE).to(dtype)
    out = triton_attention.decode_attention(q, k_cache, v_cache, tables, positions, page=page, scale=dim**-0.5,
                                            max_ctx=max_ctx, window=window)
    ref = reference(q, k_cache, v_cache, tables, positions, page, dim**-0.5, window)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert (out.float() - ref).abs().max().item() < tol
    if dim % 32 == 0:  # with `ws` the merge kernel also writes the rows' int8 workspace (the output projection's)
        from lucebox.engine.kernels import triton_qmm

        ws = triton_qmm.workspace(bsz, hq * dim, DEVICE)
        again = triton_attention.decode_attention(q, k_cache, v_cache, tables, positions, page=page,
                                                  scale=dim**-0.5, max_ctx=max_ctx, window=window, ws=ws)
        assert torch.equal(again, out)
        ref_ws = triton_qmm.quantize_x(out.reshape(bsz, -1))
        sums = slice(hq * dim // 4 + hq * dim // 32, hq * dim // 4 + hq * dim // 16)  # fp32 block sums of x
        keep = torch.ones(ws.shape[1], dtype=torch.bool)
        keep[sums] = False
        assert torch.equal(ws[:, keep], ref_ws[:, keep])
        torch.testing.assert_close(ws[:, sums].view(torch.float32), ref_ws[:, sums].view(torch.float32))


def test_decode_splits_are_64_tokens_of_the_bucket_or_more():
    for max_ctx in (16, 256, 300, 1024, 8192, 131072):
        for programs in (1, 4, 32, 512):
            n = triton_attention.decode_splits(max_ctx, programs=programs)
            assert n & (n - 1) == 0 and n <= 64
            assert n == 1 or (max_ctx / n >= 64 and programs * n // 2 < 256)
    # batch 1, 4 KV heads, the 512-token bucket: 8 splits (32 programs) of 64 tokens for a full bucket; a
    # 257-token context fills 5 of them (whole 64-key tiles); a batch that fills the GPU alone is not split
    assert triton_attention.decode_splits(512, programs=4) == 8
    assert triton_attention.decode_splits(32768, programs=256) == 1
