"""A Jinja environment for untrusted templates, bounded in time and memory.

Jinja's `ImmutableSandboxedEnvironment` keeps a template away from Python's internals, but not from the machine:
nested loops run for hours (and, run on a server's event loop, starve every other request and even SIGTERM),
and one `'x'|center(2500000000)`, a few `~` or `replace` doublings, a format width, `indent`, `tojson(indent=...)`
or a `**` chain builds gigabytes in a single C call that no deadline can interrupt. Jinja even evaluates constant
expressions while it compiles, so that `{{ 'x'|center(2500000000) }}` cost 7.4 GB and 65 s at model load.

`BoundedSandbox` renders under a `Budget` (one per render, set with `rendering(budget)`):

- time: a deadline, checked on entering every block (so at every loop iteration and macro call), at every
  output written, call, filter and operator, and at every item a filter's generator yields;
- size: no value may exceed `limit` characters, nor all the output together. What can multiply sizes is checked
  BEFORE its result is built: `*`, `**` (and integer `*`: big integers are capped at `MAX_INT_BITS`), `+`, `~`,
  `%` and `format` (widths and precisions), `str.format`, `center`/`ljust`/`rjust`/`zfill`, `replace`,
  `expandtabs`, `translate`, `join`, `indent`, `wordwrap`, `tojson`/`pprint` indentation, `batch`/`slice`
  fill-ins, `sum` of lists, `int.to_bytes`, `lipsum`; what grows by a bounded factor at most (escaping,
  `upper`, `repr`) is checked right after. Everything built in one render together may not exceed
  `BUILT_FACTOR` x `limit` characters (or container slots), which bounds memory and work both. `wordwrap` and
  `urlize`, whose pure-Python loops no deadline check reaches, take at most `SLOW_FILTER_CHARS`.
- structure: a list, tuple or dict the template builds may not "weigh" more than `limit`, the weight being the
  length of its repr with shared items counted each time they occur. Otherwise `[a,a,a,a]` nested ten times is
  a 10^10-item structure, cheap to build, that one `==` or `{{ }}` walks in C for hours.
- compilation: nothing is folded at compile time (`optimized=False`, and the output of constant expressions
  is computed at render time like any other); the caller caps the source size.

A template that exceeds its budget raises `TemplateTooSlow` or `TemplateTooLarge` (both `BudgetExceeded`, a
`jinja2.TemplateError`). Legitimate chat templates stay far inside these bounds and render exactly as with
stock Jinja.
"""

from __future__ import annotations

import inspect
import itertools
import re
import threading
import types
from collections.abc import Iterator, Mapping
from functools import update_wrapper
from time import monotonic
from typing import Any

from jinja2 import nodes
from jinja2.compiler import CodeGenerator, CompilerExit
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.filters import make_attrgetter
from jinja2.sandbox import (
    MAX_RANGE,
    ImmutableSandboxedEnvironment,
    SandboxedEscapeFormatter,
    SandboxedFormatter,
)
from jinja2.utils import Namespace, generate_lorem_ipsum, pass_environment
from markupsafe import Markup, escape

__all__ = ["BoundedSandbox", "Budget", "BudgetExceeded", "TemplateTooLarge", "TemplateTooSlow", "rendering"]

BUILT_FACTOR = 8
MAX_INT_BITS = 1 << 16  # about 20 000 decimal digits: templates count, they do not do number theory
MAX_DEPTH = 256  # nesting of the containers a template builds or is given
_FIELD_SLACK = 320  # characters a formatted number may take beyond its width and precision (1e308 with %f)
SLOW_FILTER_CHARS = 100_000  # the input of wordwrap and urlize (0.2-0.3 s of pure Python)
_OPAQUE_WEIGHT = 64  # the repr of a function, macro, loop, generator or undefined value is short
_DICT_KEYS, _DICT_VALUES, _DICT_ITEMS = type({}.keys()), type({}.values()), type({}.items())
_CONTAINERS = (list, tuple, dict, set, frozenset)


class BudgetExceeded(TemplateError):
    """A template ran out of its time or size budget."""


class TemplateTooSlow(BudgetExceeded):
    pass


class TemplateTooLarge(BudgetExceeded):
    pass


class Budget:
    """What one render may spend: `seconds` of wall time, values and output of at most `limit` characters."""

    def __init__(self, seconds: float, limit: int):
        self.seconds = seconds
        self.deadline = monotonic() + seconds
        self.set_limit(limit)
        self.written = 0
        self.built = 0
        self._visits = 0
        # id -> (container, weight) of the containers already measured. A template cannot change a list or dict
        # (the sandbox is immutable) so a weight stays true for the whole render; holding the container keeps its
        # id from being reused.
        self._weights: dict[int, tuple[Any, int]] = {}

    def set_limit(self, limit: int) -> None:
        self.limit = limit
        self.built_cap = BUILT_FACTOR * limit

    # ---- time and totals

    def tick(self) -> None:
        if monotonic() > self.deadline:
            raise TemplateTooSlow(f"rendering took longer than {self.seconds:g} s (a loop without end?)")

    def check(self, n: int) -> None:
        """A value of `n` characters (or items) is about to be built."""
        if n > self.limit:
            raise TemplateTooLarge(f"the template tried to build a value of {n:,} characters "
                                   f"(the limit is {self.limit:,})")

    def charge(self, n: int) -> None:
        """A value of `n` characters (or container slots) was built."""
        self.check(n)
        self.built += n
        if self.built > self.built_cap:
            raise TemplateTooLarge(f"the template built more than {self.built_cap:,} characters "
                                   "in all")
        self.tick()

    def write(self, s: str) -> str:
        self.written += len(s)
        if self.written > self.limit:
            raise TemplateTooLarge(f"the template wrote more than {self.limit:,} characters")
        self.built += len(s)
        self.tick()
        return s

    def check_int(self, bits: int) -> None:
        if bits > MAX_INT_BITS:
            raise TemplateTooLarge(f"the template tried to compute a number of about {bits:,} bits "
                                   f"(the limit is {MAX_INT_BITS:,})")

    # ---- weights

    def weight(self, x: Any) -> int:
        """About the length of `repr(x)`, a shared item counted each time it occurs; over `limit` raises.
        Costs O(1) for strings, numbers and containers already measured, O(items) for a new container."""
        t = type(x)
        if t is str:
            return len(x) + 2
        if t is int:
            return x.bit_length() * 3 // 10 + 2
        if x is None or t is bool or t is float:
            return 8
        return self._measure(x, 0)[0]

    def _measure(self, x: Any, depth: int) -> tuple[int, bool]:
        """(weight, whether it can be cached): a Namespace can change, and so can whatever holds one."""
        t = type(x)
        if t is str:
            return len(x) + 2, True
        if t is int:
            return x.bit_length() * 3 // 10 + 2, True
        if x is None or t is bool or t is float:
            return 8, True
        if t is dict:
            children: Any = x.items()
            pairs = cacheable = True
        elif t is list or t is tuple:
            children, pairs, cacheable = x, False, True
        elif isinstance(x, str):
            return len(x) + 2, True
        elif isinstance(x, (bytes, bytearray)):
            return len(x) + 3, True
        elif isinstance(x, int):
            return x.bit_length() * 3 // 10 + 2, True
        elif isinstance(x, float):
            return 8, True
        elif isinstance(x, Namespace):
            children, pairs, cacheable = object.__getattribute__(x, "_Namespace__attrs").items(), True, False
        elif isinstance(x, (dict, _DICT_ITEMS)):
            children, pairs, cacheable = (x.items() if isinstance(x, dict) else x), True, isinstance(x, dict)
        elif isinstance(x, (list, tuple, set, frozenset, _DICT_KEYS, _DICT_VALUES)):
            children, pairs, cacheable = x, False, isinstance(x, (list, tuple, set, frozenset))
        else:
            return _OPAQUE_WEIGHT, True
        cached = self._weights.get(id(x))
        if cached is not None and cached[0] is x:
            return cached[1], True
        if depth > MAX_DEPTH:
            raise TemplateTooLarge(f"the template built containers nested more than {MAX_DEPTH} deep")
        total, stable = 2, cacheable
        measure, limit = self._measure, self.limit
        for child in (itertools.chain.from_iterable(children) if pairs else children):
            tc = type(child)  # strings and numbers inline: most items are
            if tc is str:
                total += len(child) + 4
            elif tc is int:
                total += child.bit_length() * 3 // 10 + 4
            else:
                w, sc = measure(child, depth + 1)
                total += w + 2
                stable = stable and sc
            if total > limit:
                self.check(total)
        self._visits += len(x) if hasattr(x, "__len__") else 1
        if self._visits > 4096:
            self._visits = 0
            self.tick()
        if stable:
            self._weights[id(x)] = (x, total)
        return total, stable

    def remember(self, x: Any, weight: int | None = None) -> Any:
        """A container the template just built: its weight must fit (and is kept), its slots are charged."""
        if weight is None:
            self.weight(x)
        elif type(x) is list or type(x) is tuple:
            self._weights[id(x)] = (x, weight)
        self.charge(len(x))
        return x

    def shape(self, x: Any) -> tuple[int, int]:
        """(items, depth) of a nested structure, shared items counted each time; over `limit` items raises."""
        memo: dict[int, tuple[int, int]] = {}

        def walk(x: Any, depth: int) -> tuple[int, int]:
            known = memo.get(id(x))
            if known is not None:
                return known
            if depth > MAX_DEPTH:
                raise TemplateTooLarge(f"the template built containers nested more than {MAX_DEPTH} deep")
            items, deepest = len(x), 0
            values = x.values() if isinstance(x, dict) else x
            for v in [v for v in values if isinstance(v, _CONTAINERS)]:
                n, d = walk(v, depth + 1)
                items += n
                deepest = max(deepest, d)
                if items > self.limit:
                    self.check(items)
            self.tick()
            memo[id(x)] = items, deepest + 1
            return items, deepest + 1

        if not isinstance(x, _CONTAINERS):
            return 1, 1
        return walk(x, 0)

    # ---- results

    def text(self, x: Any) -> str:
        """`soft_str(x)` (strings, Markup included, are kept as they are), refusing a too long repr."""
        if isinstance(x, str):
            return x
        t = type(x)
        if t is int or t is float or t is bool or x is None:
            return str(x)
        self.weight(x)
        s = str(x)
        self.charge(len(s))  # a repr longer than its weight guessed (escapes) still stays bounded
        return s

    def result(self, r: Any) -> Any:
        """Check what a call, filter or operator returned."""
        if isinstance(r, (str, bytes)):
            self.charge(len(r))
        elif isinstance(r, (list, tuple, dict, set, frozenset)):
            self.remember(r)
        elif isinstance(r, types.GeneratorType):
            return self.ticking(r)
        elif isinstance(r, Namespace):
            self.weight(r)
        elif type(r) is int:
            self.check_int(r.bit_length())
        return r

    def ticking(self, items: Iterator) -> Iterator:
        """A filter's generator, checked at every item (its Python code runs between them)."""
        for item in items:
            self.tick()
            yield item


class _Local(threading.local):
    budget: Budget | None = None


_local = _Local()


def current() -> Budget:
    budget = _local.budget
    if budget is None:
        raise RuntimeError("a bounded template is rendered outside `rendering(budget)`")
    return budget


class rendering:
    """`with rendering(budget): template.render(...)`: the budget of the renders in this thread."""

    def __init__(self, budget: Budget):
        self.budget = budget

    def __enter__(self) -> Budget:
        self.previous = _local.budget
        _local.budget = self.budget
        return self.budget

    def __exit__(self, *exc: object) -> None:
        _local.budget = self.previous


# ---- printf-style and str.format widths -----------------------------------------------------------------

_PRINTF_SPEC = re.compile(r"%(?:\(([^)]*)\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?(.)", re.DOTALL)
_DIGITS = re.compile(r"\d+")


def _number(text: str) -> int:
    if len(text) > 12:
        raise TemplateTooLarge(f"the template asked for a width of {len(text)} digits")
    return int(text)


def check_printf(b: Budget, fmt: str | bytes, values: Any) -> None:
    """`fmt % values` would stay within the budget: every conversion's width, precision and value counted."""
    if isinstance(fmt, bytes):
        fmt = fmt.decode("latin-1")
    positional = values if isinstance(values, tuple) else (values,)
    mapping = values if isinstance(values, Mapping) else None
    total, i = len(fmt), 0
    for m in _PRINTF_SPEC.finditer(fmt):
        key, width, precision, conversion = m.groups()
        if conversion == "%" and key is None and width is None and precision is None:
            continue
        for field in (width, precision):
            if field == "*":
                n = positional[i] if i < len(positional) else 0
                i += 1
                total += abs(n) if isinstance(n, int) else 0
            elif field:
                total += _number(field)
        if key is not None:
            value = mapping.get(key) if mapping is not None else None
        else:
            value = positional[i] if i < len(positional) else None
            i += 1
        total += b.weight(value) + _FIELD_SLACK
        b.check(total)


class _BoundedFormatter(SandboxedFormatter):
    """str.format: each field's width and precision and the whole result are checked before they are built."""

    def __init__(self, env: Any, budget: Budget, **kwargs: Any):
        super().__init__(env, **kwargs)
        self._budget = budget
        self._total = 0

    def convert_field(self, value: Any, conversion: str | None) -> Any:
        self._budget.weight(value)  # !r / !s / !a of a container
        return super().convert_field(value, conversion)

    def format_field(self, value: Any, format_spec: str) -> Any:
        n = self._budget.weight(value) + _FIELD_SLACK + sum(_number(d) for d in _DIGITS.findall(format_spec))
        self._total += n
        self._budget.check(self._total)
        return super().format_field(value, format_spec)


class _BoundedEscapeFormatter(_BoundedFormatter, SandboxedEscapeFormatter):
    pass


# ---- methods of str, bytes and int --------------------------------------------------------------------

_LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"  # what str.splitlines splits on


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _check_method(b: Budget, owner: Any, name: str, args: tuple, kwargs: dict) -> tuple:
    """Checks a call of `owner.name(*args, **kwargs)` that could multiply sizes; returns the args to call with
    (an iterator given to `join` is consumed here, so it is passed on as a list)."""
    if isinstance(owner, (str, bytes, bytearray)):
        n = len(owner)
        if name in ("center", "ljust", "rjust", "zfill"):
            width = _arg(args, kwargs, 0, "width", 0)
            if isinstance(width, int):
                b.check(max(n, width))
        elif name == "expandtabs":
            tabsize = _arg(args, kwargs, 0, "tabsize", 8)
            if isinstance(tabsize, int):
                b.check(n + owner.count("\t" if isinstance(owner, str) else b"\t") * max(tabsize, 0))
        elif name == "replace":
            old, new = _arg(args, kwargs, 0, "old", None), _arg(args, kwargs, 1, "new", None)
            count = _arg(args, kwargs, 2, "count", -1)
            if isinstance(old, type(owner)) and isinstance(new, type(owner)) and isinstance(count, int):
                found = n + 1 if not old else owner.count(old)
                if count >= 0:
                    found = min(found, count)
                b.check(n + found * max(0, len(new) - len(old)))
        elif name == "join" and args:
            items = list(args[0])
            b.check(sum(b.weight(item) for item in items) + n * len(items))
            args = (items,) + tuple(args[1:])
        elif name == "translate" and args:
            table = args[0]
            if isinstance(table, Mapping):
                longest = max((len(v) for v in table.values() if isinstance(v, (str, bytes))), default=1)
                b.check(n * max(1, longest))
    elif isinstance(owner, int) and name == "to_bytes":
        length = _arg(args, kwargs, 0, "length", 1)
        if isinstance(length, int):
            b.check(length)
    return args


# ---- filters ------------------------------------------------------------------------------------------


def _pre_center(b: Budget, a: dict) -> None:
    a["value"] = s = b.text(a["value"])
    if isinstance(a["width"], int):
        b.check(max(len(s), a["width"]))


def _pre_indent(b: Budget, a: dict) -> None:
    s, width = a["s"], a["width"]
    indent = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
    b.check(indent)
    if isinstance(s, str):
        lines = 1 + sum(s.count(c) for c in _LINE_BREAKS)
        b.check(len(s) + lines * max(indent, 0) + indent)


def _pre_replace(b: Budget, a: dict) -> None:
    a["s"] = s = b.text(a["s"])
    old, new = str(b.text(a["old"])), str(b.text(a["new"]))
    count = a["count"]
    found = len(s) + 1 if not old else s.count(old)
    if isinstance(count, int) and count >= 0:
        found = min(found, count)
    b.check(len(s) + found * max(0, len(new) - len(old)))


def _pre_join(b: Budget, a: dict) -> None:
    a["value"] = items = list(a["value"])
    a["d"] = sep = b.text(a["d"])
    b.check(sum(b.weight(item) for item in items) + len(sep) * len(items))


def _pre_slow(b: Budget, text: Any, name: str) -> None:
    # wordwrap and urlize loop over words in Python, out of the budget's reach: 1.5 MB takes them 3-5 s.
    if isinstance(text, str) and len(text) > SLOW_FILTER_CHARS:
        raise TemplateTooLarge(f"{name}() takes at most {SLOW_FILTER_CHARS:,} characters, not {len(text):,}")


def _pre_wordwrap(b: Budget, a: dict) -> None:
    s, wrap = a["s"], a["wrapstring"]
    _pre_slow(b, s, "wordwrap")
    if isinstance(s, str):  # at worst one line per character, each followed by the wrap string
        b.check(len(s) * (1 + (len(wrap) if isinstance(wrap, str) else 1)))


def _pre_urlize(b: Budget, a: dict) -> None:
    _pre_slow(b, a["value"], "urlize")


def _pre_format(b: Budget, a: dict) -> None:
    a["value"] = fmt = b.text(a["value"])
    check_printf(b, fmt, a["kwargs"] or a["args"])


def _pre_batch(b: Budget, a: dict) -> None:
    if a["fill_with"] is not None and isinstance(a["linecount"], int):
        b.check(a["linecount"] * (b.weight(a["fill_with"]) + 2))


def _pre_slice(b: Budget, a: dict) -> None:
    if isinstance(a["slices"], int) and a["slices"] > MAX_RANGE:
        raise TemplateTooLarge(f"slice({a['slices']}): at most {MAX_RANGE} slices")


def _pre_shape(b: Budget, value: Any, indent: Any, separators: Any = None) -> None:
    """tojson / pprint: every line is indented by its depth, and every item carries a separator."""
    step = len(indent) if isinstance(indent, str) else indent if isinstance(indent, int) else 0
    extra = sum(len(s) for s in separators if isinstance(s, str)) if isinstance(separators, (tuple, list)) else 0
    if step > 0 or extra:
        items, depth = b.shape(value)
        b.check(b.weight(value) + items * (max(step, 0) * depth + 1 + extra))


def _pre_tojson(b: Budget, a: dict) -> None:
    _pre_shape(b, a["x"], a["indent"], a["separators"])


def _pre_pprint(b: Budget, a: dict) -> None:
    _pre_shape(b, a["value"], 1)


_FILTER_CHECKS = {
    "center": _pre_center, "indent": _pre_indent, "replace": _pre_replace, "join": _pre_join,
    "wordwrap": _pre_wordwrap, "format": _pre_format, "batch": _pre_batch, "slice": _pre_slice,
    "tojson": _pre_tojson, "pprint": _pre_pprint, "urlize": _pre_urlize,
}


@pass_environment
def _sum(environment: Any, iterable: Any, attribute: Any = None, start: Any = 0) -> Any:
    """Jinja's `sum`, without the quadratic copying of Python's `sum` over lists."""
    b = current()
    items = list(iterable)
    if attribute is not None:
        items = list(map(make_attrgetter(environment, attribute), items))
    if isinstance(start, (list, tuple)):
        for item in items:
            if type(item) is not type(start):
                raise TypeError(f'can only concatenate {type(start).__name__} (not "{type(item).__name__}") '
                                f"to {type(start).__name__}")
        b.check(b.weight(start) + sum(b.weight(item) for item in items))
        return type(start)(itertools.chain(start, *items))
    return sum(items, start)


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
    if not all(isinstance(v, int) for v in (n, min, max)) or n > 100 or max > 1000:
        raise TemplateTooLarge("lipsum(): at most 100 paragraphs of at most 1000 words")
    return generate_lorem_ipsum(n, html, min, max)


def bounded_filter(name: str, f: Any) -> Any:
    """`f` as a filter of the bounded sandbox: its subject and result are checked, and where it could
    multiply sizes (`_FILTER_CHECKS`), its arguments before it runs."""
    check = _FILTER_CHECKS.get(name)
    pass_arg = getattr(f, "jinja_pass_arg", None)
    skip = 0 if pass_arg is None else 1  # the environment or context Jinja passes first
    signature = None
    if check is not None:
        # The filter's own parameters, after the one Jinja passes (Jinja's async variants wrap the function
        # and may add that parameter themselves).
        base = inspect.unwrap(f)
        signature = inspect.signature(base, follow_wrapped=False)
        if getattr(base, "jinja_pass_arg", None) is not None:
            signature = signature.replace(parameters=list(signature.parameters.values())[1:])

    def filter_(*args: Any, **kwargs: Any) -> Any:
        b = current()
        b.tick()
        if len(args) > skip:
            b.weight(args[skip])
        if signature is not None:
            bound = signature.bind(*args[skip:], **kwargs)
            bound.apply_defaults()
            check(b, bound.arguments)
            args, kwargs = args[:skip] + bound.args, bound.kwargs
        return b.result(f(*args, **kwargs))

    if pass_arg is not None:
        filter_.jinja_pass_arg = pass_arg  # type: ignore[attr-defined]
    filter_.__name__ = getattr(f, "__name__", name)
    return filter_


# ---- the compiler -------------------------------------------------------------------------------------


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja's code generator with a budget check in every block and around every output, concatenation and
    literal, and without compile-time evaluation of constant output (which ran filters at model load)."""

    def blockvisit(self, body: Any, frame: Any) -> None:
        try:
            self.writeline("environment._b_tick()")  # where Jinja writes `pass`: the start of every block
            for node in body:
                self.visit(node, frame)
        except CompilerExit:
            pass

    def _output_child_to_const(self, node: Any, frame: Any, finalize: Any) -> str:
        if not isinstance(node, nodes.TemplateData):
            raise nodes.Impossible()
        return super()._output_child_to_const(node, frame, finalize)

    def _output_const_repr(self, group: Any) -> str:
        return f"environment._b_write({super()._output_const_repr(group)})"

    def _output_child_pre(self, node: Any, frame: Any, finalize: Any) -> None:
        if frame.eval_ctx.volatile:
            self.write("environment._b_out_ctx(context, ")
        elif frame.eval_ctx.autoescape:
            self.write("environment._b_out_escaped(")
        else:
            self.write("environment._b_out(")
        if finalize.src is not None:
            self.write(finalize.src)

    def _output_child_post(self, node: Any, frame: Any, finalize: Any) -> None:
        self.write(")")
        if finalize.src is not None:
            self.write(")")

    def visit_Concat(self, node: Any, frame: Any) -> None:
        escaping = "context.eval_ctx.autoescape" if frame.eval_ctx.volatile else repr(bool(frame.eval_ctx.autoescape))
        self.write("environment._b_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write(f"), {escaping})")

    def visit_Add(self, node: Any, frame: Any) -> None:
        # Templates add strings all the time: a direct call, cheaper than `call_binop`'s dispatch.
        self.write("environment._b_add(")
        self.visit(node.left, frame)
        self.write(", ")
        self.visit(node.right, frame)
        self.write(")")

    def visit_List(self, node: Any, frame: Any) -> None:
        self.write("environment._b_literal(")
        super().visit_List(node, frame)
        self.write(")")

    def visit_Dict(self, node: Any, frame: Any) -> None:
        self.write("environment._b_literal(")
        super().visit_Dict(node, frame)
        self.write(")")

    def visit_Tuple(self, node: Any, frame: Any) -> None:
        if node.ctx != "load":  # an assignment target
            super().visit_Tuple(node, frame)
            return
        self.write("environment._b_literal(")
        super().visit_Tuple(node, frame)
        self.write(")")

    def visit_EvalContextModifier(self, node: Any, frame: Any) -> None:
        # Jinja evaluates the option (`{% autoescape EXPR %}`) at compile time when it can: only a literal here.
        for keyword in node.options:
            self.writeline(f"context.eval_ctx.{keyword.key} = ")
            self.visit(keyword.value, frame)
            if isinstance(keyword.value, nodes.Const):
                setattr(frame.eval_ctx, keyword.key, keyword.value.value)
            else:
                frame.eval_ctx.volatile = True


# ---- the environment ----------------------------------------------------------------------------------


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, bounded by the `Budget` of the current `rendering`. Render only inside one."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset(["-", "*", "/", "//", "%", "**"])  # and "+" (`visit_Add`)

    def __init__(self, **kwargs: Any):
        kwargs["optimized"] = False  # the optimizer folds constant expressions at compile time
        super().__init__(**kwargs)
        self.filters["sum"] = _sum
        self.filters = {name: bounded_filter(name, f) for name, f in self.filters.items()}
        self.globals["lipsum"] = _lipsum

    def add_filter(self, name: str, f: Any) -> None:
        self.filters[name] = bounded_filter(name, f)

    # ---- hooks of the generated code

    def _b_tick(self) -> None:
        _local.budget.tick()  # type: ignore[union-attr]

    def _b_write(self, s: str) -> str:
        return _local.budget.write(s)  # type: ignore[union-attr]

    def _b_out(self, x: Any) -> str:
        b = _local.budget
        return b.write(x if type(x) is str else str(b.text(x)))  # type: ignore[union-attr]

    def _b_out_escaped(self, x: Any) -> str:
        b = current()
        if not hasattr(x, "__html__"):
            x = b.text(x)
        return b.write(escape(x))

    def _b_out_ctx(self, context: Any, x: Any) -> str:
        return self._b_out_escaped(x) if context.eval_ctx.autoescape else self._b_out(x)

    def _b_concat(self, parts: tuple, escaping: bool) -> str:
        b = current()
        texts = [b.text(p) for p in parts]
        b.check(sum(len(t) for t in texts))
        if escaping and any(hasattr(t, "__html__") for t in texts):
            return b.result(Markup("").join(texts))
        return b.result("".join(texts))

    def _b_literal(self, x: Any) -> Any:
        return current().remember(x)

    # ---- operators, calls, str.format

    def _b_add(self, left: Any, right: Any) -> Any:
        if type(left) is str and type(right) is str:  # the common case, made cheap (no tick: O(1) work)
            b = _local.budget
            n = len(left) + len(right)
            b.built += n  # type: ignore[union-attr]
            if n > b.limit or b.built > b.built_cap:  # type: ignore[union-attr]
                b.charge(n)  # raises
            return left + right
        return self.call_binop(None, "+", left, right)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        b = current()
        b.tick()
        if operator == "+":
            if isinstance(left, (str, bytes)) and isinstance(right, (str, bytes)):
                b.check(len(left) + len(right))
            elif isinstance(left, (list, tuple)) and isinstance(right, (list, tuple)):
                (wl, sl), (wr, sr) = b._measure(left, 0), b._measure(right, 0)
                b.check(wl + wr)
                result = left + right
                # O(1) when both are known: `ns.items = ns.items + [x]` in a loop stays linear.
                b.remember(result, wl + wr if sl and sr else None)
                return result
        elif operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(n, int) and isinstance(seq, (str, bytes)):
                    b.check(len(seq) * max(n, 0))
                elif isinstance(n, int) and isinstance(seq, (list, tuple)):
                    w, stable = b._measure(seq, 0)
                    b.check(w * max(n, 0))
                    result = seq * n
                    b.remember(result, w * max(n, 0) if stable else None)  # O(1): no walk of the result
                    return result
            if isinstance(left, int) and isinstance(right, int):
                b.check_int(left.bit_length() + right.bit_length())
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
                b.check_int(left.bit_length() * right)
        elif operator == "%" and isinstance(left, (str, bytes)):
            check_printf(b, left, right)
        return b.result(self.binop_table[operator](left, right))

    def call(__self, __context: Any, __obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        b = current()
        b.tick()
        if not __self.is_safe_callable(__obj):
            raise SecurityError(f"{__obj!r} is not safely callable")
        if isinstance(__obj, (types.BuiltinMethodType, types.MethodType)):
            owner = getattr(__obj, "__self__", None)
            if owner is not None:
                args = _check_method(b, owner, __obj.__name__, args, kwargs)
        return b.result(__context.call(__obj, *args, **kwargs))

    def wrap_str_format(self, value: Any) -> Any:
        if not isinstance(value, (types.MethodType, types.BuiltinMethodType)) or value.__name__ not in (
                "format", "format_map"):
            return None
        owner = value.__self__
        if not isinstance(owner, str):
            return None
        str_type, is_format_map = type(owner), value.__name__ == "format_map"

        def wrapper(*args: Any, **kwargs: Any) -> str:
            b = current()
            b.tick()
            if isinstance(owner, Markup):
                formatter: _BoundedFormatter = _BoundedEscapeFormatter(self, b, escape=owner.escape)
            else:
                formatter = _BoundedFormatter(self, b)
            if is_format_map:
                if kwargs:
                    raise TypeError("format_map() takes no keyword arguments")
                if len(args) != 1:
                    raise TypeError(f"format_map() takes exactly one argument ({len(args)} given)")
                kwargs, args = args[0], ()
            return b.result(str_type(formatter.vformat(owner, args, kwargs)))

        return update_wrapper(wrapper, value)

