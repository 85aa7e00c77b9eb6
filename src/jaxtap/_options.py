"""The tap configuration (:class:`Config`, validated once) and the
device-side :class:`Plan` derived from it.

Bad input is rejected here, before any program runs, with a message that
names the parameter and the fix.
"""
from __future__ import annotations

import dataclasses
import difflib
import dis
import functools
import inspect
import operator
import os
import types
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

OPS = ("scan", "while_loop")
_OP_ALIASES = {"scan": "scan", "while_loop": "while", "while": "while", "fori_loop": None, "map": None}


# what each callable option is given, for the example in its error message
_EXAMPLES = {"select": "lambda leaves: leaves[0]", "where": "lambda path: path == 'scan[0]'",
             "select_ys": "lambda ys: ys[0]"}


def _check_callable(name: str, fn, allow_none: bool = True):
    if fn is None and allow_none:
        return
    if not callable(fn):
        raise TypeError(
            f"jax-tap: `{name}` must be callable (or None), got {type(fn).__name__}: {fn!r}. "
            f"Pass a function, e.g. {name}={_EXAMPLES.get(name, 'lambda e: ...')}"
        )


def check_path(owner: str, path, example: str):
    """``path`` as given, where it names a file (str or os.PathLike);
    else a TypeError naming the fix. An open file or a descriptor is refused:
    the writer closes what it opens, and must not close the user's stdout."""
    if isinstance(path, (str, os.PathLike)):
        return path
    raise TypeError(f"jax-tap: {owner} takes a file path (a str or os.PathLike), got {type(path).__name__}: "
                    f"{path!r}. Pass a path, e.g. {example}.")


def normalize_ops(ops) -> frozenset:
    if isinstance(ops, str):
        ops = (ops,)
    try:
        ops = tuple(ops)
    except TypeError:
        raise TypeError(
            f"jax-tap: `ops` must be a tuple of loop names from {OPS}, got {ops!r}"
        ) from None
    kinds = set()
    for op in ops:
        if not isinstance(op, str) or _OP_ALIASES.get(op) is None:
            close = difflib.get_close_matches(str(op), OPS, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"jax-tap: unknown loop name {op!r} in `ops`; choose from {OPS}.{hint} "
                "(fori_loop and lax.map are scans or while loops already.)"
            )
        kinds.add(_OP_ALIASES[op])
    return frozenset(kinds)


def _check_int(name, value, *, minimum, optional, requirement, hint, maximum=None):
    if optional and value is None:
        return None
    try:  # numpy integers too (not bools, not floats)
        number = None if isinstance(value, (bool, np.bool_)) else operator.index(value)
    except TypeError:
        number = None
    if number is None or number < minimum or (maximum is not None and number > maximum):
        raise ValueError(f"jax-tap: `{name}` must be {requirement}, got {value!r}. {hint}")
    return number


_INT32_MAX = 2**31 - 1  # a step counter on device is an int32


def check_sample_every(k) -> int:
    return _check_int("sample_every", k, minimum=1, optional=False, maximum=_INT32_MAX,
                      requirement=f"a positive int (at most {_INT32_MAX})",
                      hint="Use sample_every=1 to observe every step, 100 for one step in a hundred.")


def check_flush_every(k) -> Optional[int]:
    return _check_int("flush_every", k, minimum=1, optional=True, requirement="None or a positive int",
                      hint="flush_every=100 buffers 100 sampled steps on device per host hop.")


def check_max_compiles(n) -> Optional[int]:
    return _check_int("max_compiles", n, minimum=1, optional=True, requirement="None or a positive int",
                      hint="max_compiles=2 prints a FAIL line when a jitted function compiles a third time.")


def check_max_depth(d) -> Optional[int]:
    return _check_int("max_depth", d, minimum=0, optional=True, requirement="None or an int >= 0",
                      hint="max_depth=0 observes only the outermost loops.")


def select_wants_path(select) -> bool:
    """True when `select` takes the node address (keyword `path` or 2 params)."""
    try:
        sig = inspect.signature(select)
    except (TypeError, ValueError):
        return False
    params = list(sig.parameters.values())
    if any(p.name == "path" and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params):
        return "keyword"
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) >= 2 and positional[1].default is inspect.Parameter.empty:
        return "positional"
    return False


class _Same:
    """Compares by identity and keeps the object alive (so its id stays unique)."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __eq__(self, other):
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self):
        return id(self.obj)


def fingerprint(fn) -> Any:
    """A hashable identity for a function: equal for re-created lambdas
    (same code; equal values closed over, in its defaults and read as
    globals), different otherwise. A value is seen as :func:`_value` says:
    scalars by value, the user's functions by their own fingerprint, small
    containers item by item, anything else by identity.

    Two blocks whose functions agree share one compiled program; a global
    or a dict entry changed between them (``for k in ...: with
    tap.record(select=lambda leaves: leaves[k])``) makes another.
    """
    return None if fn is None else _function(fn, _Walk())


class _Walk:
    """One fingerprint's traversal: the functions entered, and how deep."""

    __slots__ = ("seen", "depth")

    def __init__(self):
        self.seen, self.depth = set(), 0


def _function(fn, walk) -> tuple:
    if isinstance(fn, functools.partial):
        return ("partial", _value(fn.func, walk), tuple(_value(a, walk) for a in fn.args),
                tuple(sorted((k, _value(v, walk)) for k, v in (fn.keywords or {}).items())))
    code = getattr(fn, "__code__", None)
    if code is None:
        return ("obj", _Same(fn))
    walk.seen.add(id(fn))
    cells = []
    for c in getattr(fn, "__closure__", None) or ():
        try:
            cells.append(_value(c.cell_contents, walk))
        except ValueError:  # an empty cell
            cells.append(None)
    defaults = tuple(_value(v, walk) for v in getattr(fn, "__defaults__", None) or ())
    kwdefaults = tuple(sorted((k, _value(v, walk)) for k, v in (getattr(fn, "__kwdefaults__", None) or {}).items()))
    env = getattr(fn, "__globals__", None) or {}
    reads = tuple((name, _value(env[name], walk)) for name in _global_names(code) if name in env)
    return ("fn", code, tuple(cells), defaults, kwdefaults, reads, _Same(getattr(fn, "__self__", None)))


_LIBRARIES = ("jax", "numpy", "jaxtap", "jaxlib", "scipy")  # their functions' globals do not change
_MAX_DEPTH = 3  # functions and containers followed this deep
_SCALARS = (int, bool, str, bytes, type(None), float, complex)


def _value(obj, walk):
    """An object as a fingerprint sees it: a scalar by value; a function of
    the user's (or a partial) by its fingerprint (a factory's ``lambda
    leaves: fn(leaves)``, re-made per block, is the same when ``fn`` is);
    a small dict, list, set or tuple item by item (a ``cfg["k"] = 1``
    between two blocks is seen); anything else, and anything deeper than
    three levels, by identity."""
    kind = type(obj)
    if kind in _SCALARS:
        return ("=", kind, repr(obj) if kind in (float, complex) else obj)  # (-0.0 and 0.0 differ)
    if walk.depth >= _MAX_DEPTH or id(obj) in walk.seen:
        return _Same(obj)
    user_fn = isinstance(obj, functools.partial) or (
        isinstance(obj, types.FunctionType) and not (getattr(obj, "__module__", None) or "").startswith(_LIBRARIES))
    container = isinstance(obj, (dict, list, set, frozenset, tuple)) and len(obj) <= 64
    if not (user_fn or container):
        return _Same(obj)
    walk.depth += 1
    try:
        if user_fn:
            return ("call", _function(obj, walk))
        if isinstance(obj, dict):
            items = tuple((_value(k, walk), _value(v, walk)) for k, v in obj.items())
        elif isinstance(obj, (set, frozenset)):
            items = frozenset(_value(x, walk) for x in obj)  # (in no fixed order)
        else:
            items = tuple(_value(x, walk) for x in obj)
        return (_Same(obj), kind, items)
    finally:
        walk.depth -= 1


@functools.lru_cache(maxsize=1024)
def _global_names(code) -> tuple:
    """The names ``code`` and the functions defined in it read as globals."""
    names, todo = set(), [code]
    while todo:
        c = todo.pop()
        names.update(i.argval for i in dis.get_instructions(c) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME"))
        todo.extend(k for k in c.co_consts if inspect.iscode(k))
    return tuple(sorted(names))


@dataclass(frozen=True, eq=False)
class PrimTap:
    """A primitive tap: created by ``tap.on``, ``tap.watch_nan``, ``tap.print``."""

    prim: Optional[str]  # None = every floating-point equation (NaN birth sites)
    select: Optional[Callable] = None
    alert: Optional[Callable] = None
    label: Optional[str] = None
    output: Optional[int] = None
    once: bool = False
    mode: str = "on"  # "on" | "nan" | "print" | "nan_birth"

    def fingerprint(self):
        return (self.prim, fingerprint(self.select), self.output, self.mode)

    @functools.cached_property
    def select_path(self):
        """How ``select`` takes the address (as for carry selects), if at all."""
        return select_wants_path(self.select) if self.select is not None else False


@dataclass(frozen=True, eq=False)
class Config:
    """One tap configuration: the keyword arguments of ``tap.verbose`` and
    ``tap.record``, listed here once and validated when it is made.

    ``tap.verbose`` and ``tap.record`` spell these out as keyword arguments
    (``tests/test_structure.py`` checks that they match this list); see
    :func:`jaxtap.verbose` for what each one means.

    Examples
    --------
    >>> from jaxtap._options import Config
    >>> Config(sample_every=10).sample_every
    10
    >>> Config(ops="scan").kinds
    frozenset({'scan'})
    """

    on_step: Optional[Callable] = None
    select: Optional[Callable] = None
    alert: Optional[Callable] = None
    alert_once: bool = False
    ops: Union[str, Sequence[str]] = ("scan", "while_loop")
    sample_every: int = 1
    where: Optional[Callable] = None
    max_depth: Optional[int] = None
    taps: Sequence[PrimTap] = ()
    select_ys: Optional[Callable] = None
    on_ys: Optional[Callable] = None
    alert_ys: Optional[Callable] = None
    alert_ys_once: bool = False
    flush_every: Optional[int] = None
    jit_events: bool = False
    trace_events: bool = False
    max_compiles: Optional[int] = None
    timeline: bool = False
    per_shard: bool = False
    backward: bool = False

    def __post_init__(self):
        for name in ("on_step", "select", "alert", "where", "select_ys", "on_ys", "alert_ys"):
            _check_callable(name, getattr(self, name))
        for name, check in (("sample_every", check_sample_every), ("max_depth", check_max_depth),
                            ("flush_every", check_flush_every), ("max_compiles", check_max_compiles)):
            object.__setattr__(self, name, check(getattr(self, name)))  # numpy ints become ints
        for name in ("alert_once", "alert_ys_once", "jit_events", "trace_events", "timeline", "per_shard", "backward"):
            if not isinstance(getattr(self, name), (bool, int, np.bool_)):
                raise TypeError(f"jax-tap: `{name}` must be True or False, got {getattr(self, name)!r}")
            object.__setattr__(self, name, bool(getattr(self, name)))  # (a numpy bool counts too)
        # one tap alone is a list of one (taps=tap.watch_nan("log") reads naturally)
        taps = (self.taps,) if isinstance(self.taps, PrimTap) else self.taps or ()
        try:
            taps = tuple(taps)
        except TypeError:
            raise TypeError(f"jax-tap: `taps` must be a list of taps made by tap.on / tap.watch_nan / tap.print, "
                            f"e.g. taps=[tap.watch_nan('log')]; got {taps!r}") from None
        for t in taps:
            if not isinstance(t, PrimTap):
                raise TypeError(
                    f"jax-tap: `taps` must hold taps made by tap.on / tap.watch_nan / tap.print, got {t!r}"
                )
        object.__setattr__(self, "taps", taps)
        object.__setattr__(self, "kinds", normalize_ops(self.ops))

    @property
    def time_taps(self) -> bool:
        """Does this configuration ask for jit-event or trace-time taps?"""
        return self.jit_events or self.trace_events or self.max_compiles is not None

    @classmethod
    def of(cls, arguments: Mapping[str, Any]) -> "Config":
        """The configuration among a call's arguments (e.g. ``locals()``)."""
        return cls(**{f.name: arguments[f.name] for f in dataclasses.fields(cls) if f.name in arguments})

    @classmethod
    def from_keywords(cls, keywords: Mapping[str, Any]) -> "Config":
        """``Config(**keywords)``, naming the closest option for a misspelt one."""
        names = [f.name for f in dataclasses.fields(cls)]
        for key in keywords:
            if key not in names:
                close = difflib.get_close_matches(key, names, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else f" Options: {', '.join(names)}."
                raise TypeError(f"jax-tap: unknown option {key!r}.{hint}")
        return cls(**keywords)


@dataclass(eq=False)
class Plan:
    """Everything the device-side rewrite needs to know, nothing host-side."""

    select: Optional[Callable]
    sample_every: int
    kinds: frozenset
    where: Optional[Callable]
    max_depth: Optional[int]
    emit_carry: bool
    prim_taps: Tuple[PrimTap, ...] = ()
    select_path: Any = False
    select_ys: Optional[Callable] = None
    emit_ys: bool = False
    select_ys_path: Any = False
    flush_every: Optional[int] = None
    per_shard: bool = False
    backward: bool = False

    @functools.cached_property
    def _fingerprint(self):
        return (
            fingerprint(self.select), self.sample_every, tuple(sorted(self.kinds)),
            fingerprint(self.where), self.max_depth, self.emit_carry,
            tuple(t.fingerprint() for t in self.prim_taps),
            fingerprint(self.select_ys), self.emit_ys, self.flush_every, bool(self.per_shard),
            bool(self.backward),
        )

    def fingerprint(self):
        """Equal for plans that compile to the same device program."""
        return self._fingerprint

    @property
    def emits_loops(self) -> bool:
        return self.emit_carry or self.emit_ys

    @property
    def tapped_names(self) -> frozenset:
        return frozenset(t.prim for t in self.prim_taps)

    @property
    def active(self) -> bool:
        return self.emit_carry or self.emit_ys or bool(self.prim_taps)

    @property
    def rewrites(self) -> bool:
        """Does this plan change any program? (Not with only jit-event and
        trace-time taps: ``ops=()`` and no primitive taps.)"""
        return (self.emits_loops and bool(self.kinds)) or bool(self.prim_taps)


def build_plan(config: Config, *, emit_carry: bool, emit_ys: bool) -> Plan:
    """The device side of ``config``: what the loops emit, and how."""
    if emit_ys and "scan" not in config.kinds:
        from ._host import warn_once_now
        warn_once_now("jax-tap: y-taps (select_ys/on_ys/alert_ys) observe scans, but `ops` excludes 'scan': "
                      "select_ys has no effect and no output events will be emitted. Add 'scan' to ops.")
    select, select_ys = config.select, config.select_ys
    return Plan(
        select=select,
        sample_every=config.sample_every,
        kinds=config.kinds,
        where=config.where,
        max_depth=config.max_depth,
        emit_carry=emit_carry,
        prim_taps=config.taps,
        select_path=select_wants_path(select) if select is not None else False,
        select_ys=select_ys,
        emit_ys=emit_ys,
        select_ys_path=select_wants_path(select_ys) if select_ys is not None else False,
        flush_every=config.flush_every,
        per_shard=bool(config.per_shard),
        backward=bool(config.backward),
    )
