"""The lens: interception scoped to a block or a call, and host routing.

Both forms hold the lens the same way. ``with tap.record(...) as rec:``
opens a *block*; each call of ``tap.verbose(f)`` (or ``tap.record(f)``)
opens a *call scope* around ``f``, which then runs exactly as written
(eagerly, or into whatever trace it is called under). While a scope is open
on a thread, jax-tap taps every loop it executes without touching the user's
code or any ``jax.lax`` name:

* **interception** - while any scope is open, the ``bind`` of the loop
  primitives (``scan``, ``while``) is routed through :func:`_intercept`. The
  outermost loop bind (not one made while JAX traces another loop's body) is
  rewritten by the transform (``_transform``); nested loops are reached by
  its walk. This sees ``from jax.lax import scan``, ``fori_loop``,
  ``lax.map`` and library code alike.
* **keying** - a thread-local JAX config state (part of every jit cache key)
  holds a token per distinct device-side configuration (and thread, for
  blocks). Inside the scope, functions jitted *before* it re-trace (and get
  tapped); after it, they hit their clean compilation again.
* **routing** - a block's events go, when they arrive, to the innermost
  active block of its token; a call scope's go straight to its wrapper's
  consumers (its compiled program may run long after the call returned);
  ``_routing`` holds the router.
"""
from __future__ import annotations

import sys
import threading
import weakref

import jax

from . import _seam
from ._emit import TapSelectError, shard_mode
from ._host import Guard, explain, interrupt_of, warn_once_now
from . import _loops  # noqa: F401 - registers the scan and while rules
from ._routing import Router
from ._rules import RULES
from ._scope import SiteIndex, TraceOrder
from ._timetaps import Signals
from ._transform import Sinks, Walker, handler_for, tappable_names

_LOOPS = _seam.LOOP_PRIMITIVES  # intercepted whenever a block is active
_seam.check_at_import()  # one warning at import on a JAX outside the tested range


interception_unavailable = _seam.interception_unavailable


def rebuild_guard(plan):
    return Guard(plan.select or (lambda leaves: leaves), "select (its result could not be rebuilt on the host)")


class Token:
    """Identity of one device-side tap configuration: a block's (one per
    configuration and thread; events go to the innermost active block of the
    token) or a wrapped function's (``owner`` given: events go to it)."""

    __slots__ = ("key", "walker", "order", "__weakref__")

    def __init__(self, key, plan, owner=None):
        self.key = key
        self.order = TraceOrder()  # top-level loops in each program's order, for blocks that reuse it
        if owner is None:
            ref = weakref.ref(self)
            router = Router(lambda: None if ref() is None else _REGISTRY.innermost(ref()), _REGISTRY)
        else:
            router = Router(lambda: owner, _REGISTRY)  # (held: its programs may run after the call returned)
        sinks = Sinks(router.carry_sink, router.carry_sink,
                      [router.prim(i) for i in range(len(plan.prim_taps))], rebuild_guard(plan))
        self.walker = Walker(plan, sinks, SiteIndex())

    def __repr__(self):
        return f"<jaxtap token {id(self):#x}>"


class CallScope:
    """One call of a wrapped function (``tap.verbose(f)``): ``f``'s loops are
    intercepted as a block's are, on this thread only, from the call's own
    Python frame and trace inward (``barrier``)."""

    __slots__ = ("_token", "_plan", "_sites", "_names_seen", "_thread", "barrier", "_times", "__weakref__")
    shared = False  # never lent to other threads (see _Registry.sole)

    def __init__(self, token, sites, names_seen, barrier, times=None):
        self._token = token
        self._plan = token.walker.plan
        self._sites = sites  # the wrapper's addresses, stable across its calls
        self._names_seen = names_seen
        self._thread = threading.get_ident()
        self.barrier = barrier
        self._times = times  # the wrapper's jit-event and trace-time taps (or None)

    def __enter__(self):
        _REGISTRY.push(self)
        return self

    def __exit__(self, exc_type, exc, tb):
        _REGISTRY.remove(self, self._thread)
        interrupt = interrupt_of(exc)
        explain(exc)
        if interrupt is not None:  # a Ctrl-C stopped the run (see _host.pass_interrupt)
            raise interrupt from exc
        return False


class _Registry:
    """Active contexts per thread, tokens per configuration, and patches."""

    def __init__(self):
        self.lock = threading.RLock()
        self.stacks: dict = {}  # thread ident -> [weakref(ctx)], innermost last
        self.tokens: dict = {}  # (plan fingerprint, thread ident) -> Token
        # threads whose own (thread-local) token another thread could not
        # reset: a block of theirs collected elsewhere (see remove)
        self.stale: set = set()
        self.n_active = 0
        self.generation = 0  # changes whenever the active blocks change (routes cached by it)

    # -- tokens
    def token_for(self, plan, thread):
        key = (plan.fingerprint(), thread)
        with self.lock:
            if thread in self.stale:  # its old tokens may key compilations made untapped since
                self.stale.discard(thread)
                for k in [k for k in self.tokens if k[1] == thread]:
                    del self.tokens[k]
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
            self.generation += 1
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
            self.generation += 1
            if not stack:
                self.stacks.pop(thread, None)
            if self.n_active <= 0:
                self.n_active = 0
            _sync_patches()
        if thread == threading.get_ident():
            self._sync_thread_token()
        else:  # (a block garbage-collected on another thread) its thread keeps its
            # own token until it next enters a block: that block gets fresh tokens
            with self.lock:
                self.stale.add(thread)
            _seam.set_global_token(_jit_key(self.sole()))

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
        _seam.set_thread_token(_jit_key(self.top(threading.get_ident())))
        _seam.set_global_token(_jit_key(self.sole()))

    def sole(self):
        """The only active block in the process, if exactly one is active.

        Threads without a block of their own are attributed to it (work
        handed to a worker thread or executor is tapped, as BlackJAX's
        progress bar expects); with two or more blocks active, each taps
        only its own thread. A wrapped function's call scope is never lent."""
        if not self.n_active:
            return None
        shared = [ctx for ctx in self.active() if ctx.shared]
        return shared[0] if len(shared) == 1 else None

    def reset(self):
        with self.lock:
            for ctx in list(self.active()):
                ctx._active = False
            self.stacks.clear()
            self.tokens.clear()
            self.stale.clear()
            self.n_active = 0
            self.generation += 1  # cached routes to the reset blocks go stale
            _uninstall_all()
        _seam.set_thread_token(None)
        _seam.set_global_token(None)


def _jit_key(ctx):
    """The jit-key token of a scope: None for one that rewrites nothing (only
    jit-event / trace-time taps), so its programs keep their cache hits."""
    if ctx is None or not ctx._plan.rewrites:
        return None
    return ctx._token


_MAX_TOKENS = 32  # configurations remembered for reuse of their compilations
_REGISTRY = _Registry()


def snapshot() -> dict:
    """The lens's resting state, for tests and debugging: open scopes, threads
    holding one, remembered block configurations, intercepted primitives.

    Examples
    --------
    >>> from jaxtap._lens import snapshot
    >>> state = snapshot()  # outside any block or wrapped call:
    >>> state["scopes"], state["threads"], state["intercepted"]
    (0, 0, 0)
    """
    with _REGISTRY.lock:
        return {"scopes": _REGISTRY.n_active, "threads": len(_REGISTRY.stacks),
                "configurations": len(_REGISTRY.tokens), "intercepted": len(_PATCHED)}


def _collected(ref, _sys=sys):
    """A context was garbage-collected while active: drop it (nothing to
    drop at interpreter exit, where a block left open is collected with
    this module's globals already gone)."""
    if _sys.is_finalizing():
        return
    for thread, stack in list(_REGISTRY.stacks.items()):
        if ref in stack:
            _REGISTRY.remove(ref, thread)


# ------------------------------------------------------------- interception
def _sync_patches():
    """Intercept the loop primitives, and the primitives some active block
    taps by name, exactly while they are needed."""
    wanted = set(_LOOPS) if _REGISTRY.n_active else set()
    if _REGISTRY.n_active:
        impls = _seam.impl_primitives()
        _IMPLS[0] = len(impls)
        wanted.update(impls)  # library primitives holding loops (lineax)
        if _seam.shard_map_p is not None:
            wanted.add(_seam.shard_map_p)  # its mesh says which device runs each shard
        for ctx in _REGISTRY.active():
            if ctx._plan.prim_taps:
                wanted.add(_seam.jit_p)  # what a tap name could match (see _note_names)
            for t in ctx._plan.prim_taps:
                prim = _seam.primitive_named(t.prim) if t.prim else None
                if prim is not None and prim not in _LOOPS:
                    wanted.add(prim)
    if any(ctx._plan.backward for ctx in _REGISTRY.active()):
        _seam.install_backward_rules()  # which forward loop each backward scan belongs to
    else:
        _seam.uninstall_backward_rules()
    for prim in list(_PATCHED):
        if prim not in wanted:
            _seam.uninstall_bind(prim)
            _PATCHED.discard(prim)
    for prim in wanted:
        if prim not in _PATCHED:
            _seam.install_bind(prim, _make_bind(prim))
            _PATCHED.add(prim)
    times = [t for t in (getattr(c, "_times", None) for c in _REGISTRY.active()) if t is not None]
    if any(t.jit_events for t in times):
        _seam.monitor.watch_jit(_SIGNALS.jit_call, _SIGNALS.span, _SIGNALS.cache_event, _SIGNALS.executable)
    else:
        _seam.monitor.watch_jit(None, None, None)
    _seam.monitor.watch_promotions(_SIGNALS.promotion if any(t.trace_events for t in times) else None)
    _seam.monitor.watch_compiled_calls(_on_compiled_call if _REGISTRY.n_active else None, _AOT_SEEN.add)
    _seam.monitor.watch_traces(_on_jit_trace if _REGISTRY.n_active else None)
    _seam.clean_eager_dispatch(bool(_REGISTRY.n_active))


_IMPLS = [0]  # how many library primitives the last sync intercepted


def _on_jit_trace():
    """A library imported inside a block (``python -m jaxtap`` runs the
    script's imports in one) defines its loop-holding primitives then:
    intercept them before the next jit call is traced."""
    if _seam.impl_count() != _IMPLS[0]:
        with _REGISTRY.lock:
            _sync_patches()


def _on_compiled_call(executable):
    """An executable compiled ahead of time outside any block (those compiled in one are seen already)
    is a fixed program: it runs untapped in a block. Say so once per executable."""
    ctx = _scope_here()
    if ctx is not None and ctx._plan.rewrites and executable not in _AOT_SEEN:
        _AOT_SEEN.add(executable)
        if _seam.monitor.untapped_loops(executable):
            warn_once_now("jax-tap: an executable compiled ahead of time (jax.jit(f).lower(...).compile()) "
                          "outside any block runs untapped here: its loops send no events. Call the jitted "
                          "function itself in the block, or compile it inside the block.")


_AOT_SEEN = weakref.WeakSet()


def _scope_here():
    """The scope this thread's work belongs to (its own, else the sole block), or None."""
    return _REGISTRY.top(threading.get_ident()) or _REGISTRY.sole()


_SIGNALS = Signals(_scope_here)  # compile-time signals, to that scope's time taps


_PATCHED: set = set()


def _uninstall_all():
    for prim in list(_PATCHED) + list(_LOOPS):
        _seam.uninstall_bind(prim)
    _PATCHED.clear()
    _seam.uninstall_backward_rules()
    _seam.monitor.watch_jit(None, None, None)
    _seam.monitor.watch_promotions(None)
    _seam.monitor.watch_compiled_calls(None)
    _seam.monitor.watch_traces(None)
    _seam.clean_eager_dispatch(False)


def _make_bind(prim):
    if prim is _seam.shard_map_p:
        return _shard_map_bind(prim)
    handler = RULES.get(prim) if prim in _LOOPS else None
    expands = handler is None and _seam.impl_of(prim) is not None
    notes = prim is _seam.jit_p
    scan = prim is _seam.scan_p

    def bind(*args, **params):
        if scan:
            _seam.note_backward_bind(params)  # a transpose rule binding a backward scan
        if _seam.BUSY.depth or not _REGISTRY.n_active:
            return _seam.bind_original(prim, args, params)
        if handler is not None:
            _seam.note_forwarding(prim, params)  # carry leaves the front end moved out, for select
        ctx = _REGISTRY.top(threading.get_ident()) or _REGISTRY.sole()
        if notes and ctx is not None and ctx._plan.prim_taps:
            _note_names(ctx, params)
            if not any(t.prim == prim.name for t in ctx._plan.prim_taps):
                return _seam.bind_original(prim, args, params)
        try:
            if expands:
                nested = ctx is None or _seam.impl_bind_is_nested(ctx.barrier)
            else:
                nested = ctx is None or _seam.inside_loop_body_trace(handler is not None, ctx.barrier)
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


def _shard_map_bind(prim):
    """shard_map traces its body inside its bind: the hops traced there
    learn the concrete mesh (which device runs each shard)."""

    def bind(*args, **params):
        with _seam.binding_shard_map(params):
            return _seam.bind_original(prim, args, params)

    bind.__jaxtap_patch__ = True
    return bind


def _note_names(ctx, params):
    """A jit bound in a scope with primitive taps: what a tap name could
    match in it (for the "matched nothing" warning). Once every name has
    matched, the warning cannot fire: eager jnp calls skip the walk."""
    seen = ctx._names_seen
    if all(t.prim is None or t.prim in seen for t in ctx._plan.prim_taps):
        return
    try:
        ctx._names_seen.update(tappable_names(_seam.jit_body(params).jaxpr))
    except Exception:  # noqa: BLE001 - a hint only
        pass


def _tap_primitive(prim, ctx, args, params):
    """A tapped primitive bound outside any loop: bind it, then tap it.

    Only at the base of the trace stack (eager, or staging into a jaxpr):
    under vmap/grad the rule's own bind of the primitive reaches the base.
    Never in derivative code, a linear solve's operator, a custom_jvp rule
    or a function to transpose (JAX transposes those, tangents and all;
    ``tap.primitives`` does not list what is inside them).
    """
    if not _seam.at_base_trace() or _seam.in_tangent_code():
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
            with shard_mode(walker.plan):
                walker.emit_prims(prim.name, _seam.current_site(), False, list(args), outs, walker.top_scope())
        except TapSelectError:
            raise  # bad input: said clearly, never swallowed
        except Exception as exc:  # noqa: BLE001
            warn_once_now(f"jax-tap: could not tap {prim.name} ({type(exc).__name__}: {exc}).")
    return out


def _intercept(prim, handler, ctx, args, params):
    walker = ctx._token.walker
    site = _seam.current_site()
    # a custom_jvp/custom_vjp body JAX may trace and discard: its loops take
    # no number until their events arrive (_routing.Router); others, program order
    provisional = _seam.in_custom_body_trace(ctx.barrier)
    path, renamed, before = None, False, None
    kind = "scan" if prim is _seam.scan_p else "while"
    eager = _seam.evaluating_eagerly()
    if not provisional:
        info = _seam.backward_info(params) if ctx._plan.backward and kind == "scan" else None
        key = _seam.loop_site(prim, params, site) if info is None else info.forward_site  # a backward twin's
        index = ctx._sites.index(kind, key)
        if not eager:  # (an eager loop is numbered by every block that runs it)
            before = ctx._token.order.note(kind, key, _seam.current_trace())
        path = f"{kind}[{index}]"
        # the walker numbers top-level loops for every block with these options;
        # where it names this one otherwise, the loop takes the block's own
        # index (a later block that reuses the compilation and numbers it
        # otherwise again has `where` asked on the host: _routing)
        renamed = walker.sites.peek(kind, key) != index
    times = getattr(ctx, "_times", None)
    if times is not None and times.trace_events:
        _trace_event(times, path, prim, params, site)
    if not ctx._plan.rewrites:
        return _seam.bind_original(prim, args, params)  # time taps only: the loop as it is
    with _seam.quiet():
        try:
            ctx._names_seen.update(tappable_names(_seam.loop_body(prim, params).jaxpr))
            if eager:
                return _run_eagerly(_eager_tapped(walker, prim, handler, params, site, index if renamed else None),
                                    args)
            with _seam.loop_scope(), shard_mode(walker.plan):
                scope = walker.top_scope(SiteIndex() if provisional else None, before=before,
                                         own=index if renamed else None)
                return handler(walker, None, params, list(args), scope, site)
        except TapSelectError:
            raise
        except _ProgramFailed as failed:
            raise failed.error from None
        except Exception as exc:  # noqa: BLE001 - our failure must not be the user's
            return _untapped(prim, args, params, exc, f"a {prim.name} loop")


def _trace_event(times, path, prim, params, site):
    """The trace events of a top-level loop (None: one in a custom rule's
    body, whose address is fixed only when its events arrive: none)."""
    with _seam.quiet():
        try:
            times.on_loop(path, prim, params, site)
        except Exception as exc:  # noqa: BLE001 - telemetry never breaks the program
            warn_once_now(f"jax-tap: a trace event failed ({type(exc).__name__}: {exc}).")


_EAGER_MAX = 64  # tapped eager loops kept compiled, per configuration


class _ProgramFailed(Exception):
    """The tapped program compiled and failed while running: the user's own
    error (a host callback that raised, a checkify error), not ours."""

    def __init__(self, error):
        super().__init__(error)
        self.error = error


def _run_eagerly(fn, args):
    """Run an eager loop's tapped program. An error raised while it runs is
    the program's own: it propagates, and the loop is not run a second time
    untapped (its host callbacks would repeat)."""
    try:
        return fn(*args)
    except _seam.RUNTIME_ERRORS as exc:
        raise _ProgramFailed(exc) from None


def _eager_tapped(walker, prim, handler, params, site, own=None):
    """The tapped loop as one jitted function, cached per loop equation.

    Eagerly JAX dispatches a loop as one compiled program, cached on its
    parameters (the body jaxpr included, which ``lax.scan`` caches per body
    function): so does this, instead of rewriting and compiling the loop
    again on every call."""
    cache = walker.eager
    try:
        key = (prim, tuple(sorted(params.items())), site, own)
        fn = cache.get(key)
    except TypeError:  # unhashable parameters: compile this once
        key, fn = None, None
    if fn is None:
        def run(*args):
            with _seam.loop_scope(), shard_mode(walker.plan):
                scope = walker.top_scope(own=own)  # (see _intercept)
                return handler(walker, None, params, list(args), scope, site)

        fn = jax.jit(run)
        if key is not None:
            if len(cache) >= _EAGER_MAX:
                cache.pop(next(iter(cache)))
            cache[key] = fn
    return fn


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
            with shard_mode(walker.plan):
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


