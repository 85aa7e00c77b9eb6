"""The with-form lifecycle and host routing.

``with tap.record(...) as rec:`` taps every loop the block executes without
touching the user's code or any ``jax.lax`` name:

* **interception** - while any block is active, the ``bind`` of the loop
  primitives (``scan``, ``while``) is routed through :func:`_intercept`. The
  outermost loop bind (not one made while JAX traces another loop's body) is
  rewritten by the same transform ``verbose`` uses; nested loops are reached
  by that walk. This sees ``from jax.lax import scan``, ``fori_loop``,
  ``lax.map`` and library code alike.
* **keying** - a thread-local JAX config state (part of every jit cache key)
  holds a token per distinct device-side configuration and thread. Inside the
  block, functions jitted *before* it re-trace (and get tapped); after it,
  they hit their clean compilation again.
* **routing** - the host half of each tap looks up, when an event arrives,
  the innermost active block of its token and delivers there.
"""
from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Optional

from . import _seam
from ._collectors import FlightRecorder
from ._emit import TapSelectError
from ._host import warn_once_now
from ._toolkit import warn_unmatched
from . import _loops  # noqa: F401 - registers the scan and while rules
from ._rules import RULES
from ._transform import SiteIndex, Sinks, Walker, handler_for, tappable_names
from ._verbose import configure, make_tapped, rebuild_guard

_LOOPS = _seam.LOOP_PRIMITIVES  # intercepted whenever a block is active
_seam.check_at_import()  # one warning at import on a JAX outside the tested range


class Token:
    """Identity of one device-side tap configuration on one thread."""

    __slots__ = ("key", "walker", "__weakref__")

    def __init__(self, key, plan):
        self.key = key
        router = _Router(self)
        sinks = Sinks(router.carry_sink, router.carry_sink, [router.prim(i) for i in range(len(plan.prim_taps))],
                      rebuild_guard(plan))
        self.walker = Walker(plan, sinks, SiteIndex())

    def __repr__(self):
        return f"<jaxtap token {id(self):#x}>"


class _Router:
    """Host routing: deliver to the innermost active block of the token.

    The outermost index of an address is the block's own: the n-th distinct
    top-level loop (by source line) this block met, so a block's addresses
    do not depend on what earlier blocks with the same configuration ran.
    """

    def __init__(self, token):
        self._token = weakref.ref(token)

        def carry_sink(event, top):
            self.carry(event, top)

        carry_sink.resolve = self._resolve_carry  # buffered batches route once
        self.carry_sink = carry_sink

    def _route(self, path, kind, top):
        """(block, path as that block names it), or (None, None) to drop."""
        token = self._token()
        ctx = None if token is None else _REGISTRY.innermost(token)
        if ctx is None:
            return None, None
        if top is not None:
            first, sep, rest = path.partition("/")
            mine = f"{top[0]}[{ctx._sites.index(*top)}]"
            if mine != first:
                path = mine + sep + rest
                where = ctx._plan.where
                if where is not None and kind == "carry" and not _safe_where(where, path):
                    return None, None
        return ctx, path

    def _receive(self, event, top):
        ctx, path = self._route(event.path, event.kind, top)
        if ctx is not None and path != event.path:
            event = dataclasses.replace(event, path=path)
        return ctx, event

    def carry(self, event, top):
        ctx, event = self._receive(event, top)
        if ctx is not None:
            ctx._consumers.deliver(event)  # carry or output, by kind

    def _resolve_carry(self, path, kind, top):
        ctx, path = self._route(path, kind, top)
        if ctx is None:
            return None
        consumers = ctx._consumers
        return (consumers.ys_sink if kind == "output" else consumers.carry_sink), path

    def prim(self, i):
        def deliver(event, top):
            ctx, event = self._receive(event, top)
            if ctx is not None:
                ctx._prims[i].deliver(event)

        def resolve(path, kind, top):
            ctx, path = self._route(path, kind, top)
            return None if ctx is None else (ctx._prims[i].deliver, path)

        deliver.resolve = resolve
        return deliver


def _safe_where(where, path):
    try:
        return bool(where(path))
    except Exception:  # noqa: BLE001
        return False


class _Registry:
    """Active contexts per thread, tokens per configuration, and patches."""

    def __init__(self):
        self.lock = threading.RLock()
        self.stacks: dict = {}  # thread ident -> [weakref(ctx)], innermost last
        self.tokens: dict = {}  # (plan fingerprint, thread ident) -> Token
        self.n_active = 0

    # -- tokens
    def token_for(self, plan, thread):
        key = (plan.fingerprint(), thread)
        with self.lock:
            tok = self.tokens.pop(key, None)
            if tok is None:
                tok = Token(key, plan)
            self.tokens[key] = tok  # most recently used last
            if len(self.tokens) > _MAX_TOKENS:
                in_use = {id(c._token) for c in self.active()}
                for k in [k for k, t in self.tokens.items() if id(t) not in in_use][: len(self.tokens) - _MAX_TOKENS]:
                    del self.tokens[k]
            return tok

    # -- stacks
    def push(self, ctx):
        with self.lock:
            stack = self.stacks.setdefault(ctx._thread, [])
            stack.append(weakref.ref(ctx, _collected))
            self.n_active += 1
            _sync_patches()
        self._sync_thread_token()

    def remove(self, ctx_ref_or_ctx, thread):
        with self.lock:
            stack = self.stacks.get(thread, [])
            for i in range(len(stack) - 1, -1, -1):
                r = stack[i]
                if r is ctx_ref_or_ctx or r() is ctx_ref_or_ctx:
                    del stack[i]
                    self.n_active -= 1
                    break
            if not stack:
                self.stacks.pop(thread, None)
            if self.n_active <= 0:
                self.n_active = 0
            _sync_patches()
        if thread == threading.get_ident():
            self._sync_thread_token()
        else:
            sole = self.sole()
            _seam.set_global_token(sole._token if sole is not None else None)

    def active(self):
        for stack in list(self.stacks.values()):
            for r in list(stack):
                ctx = r()
                if ctx is not None:
                    yield ctx

    def top(self, thread):
        stack = self.stacks.get(thread)
        while stack:
            ctx = stack[-1]()
            if ctx is not None:
                return ctx
            stack.pop()
        return None

    def innermost(self, token):
        with self.lock:
            stack = self.stacks.get(token.key[1], ())
            for r in reversed(stack):
                ctx = r()
                if ctx is not None and ctx._token is token:
                    return ctx
        return None

    def _sync_thread_token(self):
        ctx = self.top(threading.get_ident())
        _seam.set_thread_token(ctx._token if ctx is not None else None)
        sole = self.sole()
        _seam.set_global_token(sole._token if sole is not None else None)

    def sole(self):
        """The only active block in the process, if exactly one is active.

        Threads without a block of their own are attributed to it (work
        handed to a worker thread or executor is tapped, as BlackJAX's
        progress bar expects); with two or more blocks active, each taps
        only its own thread."""
        if self.n_active != 1:
            return None
        for ctx in self.active():
            return ctx
        return None

    def reset(self):
        with self.lock:
            for ctx in list(self.active()):
                ctx._active = False
            self.stacks.clear()
            self.tokens.clear()
            self.n_active = 0
            _uninstall_all()
        _seam.set_thread_token(None)
        _seam.set_global_token(None)


_MAX_TOKENS = 32  # configurations remembered for reuse of their compilations
_REGISTRY = _Registry()


def _collected(ref):
    """A context was garbage-collected while active: drop it."""
    for thread, stack in list(_REGISTRY.stacks.items()):
        if ref in stack:
            _REGISTRY.remove(ref, thread)


# ------------------------------------------------------------- interception
def _sync_patches():
    """Intercept the loop primitives, and the primitives some active block
    taps by name, exactly while they are needed."""
    wanted = set(_LOOPS) if _REGISTRY.n_active else set()
    if _REGISTRY.n_active:
        wanted.update(_seam.impl_primitives())  # library primitives holding loops (lineax)
        for ctx in _REGISTRY.active():
            for t in ctx._plan.prim_taps:
                prim = _seam.primitive_named(t.prim) if t.prim else None
                if prim is not None and prim not in _LOOPS:
                    wanted.add(prim)
    for prim in list(_PATCHED):
        if prim not in wanted:
            _seam.uninstall_bind(prim)
            _PATCHED.discard(prim)
    for prim in wanted:
        if prim not in _PATCHED:
            _seam.install_bind(prim, _make_bind(prim))
            _PATCHED.add(prim)


_PATCHED: set = set()


def _uninstall_all():
    for prim in list(_PATCHED) + list(_LOOPS):
        _seam.uninstall_bind(prim)
    _PATCHED.clear()


def _make_bind(prim):
    handler = RULES.get(prim) if prim in _LOOPS else None
    expands = handler is None and _seam.impl_of(prim) is not None

    def bind(*args, **params):
        if _seam.BUSY.depth or not _REGISTRY.n_active:
            return _seam.bind_original(prim, args, params)
        ctx = _REGISTRY.top(threading.get_ident()) or _REGISTRY.sole()
        try:
            if expands:
                nested = ctx is None or _seam.impl_bind_is_nested()
            else:
                nested = ctx is None or _seam.inside_loop_body_trace(is_loop=handler is not None)
        except Exception as exc:  # noqa: BLE001 - a JAX whose traces the seam cannot read
            warn_once_now(f"jax-tap: cannot read this JAX's trace state ({type(exc).__name__}: {exc}); "
                          f"the {prim.name} runs untapped.")
            nested = True
        if nested:
            return _seam.bind_original(prim, args, params)
        if expands:
            return _intercept_expanding(prim, ctx, args, params)
        if handler is None:
            return _tap_primitive(prim, ctx, args, params)
        return _intercept(prim, handler, ctx, args, params)

    bind.__jaxtap_patch__ = True
    return bind


def _tap_primitive(prim, ctx, args, params):
    """A tapped primitive bound outside any loop: bind it, then tap it.

    Only at the base of the trace stack (eager, or staging into a jaxpr):
    under vmap/grad the rule's own bind of the primitive reaches the base.
    """
    if not _seam.at_base_trace():
        return _seam.bind_original(prim, args, params)
    with _seam.quiet():  # eager dispatch re-binds the primitive inside a jit
        out = _seam.bind_original(prim, args, params)
    if not any(t.prim == prim.name for t in ctx._plan.prim_taps):
        return out
    ctx._names_seen.add(prim.name)
    outs = list(out) if prim.multiple_results else [out]
    walker = ctx._token.walker
    with _seam.quiet():
        try:
            walker.emit_prims(prim.name, _seam.current_site(), False, list(args), outs, walker.top_scope())
        except TapSelectError:
            raise  # bad input: said clearly, never swallowed
        except Exception as exc:  # noqa: BLE001
            warn_once_now(f"jax-tap: could not tap {prim.name} ({type(exc).__name__}: {exc}).")
    return out


def _intercept(prim, handler, ctx, args, params):
    walker = ctx._token.walker
    site = _seam.current_site()
    if not _seam.in_custom_body_trace():  # (a body JAX may discard is numbered when it runs)
        ctx._sites.index("scan" if prim is _seam.scan_p else "while", site)  # program order
    with _seam.quiet():
        try:
            ctx._names_seen.update(tappable_names(_seam.loop_body(prim, params).jaxpr))
            with _seam.loop_scope():
                return handler(walker, None, params, list(args), walker.top_scope(), site)
        except TapSelectError:
            raise
        except Exception as exc:  # noqa: BLE001 - our failure must not be the user's
            return _untapped(prim, args, params, exc, f"a {prim.name} loop")


def _intercept_expanding(prim, ctx, args, params):
    """A library primitive whose loops exist only in its lowering (lineax's
    ``linear_solve``), bound outside any loop: tap its expansion."""
    walker = ctx._token.walker
    with _seam.quiet():
        try:
            avals = [_seam.abstractify(x) for x in args]
            expanded = _seam.impl_expansion(prim, params, avals)
            if expanded is None or not walker.needs(expanded.jaxpr):
                return _seam.bind_original(prim, args, params)
            ctx._names_seen.update(tappable_names(expanded.jaxpr))
            for name, site in _seam.top_loops(expanded.jaxpr):
                ctx._sites.index(name, site)  # program order, as for a loop bound here
            # (no site: the expansion's own loops carry theirs)
            return handler_for(prim)(walker, None, params, list(args), walker.top_scope(), None)
        except TapSelectError:
            raise
        except Exception as exc:  # noqa: BLE001 - our failure must not be the user's
            return _untapped(prim, args, params, exc, f"inside {prim.name}")


def _untapped(prim, args, params, exc, what):
    """Our rewrite failed: bind the user's equation as it is, warn once."""
    try:
        out = _seam.bind_original(prim, args, params)
    except Exception:
        raise exc from None  # the program itself fails the same way
    warn_once_now(f"jax-tap: could not tap {what} ({type(exc).__name__}: {exc}); it ran untapped.")
    return out


# ------------------------------------------------------------- the context
class TapContext:
    """The with-form: ``with tap.record(**cfg) as rec:``.

    Entering returns the :class:`FlightRecorder` that receives every event
    of the block. See :func:`record`.
    """

    def __init__(self, recorder: Optional[FlightRecorder] = None, **cfg):
        self.recorder = recorder if recorder is not None else FlightRecorder()
        self._plan, self._consumers, self._prims = configure(recorder=self.recorder, with_form=True, **cfg)
        self._token = None
        self._thread = None
        self._active = False
        self._names_seen: set = set()
        self._sites = SiteIndex()

    @property
    def events(self):
        return self.recorder.events

    def __enter__(self) -> FlightRecorder:
        if self._active:
            raise RuntimeError(
                "jax-tap: this tap.record() context is already active; create a new one "
                "(tap.record(...)) for a nested or concurrent block."
            )
        if not _seam.can_intercept():
            warn_once_now(f"jax-tap: this JAX ({_seam.JAX_VERSION_TEXT}) lacks the jit-key state the with-form "
                          f"needs; the block runs untapped. Install a tested JAX ({_seam.TESTED_RANGE}).")
            return self.recorder
        self._thread = threading.get_ident()
        self._token = _REGISTRY.token_for(self._plan, self._thread)
        self._active = True
        self._names_seen = set()
        self._sites = SiteIndex()
        self._consumers.new_run()
        for p in self._prims:
            p.new_run()
        _REGISTRY.push(self)
        return self.recorder

    def __exit__(self, exc_type, exc, tb):
        if not self._active:
            return False
        try:
            _seam.effects_barrier()  # deliver every event of work dispatched inside
        except Exception:  # noqa: BLE001 - a failed program already raised its own error
            pass
        finally:
            self._active = False
            _REGISTRY.remove(self, self._thread)
        if self._plan.prim_taps and self._names_seen:
            warn_unmatched(self._plan.prim_taps, self._names_seen)
        return False

    def __repr__(self):
        state = "active" if self._active else "inactive"
        return f"<tap.record context ({state}), {len(self.recorder)} events>"


def record(fn=None, /, *, on_step=None, select=None, alert=None, alert_once=False, ops=("scan", "while_loop"),
           sample_every=1, where=None, max_depth=None, taps=(), select_ys=None, on_ys=None, alert_ys=None,
           alert_ys_once=False, flush_every=None, maxlen=None):
    """Record loop telemetry: as a with-block around unmodified code, or by
    wrapping a function.

    ``with tap.record(**cfg) as rec:`` taps every ``scan``/``while_loop`` the
    block executes (including functions jitted before the block, library
    code, ``fori_loop`` and ``lax.map``); ``g, rec = tap.record(f, **cfg)``
    returns an observed ``f`` and its recorder. Both forms take
    :func:`verbose`'s keyword arguments and produce the same events.

    Parameters
    ----------
    fn : callable, optional
        Wrap this function instead of returning a context manager.
    maxlen : int, optional
        Keep only the last ``maxlen`` events in the recorder.
    **cfg
        As for :func:`verbose`.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, jaxtap as tap
    >>> def f(x0, xs):
    ...     return jax.lax.scan(lambda c, x: (c * 1.01 + jnp.sin(x), c), x0, xs)
    >>> with tap.record(select=lambda leaves: {"c": leaves[0]}) as rec:
    ...     _ = f(jnp.float32(0.0), jnp.linspace(0.0, 1.0, 100))
    >>> rec.events[-1].path, rec.events[-1].step, rec.events[-1].total
    ('scan[0]', 99, 100)
    """
    rec = FlightRecorder(maxlen=maxlen)
    cfg = dict(on_step=on_step, select=select, alert=alert, alert_once=alert_once, ops=ops,
               sample_every=sample_every, where=where, max_depth=max_depth, taps=taps, select_ys=select_ys,
               on_ys=on_ys, alert_ys=alert_ys, alert_ys_once=alert_ys_once, flush_every=flush_every)
    if fn is None:
        return TapContext(recorder=rec, **cfg)
    return make_tapped(fn, recorder=rec, **cfg), rec


def emergency_restore() -> None:
    """Reset jax-tap to a clean slate: remove every interception, forget
    every active context, clear this thread's jit-key token."""
    _REGISTRY.reset()


def active_contexts() -> int:
    """How many with-blocks are active (all threads)."""
    return _REGISTRY.n_active
