"""JAX's compile-time signals, as jax-tap's jit-event and trace-time taps
read them: top-level jit calls (``pjit._infer_params``), JAX's monitoring
spans and events (tracing / lowering / compiling, the persistent cache) and
weak-type promotions of loop carries (``loops._promote_weak_typed_input``).

Each hook is installed while some scope asks for it and removed one by one
when none does: no JAX flag is touched, no other listener is cleared.
"""
from __future__ import annotations

import os
import re
import threading

from .versions import internal

__all__ = [
    "TRACE_SPAN",
    "LOWER_SPAN",
    "COMPILE_SPAN",
    "CACHE_USED",
    "CACHE_HIT",
    "CACHE_MISS",
    "watch_jit",
    "watch_traces",
    "cost_analysis",
    "watch_promotions",
    "watch_compiled_calls",
    "untapped_loops",
    "jit_function_site",
    "span_name",
    "is_user_file",
    "trace_context",
    "aval_text",
    "count_eqns",
    "has_host_callbacks",
    "pjit_jaxpr",
]

_pjit = internal("jax._src.pjit")
_monitoring = internal("jax._src.monitoring")
_dispatch = internal("jax._src.dispatch")
_loops = internal("jax._src.lax.control_flow.loops")
_compiler = internal("jax._src.compiler")
_core = internal("jax._src.core")
_config = internal("jax._src.config")
_source_info = internal("jax._src.source_info_util")
_stages = internal("jax._src.stages")

TRACE_SPAN = getattr(_dispatch, "JAXPR_TRACE_EVENT", "/jax/core/compile/jaxpr_trace_duration")
LOWER_SPAN = getattr(_dispatch, "JAXPR_TO_MLIR_MODULE_EVENT", "/jax/core/compile/jaxpr_to_mlir_module_duration")
COMPILE_SPAN = getattr(_dispatch, "BACKEND_COMPILE_EVENT", "/jax/core/compile/backend_compile_duration")
CACHE_USED = "/jax/compilation_cache/compile_requests_use_cache"
CACHE_HIT = "/jax/compilation_cache/cache_hits"
CACHE_MISS = "/jax/compilation_cache/cache_misses"
_CALLBACKS = frozenset({"debug_callback", "io_callback", "pure_callback", "callback"})


class _Hooks:
    lock = threading.Lock()
    jit = None  # (on_call, on_span, on_event, on_executable) while watched
    trace = None  # on_trace() while watched
    promote = None  # on_promote(n_promoted) while watched
    compiled = None  # (on_call(executable), on_compiled(executable)) while watched
    orig_compiled_call = None
    orig_lowered_compile = None
    orig_infer = None
    orig_compile = None
    orig_promote = None


def _infer_params(fun, ji, args, kwargs):
    traced = _Hooks.trace
    if traced is not None:
        try:
            traced()
        except Exception:  # noqa: BLE001 - never breaks a jit call
            pass
    hooks = _Hooks.jit
    after = None
    if hooks is not None:
        try:
            after = hooks[0](fun, ji, args, kwargs, _core.trace_state_clean())
        except Exception:  # noqa: BLE001 - telemetry never breaks a jit call
            after = None
    out = _Hooks.orig_infer(fun, ji, args, kwargs)
    if after is not None:
        try:
            after(out[0])
        except Exception:  # noqa: BLE001
            pass
    return out


def _compile_or_get_cached(*args, **kwargs):
    executable = _Hooks.orig_compile(*args, **kwargs)
    hooks = _Hooks.jit
    if hooks is not None:
        try:
            hooks[3](executable)  # inside the compile span: the span's end comes after
        except Exception:  # noqa: BLE001
            pass
    return executable


_compile_or_get_cached.__jaxtap_patch__ = True


def cost_analysis(executable):
    """XLA's cost analysis of a compiled executable (flops, bytes accessed),
    or None where the backend gives none."""
    try:
        cost = executable.cost_analysis()
        if isinstance(cost, (list, tuple)):
            cost = cost[0] if cost else None
        if not cost:
            return None
        return {k: float(cost[k]) for k in ("flops", "transcendentals", "bytes accessed") if k in cost}
    except Exception:  # noqa: BLE001
        return None


def _span(event, start, end, **kwargs):
    hooks = _Hooks.jit
    if hooks is not None:
        hooks[1](event, start, end, kwargs.get("fun_name"))


def _event(event, **kwargs):
    hooks = _Hooks.jit
    if hooks is not None and event.startswith("/jax/compilation_cache/"):
        hooks[2](event)


def watch_jit(on_call, on_span, on_event, on_executable=None) -> bool:
    """Observe jit calls, compile spans and compiled executables (None:
    stop). False when this JAX lacks what it takes (nothing is installed
    then)."""
    if _pjit is None or _monitoring is None or not hasattr(_pjit, "_infer_params"):
        return False
    with _Hooks.lock:
        if on_call is None:
            if _Hooks.jit is not None:
                _Hooks.jit = None
                _patch_infer()
                if _compiler is not None and getattr(_compiler.compile_or_get_cached, "__jaxtap_patch__", False):
                    _compiler.compile_or_get_cached = _Hooks.orig_compile
                for registry, fn in ((_monitoring._event_time_span_listeners, _span),
                                     (_monitoring._event_listeners, _event)):
                    while fn in registry:
                        registry.remove(fn)  # ours alone: clear_event_listeners() would take others'
            return True
        if _Hooks.jit is None:
            _Hooks.jit = (on_call, on_span, on_event, on_executable or (lambda exe: None))
            _patch_infer()
            if _compiler is not None and hasattr(_compiler, "compile_or_get_cached"):
                _Hooks.orig_compile = _compiler.compile_or_get_cached
                _compiler.compile_or_get_cached = _compile_or_get_cached
            _monitoring.register_event_time_span_listener(_span)
            _monitoring.register_event_listener(_event)
        _Hooks.jit = (on_call, on_span, on_event, on_executable or (lambda exe: None))
        return True


_infer_params.__jaxtap_patch__ = True


def watch_traces(on_trace) -> bool:
    """Call ``on_trace()`` before JAX infers a jit call's parameters (a
    call its compiled-code fast path did not answer: a trace, or a cache
    lookup in Python); None: stop. False when this JAX lacks the hook."""
    if _pjit is None or not hasattr(_pjit, "_infer_params"):
        return False
    with _Hooks.lock:
        _Hooks.trace = on_trace
        _patch_infer()
    return True


def _patch_infer() -> None:
    """Ours in place of ``_infer_params`` exactly while a hook wants it (under the lock)."""
    ours = getattr(_pjit._infer_params, "__jaxtap_patch__", False)
    if (_Hooks.jit is not None or _Hooks.trace is not None) and not ours:
        _Hooks.orig_infer, _pjit._infer_params = _pjit._infer_params, _infer_params
    elif _Hooks.jit is None and _Hooks.trace is None and ours:
        _pjit._infer_params = _Hooks.orig_infer


def _promote(in_val, in_aval, out_aval):
    out = _Hooks.orig_promote(in_val, in_aval, out_aval)
    hook = _Hooks.promote
    if hook is not None and out[1]:
        try:
            hook()
        except Exception:  # noqa: BLE001
            pass
    return out


def watch_promotions(on_promote) -> bool:
    """Call ``on_promote()`` on this JAX's promotion of a weakly typed loop
    carry (the loop's body is then traced twice); None stops."""
    if _loops is None or not hasattr(_loops, "_promote_weak_typed_input"):
        return False
    with _Hooks.lock:
        if on_promote is None:
            if _Hooks.promote is not None:
                _Hooks.promote = None
                if _loops._promote_weak_typed_input is _promote:
                    _loops._promote_weak_typed_input = _Hooks.orig_promote
            return True
        if _Hooks.promote is None:
            _Hooks.orig_promote = _loops._promote_weak_typed_input
            _loops._promote_weak_typed_input = _promote
        _Hooks.promote = on_promote
        return True


def _compiled_call(self, *args, **kwargs):
    hooks = _Hooks.compiled
    if hooks is not None:
        try:
            hooks[0](self)
        except Exception:  # noqa: BLE001 - telemetry never breaks a call
            pass
    return _Hooks.orig_compiled_call(self, *args, **kwargs)


def _lowered_compile(self, *args, **kwargs):
    out = _Hooks.orig_lowered_compile(self, *args, **kwargs)
    hooks = _Hooks.compiled
    if hooks is not None:
        try:
            hooks[1](out)
        except Exception:  # noqa: BLE001
            pass
    return out


_compiled_call.__jaxtap_patch__ = _lowered_compile.__jaxtap_patch__ = True


def watch_compiled_calls(on_call, on_compiled=None) -> bool:
    """Call ``on_call(executable)`` before each call of an ahead-of-time
    compiled executable (``jax.jit(f).lower(x).compile()``), and
    ``on_compiled(executable)`` when one is compiled; None stops."""
    compiled, lowered = getattr(_stages, "Compiled", None), getattr(_stages, "Lowered", None)
    if compiled is None or lowered is None or not callable(getattr(lowered, "compile", None)):
        return False
    with _Hooks.lock:
        if on_call is None:
            if _Hooks.compiled is not None:
                _Hooks.compiled = None
                if getattr(compiled.__call__, "__jaxtap_patch__", False):
                    compiled.__call__ = _Hooks.orig_compiled_call
                if getattr(lowered.compile, "__jaxtap_patch__", False):
                    lowered.compile = _Hooks.orig_lowered_compile
            return True
        if _Hooks.compiled is None:
            _Hooks.orig_compiled_call, _Hooks.orig_lowered_compile = compiled.__call__, lowered.compile
            compiled.__call__, lowered.compile = _compiled_call, _lowered_compile
        _Hooks.compiled = (on_call, on_compiled or (lambda exe: None))
        return True


def untapped_loops(executable) -> bool:
    """Does a compiled executable hold a loop that no lens rewrote (its
    program names none of jax-tap's own operations)? False when unsure."""
    try:
        text = executable.as_text()
    except Exception:  # noqa: BLE001 - a backend without HLO text
        return False
    return bool(text) and re.search(r"\bwhile\(", text) is not None and "jaxtap_" not in text


_SOURCEINFO = re.compile(r"^(?P<name>.*) at (?P<file>.*):(?P<line>\d+)$")


def span_name(fun) -> str:
    """The name JAX's monitoring spans give a jitted function (``f``; its
    lowering and compiling spans say ``jit(f)``)."""
    name = getattr(fun, "__name__", None)
    if name is not None:
        return name
    inner = getattr(fun, "func", None)  # functools.partial
    return span_name(inner) if inner is not None and callable(inner) else "<unnamed function>"


def jit_function_site(fun, ji):
    """(name, file, line) of a jitted function (file/line None when unknown):
    JAX's source info, else the code of the function, of what a partial
    wraps, or of a callable object's ``__call__`` (named by its class)."""
    text = getattr(ji, "fun_sourceinfo", None) or ""
    m = _SOURCEINFO.match(text)
    name = span_name(fun)
    if name == "<unnamed function>":
        name = type(getattr(fun, "func", fun)).__name__
    if m is not None:
        return name, m.group("file"), int(m.group("line"))
    target = getattr(fun, "func", fun)  # functools.partial
    code = getattr(target, "__code__", None) or getattr(getattr(type(target), "__call__", None), "__code__", None)
    if code is None:
        return name, None, None
    return name, code.co_filename, code.co_firstlineno


def is_user_file(path) -> bool:
    """Is ``path`` neither JAX's nor jax-tap's (JAX's own notion of a user file)?"""
    if path is None or _source_info is None:
        return False
    return bool(_source_info.is_user_filename(os.path.abspath(path)))


def trace_context():
    """JAX's trace context (configuration that keys every jit cache)."""
    try:
        return _config.trace_context()
    except Exception:  # noqa: BLE001
        return None


def aval_text(aval) -> str:
    """``f32[8]``, ``f32[] weak`` for a weakly typed value."""
    try:
        text = aval.str_short(short_dtypes=True)
    except Exception:  # noqa: BLE001
        text = str(aval)
    return text + (" weak" if getattr(aval, "weak_type", False) else "")


def _subjaxprs(eqn):
    from .eqns import subjaxprs_of
    return subjaxprs_of(eqn.params)


def count_eqns(jaxpr) -> int:
    """Equations in ``jaxpr``, sub-jaxprs included."""
    n = 0
    for eqn in jaxpr.eqns:
        n += 1
        for sub in _subjaxprs(eqn):
            n += count_eqns(sub)
    return n


def has_host_callbacks(jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _CALLBACKS or any(has_host_callbacks(s) for s in _subjaxprs(eqn)):
            return True
    return False


def pjit_jaxpr(p):
    """The open jaxpr of a top-level jit call's parameters (or None)."""
    try:
        return p.params["jaxpr"].jaxpr
    except Exception:  # noqa: BLE001
        return None
