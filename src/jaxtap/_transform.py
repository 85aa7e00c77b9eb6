"""The transform: walk a jaxpr, rewrite loops and tapped primitives, re-emit.

A closed jaxpr is rewritten by *re-tracing an interpreter* over it: every
equation the user wrote is bound again with its own parameters, source info
and context (so XLA sees the user's arithmetic unchanged), while loops get an
extra int32 step counter in their carry and a tap at the end of their body.
One small handler per primitive family decides how to descend.

Addressing (see README, "Addresses"):

* a segment is ``name[index]``; loops are ``scan`` / ``while``, primitive
  taps use the primitive's name, ``jit`` marks a jitted function *inside* a
  loop body;
* inside a loop body, indices count occurrences of that name in the body,
  in program order; ``cond``/``switch`` branches, ``jax.checkpoint`` and
  ``custom_jvp``/``custom_vjp`` bodies are transparent (they continue the
  count of the body that holds them);
* outside any loop, jits are transparent too, and an index is the order in
  which *distinct source lines* first appear, so the same loop gets the same
  address on every call and in both the wrapping and the with-form.
"""
from __future__ import annotations

import numpy as np
from jax import lax

from . import _seam
from ._emit import emit, finite_flag, run_select
from ._options import Plan, PrimTap

_INT32 = None


def _int32_aval():
    global _INT32
    if _INT32 is None:
        _INT32 = _seam.abstractify(np.int32(0))
    return _INT32


class SiteIndex:
    """Top-level addressing: one index per distinct source site, per name."""

    def __init__(self):
        self._by_site: dict = {}
        self._next: dict = {}
        self._anon = 0

    def index(self, name, site):
        if site is None:
            self._anon += 1
            site = ("<anonymous>", self._anon)
        key = (name, site)
        if key not in self._by_site:
            n = self._next.get(name, 0)
            self._by_site[key] = n
            self._next[name] = n + 1
        return self._by_site[key]


class Counter:
    """Nested addressing: indices count occurrences in program order."""

    def __init__(self):
        self._next: dict = {}

    def index(self, name, site):
        n = self._next.get(name, 0)
        self._next[name] = n + 1
        return n


class Scope:
    """Where the walk is: address prefix, numbering, innermost loop's step."""

    __slots__ = ("prefix", "counter", "in_loop", "step", "total", "top")

    def __init__(self, prefix, counter, in_loop, step, total, top=None):
        self.prefix = prefix
        self.counter = counter
        self.in_loop = in_loop
        self.step = step  # traced int32 of the innermost loop, or None
        self.total = total
        self.top = top  # (name, site) of the outermost segment of `prefix`

    def address(self, name, site):
        """(path, top) of the next `name` node at this level."""
        seg = f"{name}[{self.counter.index(name, site)}]"
        if self.prefix:
            return f"{self.prefix}/{seg}", self.top
        return seg, (name, site)

    def child(self, prefix, counter, step, total, top, in_loop=True):
        return Scope(prefix, counter, in_loop, step, total, top)


class Sinks:
    """Where the host halves deliver: set up by verbose() or record()."""

    def __init__(self, carry, prims, guard):
        self.carry = carry  # deliver(event, top) for carry events
        self.prims = prims  # list of deliver(event, top), one per PrimTap
        self.guard = guard


class Walker:
    """One rewrite configuration: a plan, its sinks, its top-level index."""

    def __init__(self, plan: Plan, sinks: Sinks, sites: SiteIndex):
        self.plan = plan
        self.sinks = sinks
        self.sites = sites
        self._needs: dict = {}
        self._tap_names = plan.tapped_names

    # -------------------------------------------------------------- decisions
    def top_scope(self):
        return Scope("", self.sites, False, None, 1)

    def emits_carry(self, kind, path) -> bool:
        p = self.plan
        if not p.emit_carry or kind not in p.kinds:
            return False
        if p.max_depth is not None and path.count("/") > p.max_depth:
            return False
        if p.where is not None:
            try:
                return bool(p.where(path))
            except Exception as exc:  # noqa: BLE001 - a broken where is bad input
                raise TypeError(f"jax-tap: your `where` raised on path {path!r}: {exc!r}") from None
        return True

    def needs(self, jaxpr) -> bool:
        """Does anything inside `jaxpr` need rewriting?"""
        key = id(jaxpr)
        hit = self._needs.get(key)
        if hit is not None and hit[0] is jaxpr:
            return hit[1]
        result = False
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name in self._tap_names:
                result = True
            elif name in (_seam.SCAN, _seam.WHILE) and self.plan.emit_carry:
                result = True
            elif name in HANDLERS:
                result = any(self.needs(sub) for sub in _seam.subjaxprs_of(eqn.params))
            if result:
                break
        self._needs[key] = (jaxpr, result)
        return result

    def eqn_needs(self, eqn) -> bool:
        if eqn.primitive.name in (_seam.SCAN, _seam.WHILE) and self.plan.emit_carry:
            return True
        return any(self.needs(sub) for sub in _seam.subjaxprs_of(eqn.params))

    # -------------------------------------------------------------- rewriting
    def rewrite_closed(self, closed, scope_fn, extra_avals=()):
        """Re-trace `closed` through the interpreter (plus extra inputs)."""
        n = len(closed.in_avals)

        def fn(*args):
            scope = scope_fn(args[n:])
            return interpret(self, closed.jaxpr, closed.consts, args[:n], scope)

        return _seam.trace_closed(fn, list(closed.in_avals) + list(extra_avals))

    def emit_carry(self, path, top, total, step, leaves):
        p = self.plan
        emit(
            self.sinks.carry, self.sinks.guard, path=path, top=top, total=total, kind="carry",
            step=step, sample_every=p.sample_every,
            payload_fn=lambda: run_select(p.select, p.select_path, leaves, path),
        )

    def emit_prims(self, eqn_name, site, outs, scope):
        taps = [(i, t) for i, t in enumerate(self.plan.prim_taps) if t.prim == eqn_name]
        if not taps:
            return
        path, top = scope.address(eqn_name, site)
        step = scope.step if scope.step is not None else np.int32(0 if not scope.in_loop else -1)
        every = self.plan.sample_every if scope.step is not None else 1
        for i, t in taps:
            chosen = tuple(outs) if t.output is None else (outs[t.output],)
            emit(
                self.sinks.prims[i], self.sinks.guard, path=path, top=top, total=scope.total,
                kind="primitive", step=step, sample_every=every,
                payload_fn=_prim_payload(t, chosen, path),
            )


def _prim_payload(t: PrimTap, chosen, path):
    def payload():
        if t.mode == "nan":
            return finite_flag(chosen)
        if t.select is not None:
            return run_select(t.select, False, chosen, path, what=f"outputs of {t.prim}")
        return chosen[0] if len(chosen) == 1 else chosen

    return payload


# ------------------------------------------------------------------ interpreter
def interpret(walker: Walker, jaxpr, consts, args, scope: Scope):
    env = {}

    def read(v):
        return v.val if isinstance(v, _seam.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x
    for v, x in zip(jaxpr.invars, args):
        env[v] = x
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        handler = HANDLERS.get(eqn.primitive.name)
        if handler is not None and walker.eqn_needs(eqn):
            outs = handler(walker, eqn, eqn.params, invals, scope, _seam.site_of_eqn(eqn))
        else:
            outs = _seam.eval_eqn(eqn, invals)
        if eqn.primitive.name in walker._tap_names:
            walker.emit_prims(eqn.primitive.name, _seam.site_of_eqn(eqn), outs, scope)
        for v, x in zip(eqn.outvars, outs):
            if not isinstance(v, _seam.DropVar):
                env[v] = x
    return [read(v) for v in jaxpr.outvars]


def _bind(eqn, prim, invals, params):
    if eqn is None:
        out = _seam.bind_original(prim, invals, params)
        return list(out) if prim.multiple_results else [out]
    return _seam.bind_with_params(eqn, prim, invals, params)


def _one():
    return np.int32(1)


# ------------------------------------------------------------------ handlers
def handle_scan(walker, eqn, params, invals, scope, site):
    body, nc, ncar, length = _seam.scan_parts(params)
    path, top = scope.address("scan", site)
    emits = walker.emits_carry("scan", path)
    if not emits and not walker.needs(body.jaxpr):
        return _bind(eqn, _seam.scan_p, invals, params)

    def fn(*args):
        consts, counter, rest = args[:nc], args[nc], args[nc + 1:]
        child = scope.child(path, Counter(), counter, length, top)
        outs = interpret(walker, body.jaxpr, body.consts, list(consts) + list(rest), child)
        if emits:
            walker.emit_carry(path, top, length, counter, outs[:ncar])
        return [lax.add(counter, _one())] + list(outs)

    avals = list(body.in_avals)
    new_body = _seam.trace_closed(fn, avals[:nc] + [_int32_aval()] + avals[nc:])
    new_params = _seam.scan_with_counter(params, new_body)
    outs = _bind(eqn, _seam.scan_p, list(invals[:nc]) + [np.int32(0)] + list(invals[nc:]), new_params)
    return outs[1:]


def handle_while(walker, eqn, params, invals, scope, site):
    cond, cnc, body, bnc = _seam.while_parts(params)
    path, top = scope.address("while", site)
    emits = walker.emits_carry("while", path)
    if not emits and not walker.needs(body.jaxpr):
        return _bind(eqn, _seam.while_p, invals, params)

    def cond_fn(*args):
        return _seam.eval_jaxpr(cond.jaxpr, cond.consts, *args[:cnc], *args[cnc + 1:])

    def body_fn(*args):
        consts, counter, carry = args[:bnc], args[bnc], args[bnc + 1:]
        child = scope.child(path, Counter(), counter, None, top)
        outs = interpret(walker, body.jaxpr, body.consts, list(consts) + list(carry), child)
        if emits:
            walker.emit_carry(path, top, None, counter, outs)
        return [lax.add(counter, _one())] + list(outs)

    ca, ba = list(cond.in_avals), list(body.in_avals)
    new_cond = _seam.trace_closed(cond_fn, ca[:cnc] + [_int32_aval()] + ca[cnc:])
    new_body = _seam.trace_closed(body_fn, ba[:bnc] + [_int32_aval()] + ba[bnc:])
    new_params = _seam.while_with_counter(params, new_cond, new_body)
    args = list(invals[:cnc + bnc]) + [np.int32(0)] + list(invals[cnc + bnc:])
    return _bind(eqn, _seam.while_p, args, new_params)[1:]


def _child_scope_fn(scope, prefix, counter, threaded, top=None):
    def make(extra):
        step = extra[0] if threaded else None
        return scope.child(prefix, counter, step, scope.total, top or scope.top, in_loop=scope.in_loop)

    return make


def handle_jit(walker, eqn, params, invals, scope, site):
    body = _seam.jit_body(params)
    if scope.in_loop:
        (prefix, top), counter = scope.address("jit", site), Counter()
    else:
        prefix, top, counter = scope.prefix, scope.top, scope.counter
    threaded = scope.step is not None
    new_body = walker.rewrite_closed(
        body, _child_scope_fn(scope, prefix, counter, threaded, top), [_int32_aval()] if threaded else []
    )
    new_params = _seam.jit_with_body(params, new_body, extra_inputs=1 if threaded else 0)
    return _bind(eqn, _seam.jit_p, list(invals) + ([scope.step] if threaded else []), new_params)


def handle_cond(walker, eqn, params, invals, scope, site):
    threaded = scope.step is not None
    branches = [
        walker.rewrite_closed(
            br, _child_scope_fn(scope, scope.prefix, scope.counter, threaded),
            [_int32_aval()] if threaded else [],
        )
        for br in _seam.cond_branches(params)
    ]
    new_params = _seam.cond_with_branches(params, branches)
    return _bind(eqn, _seam.cond_p, list(invals) + ([scope.step] if threaded else []), new_params)


def handle_remat(walker, eqn, params, invals, scope, site):
    threaded = scope.step is not None
    closed = walker.rewrite_closed(
        _seam.remat_body(params), _child_scope_fn(scope, scope.prefix, scope.counter, threaded),
        [_int32_aval()] if threaded else [],
    )
    new_params, consts = _seam.remat_with_body(params, closed)
    args = list(consts) + list(invals) + ([scope.step] if threaded else [])
    return _bind(eqn, _seam.remat_p, args, new_params)


def _handle_call(prim):
    def handle(walker, eqn, params, invals, scope, site):
        # Custom-derivative bodies keep their signature (their rules are
        # untouched), so the step is not threaded in: see README boundaries.
        inner = scope.child(scope.prefix, scope.counter, None, scope.total, scope.top, in_loop=scope.in_loop)
        body = walker.rewrite_closed(_seam.call_body(params), lambda extra: inner)
        return _bind(eqn, prim, invals, _seam.call_with_body(params, body))

    return handle


HANDLERS = {
    _seam.SCAN: handle_scan,
    _seam.WHILE: handle_while,
    _seam.JIT: handle_jit,
    _seam.COND: handle_cond,
    _seam.REMAT: handle_remat,
    _seam.CUSTOM_JVP: _handle_call(_seam.custom_jvp_call_p),
    _seam.CUSTOM_VJP: _handle_call(_seam.custom_vjp_call_p),
    _seam.CLOSED_CALL: _handle_call(_seam.closed_call_p),
}


def rewrite_program(walker: Walker, closed):
    """Rewrite a whole traced program (the B-form's entry point)."""
    if not walker.needs(closed.jaxpr):
        return closed
    return walker.rewrite_closed(closed, lambda extra: walker.top_scope())
