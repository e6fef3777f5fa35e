"""Threads that cooperate inside one parallel region: tasks claimed from shared counters, phases in order.

Why: a decode step of a small model is ~10 matrix products per layer, each only tens of microseconds of work.
Entering a Numba parallel region per product wakes the OpenMP workers every time: with workers that sleep at
once (the only policy that is safe when another process wants a core) that costs more than the products
themselves; with workers that spin between regions, a busy machine loses its second core to the spinning. So the
fused forward (kernels/cpu/fused_forward.py) enters one region per step, and inside it the threads go through
the step's phases together, waiting for each other only at phase boundaries, with a short spin there.

The protocol cannot deadlock, whatever the threads actually do: a phase has a fixed number of tasks, a thread
takes the next unclaimed one (`atomic_add` on the phase's claim counter) until none is left, and then waits
until every task of the phase is *done*. A thread never waits for another thread to arrive, only for claimed
work to finish, so a region whose workers run one after the other on a single OS thread (a runtime that gave
us fewer threads than asked) still completes: the first worker claims and does everything, the later ones find
nothing left. Tasks write disjoint outputs, so results do not depend on who ran what (batch invariance).

Counters live in an int64 array `ctl` of 2 slots per phase (claimed, done), zeroed before the region starts.
"""

from __future__ import annotations

import os
import platform

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from localllm.kernels.cpu import forget_stale_cache, simd
from localllm.kernels.cpu.simd import address_of

_I64 = ir.IntType(64)
_MACHINE = platform.machine().lower()
# The spin-wait hint (x86 `pause`: lets the sibling hyperthread run and saves power while we poll), as an LLVM
# intrinsic: Numba's JIT has no assembler for inline asm.
_X86 = _MACHINE in ("x86_64", "amd64", "i686", "x86")
# Polls before a waiting thread gives its core away (sched_yield) on each further poll: ~20 us of spinning,
# longer than any phase's imbalance on a quiet machine, short enough that a thread whose partner lost its core
# to another process hands the core over instead of burning its time slice.
SPIN_POLLS = 4096


@intrinsic
def atomic_add(typingctx, address, value):
    """*address += value (int64, sequentially consistent); returns the value before."""
    if not isinstance(address, types.Integer) or not isinstance(value, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        ptr = builder.inttoptr(args[0], _I64.as_pointer())
        return builder.atomic_rmw("add", ptr, context.cast(builder, args[1], signature.args[1], types.int64),
                                  "seq_cst")

    return types.int64(address, value), codegen


@intrinsic
def atomic_load(typingctx, address):
    """*address (int64), loaded with acquire ordering: writes made before the matching `atomic_add` are seen."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        ptr = builder.inttoptr(args[0], _I64.as_pointer())
        return builder.load_atomic(ptr, "acquire", 8)

    return types.int64(address), codegen


@intrinsic
def cpu_relax(typingctx):
    """The CPU's spin-wait hint (x86 `pause`), or nothing elsewhere."""

    def codegen(context, builder, signature, args):
        if _X86:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()

    return types.none(), codegen


if os.name == "posix":
    _sched_yield = types.ExternalFunction("sched_yield", types.int32())
else:  # pragma: no cover - no such call: spinning only
    _sched_yield = None


@njit(cache=True)
def _give_way():
    if _sched_yield is not None:
        _sched_yield()
    else:
        cpu_relax()


@njit(cache=True)
def next_task(ctl, phase, tasks):
    """The next unclaimed task of `phase` (0 .. tasks-1), or -1 when all are claimed."""
    t = atomic_add(address_of(ctl) + 16 * phase, 1)
    return t if t < tasks else -1


@njit(cache=True)
def any_left(ctl, phase, tasks):
    """Whether some task of `phase` is still unclaimed (lets a thread skip private set-up work)."""
    return atomic_load(address_of(ctl) + 16 * phase) < tasks


@njit(cache=True)
def task_done(ctl, phase):
    atomic_add(address_of(ctl) + 16 * phase + 8, 1)


@njit(cache=True)
def wait_phase(ctl, phase, tasks):
    """Return once all `tasks` tasks of `phase` are done (their writes visible to this thread)."""
    address = address_of(ctl) + 16 * phase + 8
    polls = 0
    while atomic_load(address) < tasks:
        polls += 1
        if polls < SPIN_POLLS:
            cpu_relax()
        else:
            _give_way()


@njit(cache=True)
def task_bounds(t, tasks, total, align):
    """Task t's share [lo, hi) of `total` items cut into `tasks` near-equal runs, cut points multiples of
    `align` (kept whole: blocks of a quantized row)."""
    units = (total + align - 1) // align
    lo = min(total, (units * t // tasks) * align)
    hi = min(total, (units * (t + 1) // tasks) * align)
    return lo, hi


forget_stale_cache(__file__, wait_phase._cache.cache_path, [simd.__file__])
