"""The KV cache: keys and values of every layer for the tokens each sequence has processed.

Design (vLLM-style paged attention with prefix caching, kept small):

* `KVPool` (one per engine) owns all K/V storage as fixed-size blocks of BLOCK tokens. Each layer's keys are one
  array (n_kv_heads, n_blocks * BLOCK, head_dim); block b is columns [b*BLOCK, (b+1)*BLOCK). Storage grows in
  chunks of GROWTH_BLOCKS as tokens arrive: memory follows tokens used, never the context size.
* `KVCache` (one per sequence) is a block table per layer group plus the narrow interface the model uses:
  `reserve(n)` before a forward of n tokens, `write(layer, k, v)`, `keys(layer)` / `values(layer)` with
  `start(layer)` (absolute position of their first column) for attention, `commit()`, `truncate(n)` to roll
  back (speculative decoding), `shift(n_keep, n_discard, rotate)` for llama.cpp's context shift (the model
  supplies the key rotation, so this module stays model-agnostic), `restore(length, kv)` to fill an empty cache
  from a saved session (`session_file.py`).
* Contiguous vs paged: the pool hands a sequence the block right after its last one whenever it is free (and
  grows storage rather than recycle a cached block while under budget), so a lone sequence's table is one run
  of consecutive blocks in storage that grows in chunks, exactly the old contiguous cache. Once several
  sequences allocate in turn (or cached blocks are recycled), tables fragment. Attention reads through the
  block table either way (kernels/cpu/attention.py), so neither layout copies keys; only `keys()` (sessions,
  tests) gathers. Nothing outside this module sees which of the two it got.
* Storage apart from bookkeeping: the arrays live where the model's backend keeps them (`KVStorage`,
  localllm/backends/interface.py: host arrays on the CPU, device buffers on a GPU); everything here is integers
  (tables, names, refcounts, the LRU) and asks the storage for each change to the stored values.
* Prefix caching: each full block is named by a hash of its tokens chained with its parent block's hash, so a
  name stands for the whole prefix up to it. Blocks are refcounted; a sequence whose prompt starts with named
  blocks attaches them (refcount + 1) instead of recomputing them, so two sequences sharing a prefix hold it
  once. Blocks of finished sequences stay named in an LRU of idle blocks; they are recycled (oldest first)
  only when the pool would otherwise grow past its byte budget. A block about to be written while shared or
  named is copied first (copy-on-write), so a rollback never corrupts what others see.
* Sliding-window layers (gemma3) form their own layer group with their own tables: blocks that the next query
  can no longer see are released, so those layers hold about `window` tokens whatever the sequence length.
* Element type (`kv_type`): float32, or `q8_0` (int8 with a scale per 32 values, as ggml's block_q8_0),
  about 3.6x smaller (on backends whose storage has it). Attention reads either directly: each backend's
  `KVStorage` makes its kernels' view of a cache (the CPU's block tables over host arrays, OpenCL's column maps
  on the device) from `block_arrays`, `first` and `write_cols`; `keys()` / `values()` always return float32
  (dequantized), for saving sessions, the reference backend and tests.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

BLOCK = 16  # tokens per block: sharing and trimming waste little, the kernels' loops stay long
Q8_BLOCK = 32  # values per scale of a q8_0 KV cache (ggml's block_q8_0)
KV_TYPES = ("f32", "q8_0")
GROWTH_BLOCKS = 16  # storage grows 256 tokens at a time


def block_hashes(tokens, n_blocks: int, parent: bytes = b"") -> list[bytes]:
    """Chained names of the first n_blocks full blocks of `tokens` (each names the whole prefix up to it)."""
    out = []
    for j in range(n_blocks):
        chunk = np.asarray(tokens[j * BLOCK : (j + 1) * BLOCK], dtype=np.int64).tobytes()
        parent = hashlib.blake2b(parent + chunk, digest_size=16).digest()
        out.append(parent)
    return out


class _Group:
    """Storage and block bookkeeping for layers that share block tables (all of them, or gemma3's global and
    sliding layers separately, since only the sliding ones drop old blocks)."""

    def __init__(self, layers: list[int], window: int, n_kv: int, head_dim: int, value_dim: int, kv_type: str,
                 storage):
        self.layers, self.window, self.storage = layers, window, storage
        quantized = kv_type == "q8_0"
        dtype = np.int8 if quantized else np.float32

        def empty(dim: int, scales: bool) -> list:
            if scales:  # float32 storage has no scales: a last axis of 0 tells the kernels so
                return [storage.new(n_kv, dim // Q8_BLOCK if quantized else 0, np.float32) for _ in layers]
            return [storage.new(n_kv, dim, dtype) for _ in layers]

        self.k, self.k_scale = empty(head_dim, False), empty(head_dim, True)
        self.v, self.v_scale = empty(value_dim, False), empty(value_dim, True)
        per_token = (np.dtype(dtype).itemsize * (head_dim + value_dim)
                     + (4 * (head_dim + value_dim) // Q8_BLOCK if quantized else 0))
        self.block_bytes = BLOCK * n_kv * per_token * len(layers)
        self.refs = np.zeros(0, np.int64)  # sequences holding each block
        self.version = 0  # bumped whenever storage arrays are replaced (growth)
        self.free: set[int] = set()  # blocks holding nothing worth keeping
        self.index: dict[bytes, int] = {}  # prefix name -> block holding it
        self.name_of: dict[int, bytes] = {}
        self.idle: OrderedDict[int, None] = OrderedDict()  # named blocks no sequence holds, oldest first
        self.on_forget = None  # the pool's callback when a name leaves this group

    @property
    def n_blocks(self) -> int:
        return len(self.refs)

    def grow(self) -> None:
        n = self.n_blocks
        for store in self.stores:
            for i, old in enumerate(store):
                store[i] = self.storage.grown(old, (n + GROWTH_BLOCKS) * BLOCK)
        self.refs = np.concatenate([self.refs, np.zeros(GROWTH_BLOCKS, np.int64)])
        self.free.update(range(n, n + GROWTH_BLOCKS))
        self.version += 1

    @property
    def stores(self) -> tuple[list, ...]:
        return self.k, self.k_scale, self.v, self.v_scale

    def forget(self, b: int) -> None:
        name = self.name_of.pop(b, None)
        if name is not None:
            del self.index[name]
            if self.on_forget is not None:
                self.on_forget(name)


class KVPool:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, value_dim: int, windows=None,
                 budget_bytes: int = 0, trim_windows: bool = True, kv_type: str = "f32", storage=None):
        """windows[i] > 0 marks layer i as sliding-window. budget_bytes caps growth while idle cached blocks
        could be recycled instead (live sequences always get the blocks they need). `storage`: where the
        blocks live, the model's backend's `kv_storage()` (`Transformer.new_pool` passes it; this module sits
        below the backends and never picks one)."""
        if storage is None:
            raise TypeError("a KVPool needs storage=: the KV storage of the backend that runs the model")
        self.storage = storage
        if kv_type not in KV_TYPES or kv_type not in storage.kv_types:
            raise ValueError(f"KV cache type {kv_type!r}: use one of {', '.join(storage.kv_types)}")
        if kv_type == "q8_0" and (head_dim % Q8_BLOCK or value_dim % Q8_BLOCK):
            raise ValueError(f"a q8_0 KV cache needs head sizes that are multiples of {Q8_BLOCK}")
        self.kv_type = kv_type
        windows = list(windows) if windows is not None else [0] * n_layers
        if not trim_windows:
            windows = [0] * n_layers  # sliding layers then keep everything (the mask still applies the window)
        by_window: dict[int, list[int]] = {}
        for i, w in enumerate(windows):
            by_window.setdefault(w, []).append(i)
        self.groups = [_Group(layers, w, n_kv_heads, head_dim, value_dim, kv_type, storage)
                       for w, layers in sorted(by_window.items())]
        self.where = {layer: (gi, slot) for gi, g in enumerate(self.groups) for slot, layer in enumerate(g.layers)}
        self.budget_bytes = budget_bytes
        self.layer_group = np.array([self.where[i][0] for i in range(n_layers)], np.int64)
        # The tokens of each named block, under its parent's name: a prompt that leaves a cached prefix inside
        # a block still reuses that block's first positions (copied), as llama.cpp reuses a slot's cache token by
        # token. Without it an editor's keystroke recomputed up to BLOCK - 1 tokens more than llama-server (523
        # vs 510 of each llama.vim /infill).
        self._children: dict[bytes, dict[bytes, np.ndarray]] = {}
        self._parent_of: dict[bytes, bytes] = {}
        for g in self.groups:
            g.on_forget = self._forgotten

    @classmethod
    def for_model(cls, config, budget_bytes: int = 0, trim_windows: bool = True, kv_type: str = "f32",
                  storage=None) -> "KVPool":
        windows = [config.sliding_window if config.layer_is_sliding(i) else 0 for i in range(config.n_layers)]
        return cls(config.n_layers, config.n_head_kv, config.head_dim, config.value_dim, windows, budget_bytes,
                   trim_windows, kv_type, storage)

    def new_cache(self, max_tokens: int) -> "KVCache":
        return KVCache(self, max_tokens)

    @property
    def nbytes(self) -> int:
        return sum(g.n_blocks * g.block_bytes for g in self.groups)

    @property
    def bytes_per_token(self) -> int:
        return sum(g.block_bytes for g in self.groups) // BLOCK

    def blocks_held(self) -> int:
        """Blocks some sequence holds (a shared block counts once)."""
        return sum(int((g.refs > 0).sum()) for g in self.groups)

    def blocks_idle(self) -> int:
        return sum(len(g.idle) for g in self.groups)

    # ---- block lifecycle -------------------------------------------------------------------------------

    def allocate(self, gi: int, prefer: int | None = None) -> int:
        g = self.groups[gi]
        if not g.free and g.idle and self.nbytes + GROWTH_BLOCKS * g.block_bytes > self.budget_bytes:
            b, _ = g.idle.popitem(last=False)  # evict the least recently used idle block
            g.forget(b)
            g.free.add(b)
        if not g.free:
            g.grow()
        # The block right after the sequence's last one keeps its storage one contiguous run.
        b = prefer if prefer in g.free else min(g.free)
        g.free.remove(b)
        g.refs[b] = 1
        return b

    def ref(self, gi: int, b: int) -> None:
        g = self.groups[gi]
        if g.refs[b] == 0:
            del g.idle[b]
        g.refs[b] += 1

    def unref(self, gi: int, b: int, keep: bool = True) -> None:
        """Drop one holder. A block nobody holds stays cached (idle, LRU) if it is named and `keep`, else is free."""
        g = self.groups[gi]
        g.refs[b] -= 1
        if g.refs[b] == 0:
            if keep and b in g.name_of:
                g.idle[b] = None
            else:
                g.forget(b)
                g.free.add(b)

    def name(self, gi: int, b: int, name: bytes, parent: bytes = b"", tokens=None) -> None:
        g = self.groups[gi]
        if name not in g.index and b not in g.name_of:  # the first block with that content stays its holder
            g.index[name] = b
            g.name_of[b] = name
            if tokens is not None and name not in self._parent_of:
                self._parent_of[name] = parent
                self._children.setdefault(parent, {})[name] = np.asarray(tokens, np.int64)

    def _forgotten(self, name: bytes) -> None:
        if name in self._parent_of and not any(name in g.index for g in self.groups):
            parent = self._parent_of.pop(name)
            siblings = self._children[parent]
            del siblings[name]
            if not siblings:
                del self._children[parent]

    def partial_match(self, parent: bytes, tokens) -> tuple[int, bytes | None]:
        """(k, name): the named block after prefix `parent` whose first k tokens equal the first k of `tokens`
        (k as large as possible, at least 1, held by every group), or (0, None)."""
        best, best_name = 0, None
        want = np.asarray(tokens[:BLOCK], np.int64)
        for name, held in self._children.get(parent, {}).items():
            n = min(len(want), len(held))
            diff = np.flatnonzero(held[:n] != want[:n])
            k = int(diff[0]) if len(diff) else n
            if k > best and all(name in g.index for g in self.groups):
                best, best_name = k, name
        return best, best_name


class KVCache:
    """One sequence's view of the pool: a block table per layer group (None where a sliding group dropped one)."""

    def __init__(self, pool: KVPool, max_tokens: int):
        self.pool = pool
        self.max_tokens = max_tokens
        self.length = 0  # committed tokens
        self.pending = 0  # tokens written by the forward in progress (reserved, not yet committed)
        self.tables: list[list[int | None]] = [[] for _ in pool.groups]
        self.first = [0] * len(pool.groups)  # first block each group still holds
        # For the backends' attention and KV writes (each backend's KVStorage makes its kernels' views of them):
        self.block_arrays: list[np.ndarray] = []  # per group, the table from `first` on (set by reserve)
        self.write_cols: list[np.ndarray] = []  # per group, storage columns of the tokens being written (reserve)
        self.names: list[bytes] = []  # prefix names of the full blocks whose tokens we were told
        # After a context shift, blocks from this one on hold keys computed with tokens that are gone: they
        # are not what a fresh forward of their prefix gives, so they must never be named for reuse.
        self.name_limit: int | None = None

    # ---- the interface the forward pass uses ----------------------------------------------------------

    def reserve(self, n: int) -> None:
        need = self.length + n
        if need > self.max_tokens:
            raise ValueError(f"KV cache holds at most {self.max_tokens} tokens, {need} requested")
        for gi, table in enumerate(self.tables):
            j = self.length // BLOCK
            if self.length % BLOCK:
                self._own(gi, j)  # the partial block is about to receive tokens
            while len(table) * BLOCK < need:
                last = table[-1] if table else None
                table.append(self.pool.allocate(gi, None if last is None else last + 1))
        self.block_arrays = [np.asarray(t[f:], np.int64) for t, f in zip(self.tables, self.first)]
        # Where the n new tokens go, per group: the same for every layer of the forward, so computed once here.
        self.write_cols = [self.column_array(gi, self.length, need) for gi in range(len(self.tables))]
        self.pending = n

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """k: (n, n_kv_heads, head_dim), v: (n, n_kv_heads, value_dim) for the n reserved tokens."""
        gi, slot = self.pool.where[layer]
        g = self.pool.groups[gi]
        cols = self.write_cols[gi]
        self.pool.storage.write_rows(g.k[slot], g.k_scale[slot], cols, k)
        self.pool.storage.write_rows(g.v[slot], g.v_scale[slot], cols, v)

    def start(self, layer: int) -> int:
        """Absolute position of the first token `keys(layer)` holds (> 0 once a sliding layer dropped blocks)."""
        return self.first[self.pool.where[layer][0]] * BLOCK

    def keys(self, layer: int) -> np.ndarray:
        """float32 (n_kv, T, head_dim): the keys of positions start(layer)..length (a view when it can be)."""
        gi, slot = self.pool.where[layer]
        g = self.pool.groups[gi]
        return self._read(g.k[slot], g.k_scale[slot], gi, self.start(layer), self.length + self.pending)

    def values(self, layer: int) -> np.ndarray:
        gi, slot = self.pool.where[layer]
        g = self.pool.groups[gi]
        return self._read(g.v[slot], g.v_scale[slot], gi, self.start(layer), self.length + self.pending)

    def _read(self, store, scales, gi: int, start: int, end: int) -> np.ndarray:
        cols = self._columns(gi, start, end)
        if isinstance(store, np.ndarray) and store.dtype == np.float32 and isinstance(cols, slice):
            return store[:, cols]  # a view, no copy
        return self.pool.storage.read_rows(store, scales, self.column_array(gi, start, end))

    def commit(self) -> None:
        self.length += self.pending
        self.pending = 0
        for gi, g in enumerate(self.pool.groups):
            if g.window:
                # The next query (at `length`) sees keys after length - window. One spare block lets a short
                # rollback (speculative decoding) still find its window.
                keep_from = max(0, self.length - g.window + 1) // BLOCK - 1
                while self.first[gi] < keep_from:
                    self.pool.unref(gi, self.tables[gi][self.first[gi]], keep=False)
                    self.tables[gi][self.first[gi]] = None
                    self.first[gi] += 1

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self.length or not self.can_truncate(n):
            raise ValueError(f"cannot truncate a {self.length}-token cache to {n}")
        if n == 0:
            self.release()
            return
        keep_blocks = -(-n // BLOCK)
        for gi, table in enumerate(self.tables):
            for b in reversed(table[keep_blocks:]):
                self.pool.unref(gi, b)
            del table[keep_blocks:]
        del self.names[n // BLOCK :]
        if self.name_limit is not None and n <= self.name_limit * BLOCK:
            self.name_limit = None  # everything shifted was rolled back
        self.length = n
        self.pending = 0

    def shift(self, n_keep: int, n_discard: int, rotate) -> None:
        """llama.cpp's context shift: drop tokens [n_keep, n_keep + n_discard) and move the later ones down by
        n_discard positions. Keys are cached after RoPE, so `rotate(layer, keys, delta)` (keys: (T, n_kv_heads,
        head_dim), C-contiguous, rotated in place) re-positions them; values move as they are."""
        if any(g.window for g in self.pool.groups):
            raise ValueError("a context shift needs every layer's full history (sliding-window layers dropped it)")
        if not (0 <= n_keep and n_discard > 0 and n_keep + n_discard <= self.length and self.pending == 0):
            raise ValueError(f"cannot shift a {self.length}-token cache by {n_discard} after {n_keep}")
        new_len = self.length - n_discard
        for gi, g in enumerate(self.pool.groups):
            for j in range(n_keep // BLOCK, -(-new_len // BLOCK)):
                self._own(gi, j)  # contents change: copy shared blocks, un-name our own
            src = self.column_array(gi, n_keep + n_discard, self.length)
            dst = self.column_array(gi, n_keep, new_len)
            storage = self.pool.storage
            for slot, layer in enumerate(g.layers):
                keys = np.ascontiguousarray(
                    self._read(g.k[slot], g.k_scale[slot], gi, n_keep + n_discard, self.length).transpose(1, 0, 2))
                rotate(layer, keys, -n_discard)
                storage.write_rows(g.k[slot], g.k_scale[slot], dst, keys)
                for store in (g.v[slot], g.v_scale[slot]):  # values move as stored
                    storage.move_columns(store, src, dst)
        del self.names[n_keep // BLOCK :]
        self.name_limit = n_keep // BLOCK if self.name_limit is None else min(self.name_limit, n_keep // BLOCK)
        self.truncate(new_len)

    def fork(self) -> "KVCache":
        """Another holder of the same blocks (no copy: each block's refcount + 1, copy-on-write protects both):
        this cache's contents kept readable, e.g. as the source of `splice` while this one is rewritten."""
        if self.pending:
            raise ValueError("cannot fork a cache during a forward")
        twin = KVCache(self.pool, self.max_tokens)
        for gi, table in enumerate(self.tables):
            for b in table:
                if b is not None:
                    self.pool.ref(gi, b)
            twin.tables[gi] = list(table)
        twin.first, twin.length = list(self.first), self.length
        twin.names, twin.name_limit = list(self.names), self.name_limit
        return twin

    def held_from(self) -> int:
        """The first position whose keys every layer still holds (> 0 once a sliding group dropped blocks)."""
        return max(f * BLOCK for f in self.first) if self.first else 0

    def splice(self, donor: "KVCache", src: int, n: int, rotate) -> None:
        """Append n tokens whose keys and values are taken from `donor`'s positions [src, src + n) instead of
        computed: llama.cpp's `--cache-reuse` chunk (its llama_memory_seq_add). Keys are cached after RoPE, so
        `rotate(layer, keys, delta)` moves them by delta = (new position - old position); values are copied as
        stored. The result is not what a forward would give (those tokens attended to the donor's earlier
        tokens, not to this cache's), so from the block holding the first spliced token on nothing is named
        for exact prefix reuse."""
        if donor.pool is not self.pool or self.pending:
            raise ValueError("a splice needs a donor of the same pool, between forwards")
        if n <= 0 or src < donor.held_from() or src + n > donor.length:
            raise ValueError(f"the donor does not hold positions {src}..{src + n}")
        dst = self.length
        self.reserve(n)
        delta = dst - src
        storage = self.pool.storage
        for gi, g in enumerate(self.pool.groups):
            src_cols = donor.column_array(gi, src, src + n)
            dst_cols = self.write_cols[gi]
            for slot, layer in enumerate(g.layers):
                if delta:
                    keys = np.ascontiguousarray(storage.read_rows(g.k[slot], g.k_scale[slot], src_cols)
                                                .transpose(1, 0, 2))
                    rotate(layer, keys, delta)
                    storage.write_rows(g.k[slot], g.k_scale[slot], dst_cols, keys)
                else:
                    for store in (g.k[slot], g.k_scale[slot]):
                        storage.move_columns(store, src_cols, dst_cols)
                for store in (g.v[slot], g.v_scale[slot]):
                    storage.move_columns(store, src_cols, dst_cols)
        limit = dst // BLOCK
        self.name_limit = limit if self.name_limit is None else min(self.name_limit, limit)
        self.commit()

    # ---- prefix sharing -------------------------------------------------------------------------------

    def can_truncate(self, n: int) -> bool:
        """Whether a rollback to n tokens still has every key the next query would see."""
        return n == 0 or all(self.first[gi] * BLOCK <= max(0, n - g.window + 1)
                             for gi, g in enumerate(self.pool.groups) if g.window)

    def remember(self, tokens) -> None:
        """Name the full blocks of `tokens` (what this cache holds, in order), so other sequences can reuse them."""
        n_full = min(len(tokens), self.length) // BLOCK
        if self.name_limit is not None:
            n_full = min(n_full, self.name_limit)
        parent = self.names[-1] if self.names else b""
        for j, name in enumerate(block_hashes(tokens[len(self.names) * BLOCK :], n_full - len(self.names), parent),
                                 start=len(self.names)):
            self.names.append(name)
            for gi, table in enumerate(self.tables):
                if table[j] is not None:
                    self.pool.name(gi, table[j], name, parent, tokens[j * BLOCK : (j + 1) * BLOCK])
            parent = name

    def remember_tail(self, tokens) -> None:
        """Name the full blocks and the last, partly filled one of a finished sequence (its first tokens kept
        with it), so a request that goes on from it (a conversation's next turn, a restored slot) copies those
        positions instead of computing them (attach_prefix's partial match). Only for a sequence that is not
        written again: the tail's name stands for what the block holds now."""
        self.remember(tokens)
        n, j = min(len(tokens), self.length), len(self.names)
        if not j * BLOCK < n < (j + 1) * BLOCK:
            return  # no partial tail, or names stop before it (after a context shift)
        tail = np.asarray(tokens[j * BLOCK : n], np.int64)
        parent = self.names[-1] if self.names else b""
        name = hashlib.blake2b(parent + b"tail" + tail.tobytes(), digest_size=16).digest()
        for gi, table in enumerate(self.tables):
            if j < len(table) and table[j] is not None:
                self.pool.name(gi, table[j], name, parent, tail)

    def cached_prefix(self, tokens) -> tuple[int, list[bytes]]:
        """How many leading full blocks of `tokens` the pool holds for every layer (sliding groups only need
        the blocks the next query sees), and their names."""
        names = block_hashes(tokens, len(tokens) // BLOCK)
        groups = self.pool.groups
        m = 0
        while m < len(names) and all(names[m] in g.index for g in groups if not g.window):
            m += 1
        while m > 0 and not all(names[j] in g.index for g in groups if g.window
                                for j in range(max(0, m * BLOCK - g.window + 1) // BLOCK, m)):
            m -= 1
        return m, names[:m]

    def cached_length(self, tokens) -> int:
        """How many leading tokens of `tokens` attach_prefix would take from the pool."""
        m, names = self.cached_prefix(tokens)
        return m * BLOCK + self.pool.partial_match(names[-1] if names else b"", tokens[m * BLOCK :])[0]

    def attach_prefix(self, tokens) -> int:
        """On an empty cache: take the pool's cached blocks for the start of `tokens` instead of computing
        them: the full blocks shared, then the first positions of a block that goes on differently, copied.
        Returns how many tokens are now cached."""
        assert self.length == 0
        m, names = self.cached_prefix(tokens)
        k, child = self.pool.partial_match(names[-1] if names else b"", tokens[m * BLOCK :])
        for gi, g in enumerate(self.pool.groups):
            self.first[gi] = max(0, m * BLOCK + k - g.window + 1) // BLOCK if g.window else 0
            self.first[gi] = min(self.first[gi], m)
            self.tables[gi] = [None] * self.first[gi]
            for name in names[self.first[gi] :]:
                b = g.index[name]
                self.pool.ref(gi, b)
                self.tables[gi].append(b)
            if k:
                src = g.index[child]
                new = self.pool.allocate(gi, self.tables[gi][-1] + 1 if m > self.first[gi] else None)
                for store in g.stores:
                    for arr in store:
                        self.pool.storage.copy_columns(arr, src * BLOCK, new * BLOCK, BLOCK)
                self.tables[gi].append(new)
        self.names = names
        self.length = m * BLOCK + k
        return self.length

    def restore(self, length: int, kv: dict[int, tuple[np.ndarray, np.ndarray]]) -> None:
        """On an empty cache: take `length` tokens' keys and values from outside (a saved session). kv[layer] is
        (keys, values) as keys(layer) / values(layer) return them, i.e. positions [start, length): a sliding
        group may start late (at a block boundary), since it held only its window."""
        assert self.length == 0
        if length > self.max_tokens:
            raise ValueError(f"{length} tokens do not fit a {self.max_tokens}-token cache")
        # Check everything before taking any block, so a bad input leaves the cache empty.
        starts = []
        for g in self.pool.groups:
            start = length - kv[g.layers[0]][0].shape[1]
            needed = max(0, length - g.window + 1) if g.window else 0  # first key the next query sees
            if start % BLOCK or not 0 <= start <= needed or any(
                    length - kv[layer][0].shape[1] != start or length - kv[layer][1].shape[1] != start
                    for layer in g.layers):
                raise ValueError(f"layers {g.layers[0]}..{g.layers[-1]} do not hold the keys the next token needs")
            starts.append(start)
        for gi, (g, start) in enumerate(zip(self.pool.groups, starts)):
            self.first[gi] = start // BLOCK
            table = self.tables[gi] = [None] * self.first[gi]
            while len(table) * BLOCK < length:
                last = table[-1] if table and table[-1] is not None else None
                table.append(self.pool.allocate(gi, None if last is None else last + 1))
            cols = self.column_array(gi, start, length)
            for slot, layer in enumerate(g.layers):
                keys, values = kv[layer]
                self.pool.storage.write_rows(g.k[slot], g.k_scale[slot], cols,
                                             np.ascontiguousarray(keys.transpose(1, 0, 2), dtype=np.float32))
                self.pool.storage.write_rows(g.v[slot], g.v_scale[slot], cols,
                                             np.ascontiguousarray(values.transpose(1, 0, 2), dtype=np.float32))
        self.length = length

    def release(self) -> None:
        """Give every block back to the pool (named ones stay cached for reuse). Last blocks first, so they are
        evicted first: a prefix's head is worth more, since every longer prefix needs it."""
        for gi, table in enumerate(self.tables):
            for b in reversed(table):
                if b is not None:
                    self.pool.unref(gi, b)
            table.clear()
        self.first = [0] * len(self.tables)
        self.names.clear()
        self.name_limit = None
        self.length = self.pending = 0

    def __del__(self):
        try:
            self.release()
        except Exception:  # interpreter shutdown: the pool may already be gone
            pass

    # ---- accounting and layout ------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks this sequence holds (shared blocks count for each holder)."""
        return sum(sum(b is not None for b in t) * g.block_bytes for t, g in zip(self.tables, self.pool.groups))

    @property
    def contiguous(self) -> bool:
        """Whether every group's live blocks form one run of storage (then attention reads a view, no copy)."""
        return all(self._run(gi, self.first[gi], len(t)) for gi, t in enumerate(self.tables) if len(t) > self.first[gi])

    def _run(self, gi: int, first: int, end: int) -> bool:
        blocks = self.tables[gi][first:end]
        return all(b == blocks[0] + i for i, b in enumerate(blocks))

    def _own(self, gi: int, j: int) -> None:
        """Copy-on-write: make block j exclusively ours and unnamed before its contents change."""
        g, b = self.pool.groups[gi], self.tables[gi][j]
        if g.refs[b] > 1:
            new = self.pool.allocate(gi)
            for store in g.stores:
                for arr in store:
                    self.pool.storage.copy_columns(arr, b * BLOCK, new * BLOCK, BLOCK)
            self.pool.unref(gi, b)
            self.tables[gi][j] = new
        else:
            g.forget(b)

    def column_array(self, gi: int, start: int, end: int) -> np.ndarray:
        """int64 storage columns of positions [start, end) in group gi."""
        cols = self._columns(gi, start, end)
        return np.arange(cols.start, cols.stop, dtype=np.int64) if isinstance(cols, slice) else cols

    def _columns(self, gi: int, start: int, end: int):
        """Storage columns of positions [start, end): a slice when their blocks are consecutive, else indices."""
        first, last = start // BLOCK, (end - 1) // BLOCK
        blocks = self.tables[gi][first : last + 1]
        offset = start - first * BLOCK
        if end <= start:
            return slice(0, 0)
        if self._run(gi, first, last + 1):
            s = blocks[0] * BLOCK + offset
            return slice(s, s + end - start)
        cols = (np.asarray(blocks)[:, None] * BLOCK + np.arange(BLOCK)).ravel()
        return cols[offset : offset + end - start]
