"""The tiered prefix cache (spec: docs/spec/PREFIX_CACHE.md): the building blocks and how the engine calls them.

Modules (data flows down: the engine calls them, they never call the engine):

- `prefix_index.PrefixIndex` (tier 0): full KV blocks on the device, indexed by token prefix.
- `markers.ChatMarkers` (tier 1 boundaries): where turns start in a prompt's token ids.
- `snapshots` (tiers 1 and 2): `SnapshotPool` of KV in host RAM, `gather_kv_into` (asynchronous, on a
  side stream) / `scatter_kv` between paged blocks and a snapshot, `token_key` / `prefix_keys` (SHA-1 keys).
- `host_pool.HostBufferPool`: the bounded, reusable (pinned on CUDA) host buffers the RAM tiers live in.
- `disk.DiskStore` (persistence): snapshots as checked, memory-mapped files under a budget.
- `layout.layout_id`: the hash that keeps KV of another model/dtype/template from being loaded.

Integration plan
----------------

Start-up (engine): `index = PrefixIndex(kv.pool, kv.block_size)`; `markers =
ChatMarkers.from_template(template, tokenizer)` (on `NoChatMarkers`, tier 1 is off);
`prefix = SnapshotPool(prefix_cache_slots, "prefix")`, `exact = SnapshotPool(prefill_cache_slots,
"exact")`; with `--kv-cache-dir`: `disk = DiskStore(dir, layout_id(model_path=..., kv_dtype=kv.kv_dtype,
block_size=..., n_ctx=..., template_sha1=template.sha1, num_layers=..., num_kv_heads=..., head_dim=...),
budget_bytes, min_tokens)` (its constructor scans the folder: headers only).

Request arrival, off the event loop (the thread that tokenizes): `bounds = markers.boundaries(prompt_ids)`,
`ends = [e for e in bounds if e < len(prompt_ids)]`, `keys = prefix_keys(prompt_ids, ends)`,
`exact_key = token_key(prompt_ids)`.
If RAM misses but `disk.contains(2, exact_key)` or `disk.contains(1, keys[i])` (longest first), `disk.get`
there (checksum + mmap) and promote into the RAM pool with `pool.put(key, snap.tokens, snap.kv)`; the
scheduler then only ever sees RAM.

Admission (scheduler, a waiting sequence with no blocks yet):
  1. tier 0: `blocks = index.lookup(prompt_ids[:-1])`; `pool.incref(blocks)`; the block table starts
     with them; `cached = len(blocks) * block_size` (no copy; the last token is always computed).
  2. tier 2: `snap = exact.get(exact_key)`; else tier 1: `hit = prefix.longest_prefix(prompt_ids, ends,
     keys)` giving `(end, snap)`. When it covers more than `cached` (cap at `len(prompt) - 1`), allocate
     blocks up to that length and `scatter_kv(kv, table, snap.kv, start=cached, end=n)`: positions in
     shared tier-0 blocks are never written. Tier 2 wins over tier 1. (A PFlash tier-2 hit continues
     `snap.tokens`, the compressed prompt, instead of the prompt.)
  3. `seq.num_computed = seq.num_cached = cached` (or `n`); chunked prefill runs the rest as usual.
  4. When the pool is short: `index.evict(need - pool.num_free)` before preempting anybody;
     `index.num_evictable()` says how much that can give.

Commit (a sequence finishes having produced tokens, client still connected; before its blocks are
decref'd; engine thread; `PrefixCache.commit` never waits for the device):
  - tier 0: `index.insert(seq.token_ids[:seq.num_computed], seq.block_table)` (also fine right after
    prefill, and on preemption). Only committed tokens: never a draft a verify step may reject.
  - tier 1: snapshot at `b = bounds[-2]` (everything before the newest user turn's
    content; on the first turn that is the system prompt + tools, which the "not a prefix of another
    entry" eviction rule then keeps) of `prompt[:b]`, unless present or in flight.
  - tier 2: unless the prompt came from tier 2: the KV of `tokens[:-1]` under `exact_key`, with `tokens`
    the ids the KV continues (the prompt, or its PFlash compression).
  - each snapshot: size check against the pool's budget first (too big: nothing allocated, nothing
    copied), `pool.reserve(key, nbytes)` (evicts to make room; invisible to lookups), a buffer from the
    host pool, `kv.pool.incref` of the blocks read, `gather_kv_into` (side stream, after the step that
    wrote the KV). `PrefixCache.poll()` (the engine loop, every step, and before every lookup) then,
    for each finished copy: decref the blocks, `pool.publish(...)`, `disk.put_async(..., done=release)`
    (bounded queue; a full queue drops the write; entries below `min_tokens` are skipped).
`scatter_kv` from pinned memory is an async copy ordered on the current stream before the next forward.

Admin: `disk.clear()`, `prefix.clear()`, `exact.clear()`, `index.clear()`; stats from each
module's `stats()` feed /metrics.
"""
