"""The fused forward (one compiled call per forward of one sequence, kernels/cpu/fused_forward.py)
computes bitwise what the per-kernel path computes, on every real model, in both KV layouts and types, past a
sliding window; and its thread protocol (kernels/cpu/team.py) finishes whatever threads the runtime gives it."""

from __future__ import annotations

from functools import cache

import numba
import numpy as np
import pytest
from numba import njit, prange

from conftest import CATALOG_MODELS, english_tokens, model_file
from localllm.kernels import ops
from localllm.kernels.cpu.team import next_task, task_bounds, task_done, wait_phase
from localllm.runtime.engine import Engine

STEPS = (1, 3, 1, 8, 16, 37, 2)  # decode steps, verify-sized ones, a chunk of several 16-row passes


@cache
def engine(name: str, kv_type: str = "f32") -> Engine:
    return Engine(model_file(name), ctx=2048, kv_type=kv_type)


def run(e: Engine, fused: bool, prompt: list[int], steps: list[list[int]], interleave: bool) -> list[np.ndarray]:
    """Logits of every position of every step after `prompt`; `interleave`: a second sequence grows in turn,
    so both block tables fragment (the paged layout)."""
    e.model.fused.available = fused
    try:
        e.kv_pool = e.model.new_pool(kv_type=e.kv_type)
        e.kv_pool.budget_bytes = e.ctx * e.kv_pool.bytes_per_token
        seq, other = e.new_sequence(), e.new_sequence()
        outs = [e.evaluate(seq, prompt)]
        if interleave:
            e.evaluate(other, prompt[::-1])
        for tokens in steps:
            outs.append(e.evaluate(seq, tokens, logit_positions=range(len(tokens))))
            if interleave:
                e.evaluate(other, tokens[:1])
        assert seq.cache.contiguous == (not interleave)
        seq.close()
        other.close()
        return outs
    finally:
        e.model.fused.available = True


def steps_for(e: Engine, seed: int) -> list[list[int]]:
    words = english_tokens(e.tokenizer, sum(STEPS), seed)
    cuts = np.cumsum((0,) + STEPS)
    return [words[a:b] for a, b in zip(cuts, cuts[1:])]


def assert_bitwise(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert np.array_equal(g.view(np.uint32), w.view(np.uint32))


@pytest.mark.parametrize("name", CATALOG_MODELS)
def test_fused_steps_equal_the_per_kernel_path_bitwise(name):
    e = engine(name)
    assert e.model.fused.available  # every catalog model has integer kernels for all its weights
    prompt = english_tokens(e.tokenizer, 40, seed=1)
    steps = steps_for(e, seed=2)
    for interleave in (False, True):
        assert_bitwise(run(e, True, prompt, steps, interleave), run(e, False, prompt, steps, interleave))


def test_the_fused_forward_reads_each_layers_weights_by_role_and_declares_the_traits_it_implements(monkeypatch):
    """The fused forward takes the model plan's weights by the names its kernel reads them in (no list of
    positions to keep in step), and an architecture trait it does not declare leaves the model to the op-by-op
    forward, which computes the same tokens."""
    import dataclasses

    from localllm.architectures.transformer import LayerWeights
    from localllm.kernels.cpu import fused_forward

    fields = {f.name for f in dataclasses.fields(LayerWeights)}
    assert set(ops.FusedForward.MATRIX_ROLES + ops.FusedForward.VECTOR_ROLES) <= fields
    assert len(ops.FusedForward.MATRIX_ROLES) == fused_forward.MATS_PER_LAYER
    assert len(ops.FusedForward.VECTOR_ROLES) == fused_forward.VECS_PER_LAYER
    e = engine("smollm2-135m-instruct")
    plan = e.model.plan
    assert plan.layers[0] is e.model.layers[0] and len(plan.layer_rope) == len(plan.layer_window) == len(plan.layers)
    assert ops.FusedForward.unsupported(e.config.traits) is None and e.model.fused.available
    traits = e.config.traits
    assert "rope_style" in ops.FusedForward.unsupported(dataclasses.replace(traits, rope_style="glm"))
    implements = dict(ops.FusedForward.IMPLEMENTS)
    del implements["qk_norm"]  # as if the trait were new: the fused forward has not declared it
    monkeypatch.setattr(ops.FusedForward, "IMPLEMENTS", implements)
    assert "qk_norm" in ops.FusedForward.unsupported(traits)
    fresh = Engine(model_file("smollm2-135m-instruct"), ctx=256)
    assert not fresh.model.fused_available
    prompt = english_tokens(fresh.tokenizer, 24, seed=7)
    want = run(e, False, prompt, steps_for(e, seed=8)[:3], False)
    seq = fresh.new_sequence()
    got = [fresh.evaluate(seq, prompt)] + [fresh.evaluate(seq, t, logit_positions=range(len(t)))
                                            for t in steps_for(e, seed=8)[:3]]
    assert_bitwise(got, want)


def test_fused_steps_past_gemma3_sliding_window():
    """gemma3's sliding layers have dropped their first blocks (their table starts later than the global
    layers')."""
    e = engine("gemma3-270m")
    window = e.config.sliding_window
    prompt = english_tokens(e.tokenizer, window + 40, seed=3)
    steps = steps_for(e, seed=4)
    assert_bitwise(run(e, True, prompt, steps, False), run(e, False, prompt, steps, False))


def test_fused_steps_with_a_q8_0_cache():
    e = engine("smollm2-135m-instruct", "q8_0")
    prompt = english_tokens(e.tokenizer, 40, seed=5)
    steps = steps_for(e, seed=6)
    assert_bitwise(run(e, True, prompt, steps, True), run(e, False, prompt, steps, True))


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b-instruct", "gemma3-270m"])
def test_a_cold_starts_per_head_attention_gives_the_row_blocks_bits(name):
    """A cold start with a float32 cache attends per (row, head) until attention's row-block kernel has compiled
    in the background (fused_forward.compiled), then switches: an answer must not depend on which it ran with.
    Both models have several query heads per KV head (the row blocks' case); gemma3 past its sliding window."""
    from localllm.kernels.cpu import attention
    from localllm.kernels.cpu.by_address import Compiled

    e = engine(name)
    prompt = english_tokens(e.tokenizer, 40 + (e.config.sliding_window or 0), seed=1)
    steps = steps_for(e, seed=2)
    run(e, True, prompt[:4], [], False)  # the forward's kernels exist
    kernels = list(e.model.fused.kernel._compiled.values())
    before = [k.attend for k in kernels]
    outs = {}
    try:
        for kind in (attention._attend_items, attention._attend_items_per_head):
            for k, a in zip(kernels, before):
                k.attend = Compiled(kind, a.numba_type.sig.args)
            outs[kind] = run(e, True, prompt, steps, True)
    finally:
        for k, a in zip(kernels, before):
            k.attend = a
    assert_bitwise(outs[attention._attend_items_per_head], outs[attention._attend_items])


def test_the_row_block_attention_compiled_in_the_background_takes_over():
    from localllm.kernels.cpu import attention, fused_forward
    from localllm.kernels.cpu.by_address import Compiled

    e = engine("smollm2-135m-instruct")
    run(e, True, english_tokens(e.tokenizer, 4, seed=1), [], False)
    k = next(iter(e.model.fused.kernel._compiled.values()))
    sig = k.attend.numba_type.sig.args
    kernels = fused_forward.Kernels(k.worker, k.products, Compiled(attention._attend_items_per_head, sig))
    fused_forward._upgrade_attention(kernels, sig)
    thread = kernels.upgrade
    if thread is not None:
        thread.join(timeout=600)
    assert kernels.upgrade is None
    assert kernels.attend.address == Compiled(attention._attend_items, sig).address


@pytest.mark.parametrize("name", CATALOG_MODELS)
def test_the_products_a_cold_start_compiles_before_reading_the_weights_are_the_ones_the_model_calls(name):
    """fused_forward.start_compiling compiles the products for formats read from the file's tensors and for the
    lists' types FusedForward builds, in a child, before the weights are loaded: both must be the loaded model's,
    or the child's work is not what the forward calls."""
    from numba import typeof

    from localllm.backends.cpu_backend import CpuBackend
    from localllm.gguf_file import GGUFFile
    from localllm.kernels.cpu import fused_forward

    fused = engine(name).model.fused.kernel
    with GGUFFile(model_file(name)) as g:
        assert ops.FusedForward.predicted_formats(g, CpuBackend.tiles).mask == fused.formats.mask
    assert (typeof(fused.mats), typeof(fused.vecs)) == (fused_forward._MATS, fused_forward._VECS)
    assert typeof(fused.mat_types) == typeof(fused.mat_families) == fused_forward._INDICES


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma3-270m"])
def test_the_attention_a_cold_start_compiles_before_reading_the_weights_is_the_one_a_float32_cache_calls(name):
    """fused_forward.start_compiling compiles the per-head attention for the argument types a float32 cache gives
    the worker's attention call, before the model's shapes are known: they must be the loaded model's (with and
    without gemma3's sliding window), or the child's work is not what the forward calls."""
    from localllm.kernels.cpu import fused_forward

    e = engine(name)
    run(e, True, english_tokens(e.tokenizer, 4, seed=1), [], False)
    kernels = list(e.model.fused.kernel._compiled.values())
    assert kernels and all(k.attend.numba_type.sig.args == fused_forward._F32_ATTENTION_TYPES for k in kernels)


def batched_steps(e: Engine, fused: bool, prompts: list[list[int]], rounds: list[list[list[int]]]):
    """Logits of every row of every sequence, stepped together: the prompts in one batched step, then each
    round's tokens (one list per sequence; an empty list sits the round out) in one step."""
    e.model.fused.available = fused
    try:
        e.kv_pool = e.model.new_pool(kv_type=e.kv_type)
        e.kv_pool.budget_bytes = e.ctx * e.kv_pool.bytes_per_token
        seqs = [e.new_sequence() for _ in prompts]
        outs = [[] for _ in prompts]
        for step in [prompts] + rounds:
            todo = [(i, t) for i, t in enumerate(step) if t]
            if not todo:
                continue
            got = e.model.forward_batch([(t, seqs[i].cache, list(range(len(t)))) for i, t in todo])
            for (i, t), logits in zip(todo, got):
                seqs[i].tokens.extend(t)
                outs[i].append(logits)
        for s in seqs:
            s.close()
        return outs
    finally:
        e.model.fused.available = True


@pytest.mark.parametrize("kv_type", ["f32", "q8_0"])
def test_fused_step_over_several_sequences_equals_each_sequence_alone_bitwise(kv_type):
    """The server's step: several sequences' new tokens in one compiled call (decode rows beside a verify and a
    prompt chunk), each sequence's logits bitwise those it gets stepped alone, and those of the op-by-op batch."""
    e = engine("smollm2-135m-instruct", kv_type)
    words = english_tokens(e.tokenizer, 400, seed=7)
    prompts = [words[:40], words[40:57], words[57:130]]
    rounds = [[words[130:131], words[131:132], words[132:133]],
              [words[133:137], [], words[137:138]],           # a 4-token verify beside a decode; one sits out
              [words[138:139], words[139:175], words[175:176]],  # a prompt chunk beside decodes
              [words[176:177], words[177:178], words[178:195]]]
    calls = []
    batch = e.model.fused.batch
    e.model.fused.batch = lambda segments: calls.append(len(segments)) or batch(segments)
    try:
        together = batched_steps(e, True, prompts, rounds)
    finally:
        del e.model.fused.batch
    assert calls == [3, 3, 2, 3, 3]  # every step with several sequences was one compiled call
    assert_bitwise([x for seq in together for x in seq],
                   [x for seq in batched_steps(e, False, prompts, rounds) for x in seq])
    for i in range(len(prompts)):
        alone = batched_steps(e, True, [prompts[i]], [[r[i]] for r in rounds])[0]
        assert_bitwise(together[i], alone)


def test_fused_step_with_two_workers_on_one_thread():
    """Two workers that the runtime runs one after the other on a single thread (fewer threads than asked):
    the first does every task, the second finds none left; no deadlock, same logits."""
    e = engine("smollm2-135m-instruct")
    prompt = english_tokens(e.tokenizer, 20, seed=7)
    steps = steps_for(e, seed=8)
    want = run(e, True, prompt, steps, False)
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    saved = ops._threads[0]
    ops._threads[0] = 2  # the fused forward still splits its work for two workers
    try:
        got = run(e, True, prompt, steps, False)
    finally:
        numba.set_num_threads(threads)
        ops._threads[0] = saved
    assert_bitwise(got, want)


@njit
def _phased_sums(ctl, out, tasks):
    """Phase p adds 1 to each element of row p-1 into row p, in `tasks` ranges: row p must hold p + 1 everywhere
    only if every phase saw the whole previous row (the phase boundaries hold)."""
    for p in range(out.shape[0]):
        while True:
            t = next_task(ctl, p, tasks)
            if t < 0:
                break
            lo, hi = task_bounds(t, tasks, out.shape[1], 8)
            for j in range(lo, hi):
                # read a neighbour from another task's range of the previous row
                prev = out[p - 1, (j + out.shape[1] // 2) % out.shape[1]] if p > 0 else 0
                out[p, j] = prev + 1
            task_done(ctl, p)
        wait_phase(ctl, p, tasks)


@njit(parallel=True)
def _run_phased(out, tasks, workers):
    ctl = np.zeros(2 * out.shape[0], np.int64)
    for _ in prange(workers):
        _phased_sums(ctl, out, tasks)


@pytest.mark.parametrize("workers,tasks", [(2, 4), (2, 1), (2, 7), (1, 3)])
def test_phases_see_every_task_of_the_previous_phase(workers, tasks):
    out = np.zeros((200, 1000), np.int64)
    for _ in range(5):
        _run_phased(out, tasks, workers)
        assert (out == np.arange(1, 201)[:, None]).all()


def test_task_bounds_cover_the_range_once_at_aligned_cuts():
    for total, tasks, align in [(576, 4, 1), (1536, 4, 32), (100, 7, 8), (5, 8, 1)]:
        cuts = [task_bounds(t, tasks, total, align) for t in range(tasks)]
        assert cuts[0][0] == 0 and cuts[-1][1] == total
        assert all(a[1] == b[0] for a, b in zip(cuts, cuts[1:]))
        assert all(lo % align == 0 for lo, hi in cuts if lo < total)


def test_typed_lists_from_cached_code_equal_numbas_own_and_count_the_same():
    from localllm.kernels.cpu.typed_lists import length, typed_list

    rng = np.random.default_rng(0)
    mats = [rng.integers(0, 255, (r, 34), np.uint8) for r in (3, 1, 7)]
    for m in mats:
        m.flags.writeable = False  # as a model's weights are
    vecs = [rng.standard_normal(n).astype(np.float32) for n in (5, 0, 2)]
    for items in (mats, vecs):
        ours, theirs = typed_list(items), numba.typed.List(items)
        assert numba.typeof(ours) == numba.typeof(theirs)
        assert length(ours) == len(theirs) == len(items)
        for a, b, want in zip(ours, theirs, items):
            assert a.dtype == b.dtype and np.array_equal(a, want) and np.array_equal(b, want)
    with pytest.raises(ValueError, match="at least one"):
        typed_list([])


def test_the_products_compiled_for_a_format_set_hold_only_its_formats_kernels():
    # A model's fused forward is compiled for its formats (kernels/cpu/format_set.py): the other formats' row
    # kernels and activation quantizers are pruned before typing, so they cost no compile time.
    from gguf import GGMLQuantizationType as Q

    from localllm.kernels.cpu.format_set import FormatSet
    from localllm.kernels.cpu.quant_dot import quantize_activations, rows_avx2

    @njit
    def product(formats, raw, qtype, x, out):
        rows_avx2(formats, raw, qtype, quantize_activations(formats, x, 1 | 2 | 4), out, 0, raw.shape[0])

    from gguf.quants import quantize

    w = ops.Weight(quantize(np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32), Q.Q8_0), Q.Q8_0)
    x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    out = np.zeros((3, 8), np.float32)
    product(FormatSet({Q.Q8_0}), w.raw, int(Q.Q8_0), x, out)
    np.testing.assert_array_equal(out, ops.matmul(w, x))  # the quant_dot driver's bits
    ir = product.inspect_llvm(product.signatures[0])
    assert "_rows_32_avx2" in ir and "quantize_q8_0" in ir
    for absent in ("_rows_q4_k_avx2", "_rows_q6_k_avx2", "_rows_q2_k_avx2", "quantize_q8_K", "quantize_q8_1"):
        assert absent not in ir
    # a format outside the set is not dispatched: out keeps what it had
    out[:] = 7
    product(FormatSet({Q.Q8_0}), w.raw, int(Q.Q4_K), x, out)
    assert (out == 7).all()


def test_a_kernel_compiled_in_a_child_process_is_loaded_from_the_cache_not_compiled_again(tmp_path):
    # A cold start compiles the products in a second process while this one compiles the worker
    # (fused_forward.compiled); what the child compiled must come from the kernel cache.
    import os
    import subprocess
    import sys

    script = """
import numba
from numba import types
from localllm.kernels.cpu import fused_forward as m
argtypes = (types.Array(types.int64, 1, "C"), types.int64)
assert not m._load_cached(m._one_task, argtypes)   # an empty cache
child = m._compile_in_child("_one_task", argtypes)
assert child.wait(timeout=120) == 0
assert m._load_cached(m._one_task, argtypes)
print(sum(m._one_task.stats.cache_misses.values()), m._one_task(__import__("numpy").zeros(4, "int64"), 0))
"""
    env = dict(os.environ, LOCALLLM_CACHE=str(tmp_path))
    env.pop("NUMBA_CACHE_DIR", None)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "True"]  # nothing compiled here, and it runs


def test_a_cached_kernel_loads_without_parsing_its_bitcode_and_still_links_into_new_code(tmp_path):
    # kernels/cpu/__init__.py: a kernel of ours loaded from the cache takes the names it defines from its ELF
    # object's symbol table, the same names Numba reads from its bitcode, which is parsed only when new code
    # links to the kernel.
    import os
    import subprocess
    import sys

    script = """
import pickle, numba, numpy as np
import llvmlite.binding as ll
from pathlib import Path
from numba import types
from localllm.kernels import cpu
from localllm.kernels.cpu import fused_forward as m
argtypes = (types.Array(types.int64, 1, "C"), types.int64)
assert m._compile_in_child("_one_task", argtypes).wait(timeout=120) == 0
files = list(Path(cpu.kernel_cache_dir()).rglob("fused_forward._one_task-*.nbc"))
assert files
for nbc in files:
    name, kind, (obj, bitcode) = pickle.loads(nbc.read_bytes())[0]
    mod = ll.parse_bitcode(bitcode)
    defined = {g.name for gs in (mod.functions, mod.global_variables) for g in gs if not g.is_declaration}
    assert kind == "object" and len(defined) > 1 and cpu.elf_defined_symbols(obj) == defined
assert m._load_cached(m._one_task, argtypes)
lib = m._one_task.overloads[argtypes].library
assert type(lib) is cpu._LazyLinkingLibrary and "_shared_bitcode" in vars(lib)
@numba.njit
def caller(a, i):
    return m._one_task(a, i)
print(caller(np.zeros(4, np.int64), 0), m._one_task(np.zeros(4, np.int64), 0), "_shared_bitcode" in vars(lib))
"""
    env = dict(os.environ, LOCALLLM_CACHE=str(tmp_path))
    env.pop("NUMBA_CACHE_DIR", None)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "False"]  # runs when linked into new code, which parsed it


def test_a_warm_start_loads_the_forward_without_importing_numbas_array_modules_and_computes_the_same(tmp_path):
    # kernels/cpu/__init__.py: environments of Numba's array code inlined into our kernels are rebuilt without
    # importing numba.np.arrayobj, npyimpl and arraymath (35 ms of a warm start); the forward is bitwise the same
    import os
    import subprocess
    import sys

    name = "smollm2-135m-instruct"
    prompt = english_tokens(engine(name).tokenizer, 24, seed=5)
    script = f"""
import sys, numpy as np
from localllm.runtime.engine import Engine
e = Engine({str(model_file(name))!r}, ctx=256, quiet=True)
logits = e.evaluate(e.new_sequence(), {prompt!r})
np.save(sys.argv[1], logits)
print(sorted(m for m in ("numba.np.arrayobj", "numba.np.npyimpl", "numba.np.arraymath") if m in sys.modules))
"""
    env = dict(os.environ)
    env.pop("NUMBA_CACHE_DIR", None)
    runs = [subprocess.run([sys.executable, "-c", script, str(tmp_path / f"{i}.npy")], env=env, capture_output=True,
                           text=True, timeout=600) for i in range(2)]  # the first may compile (a cold cache)
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr
    assert runs[1].stdout.strip() == "[]"
    want = engine(name).evaluate(engine(name).new_sequence(), prompt)
    for i in range(2):
        assert np.array_equal(np.load(tmp_path / f"{i}.npy"), want)


def test_a_function_called_by_address_gets_its_arguments_and_other_types_are_refused_at_compile_time():
    # kernels/cpu/by_address.py: the fused forward's worker and products are called this way
    from numba import types
    from numba.core.errors import TypingError

    from localllm.kernels.cpu.by_address import Compiled, call

    @njit
    def store(a, i, value):
        a[i] = value

    target = Compiled(store, (types.Array(types.float64, 1, "C"), types.int64, types.float64))

    @njit
    def caller(target, a):
        for i in range(a.shape[0]):
            call(target, (a, i, 2.5 * i))

    a = np.zeros(4)
    caller(target, a)
    np.testing.assert_array_equal(a, [0, 2.5, 5, 7.5])

    @njit
    def wrong(target, a):
        call(target, (a, 1.5, 2.0))  # a float index

    with pytest.raises(TypingError, match="do not match"):
        wrong(target, a)
