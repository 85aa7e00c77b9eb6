"""jit-key config states: what keeps a block's compilations apart.

JAX puts some config states in every jit cache key (and trace context).
jax-tap registers two of its own: a block's *token* (one per distinct
device-side configuration, per thread), so that functions jitted before a
block are traced again inside it and hit their clean compilation after it;
and the devices of the ``shard_map`` being traced (``.mesh``). Both are
registered when the first block or wrapper is made, never at import.
"""
from __future__ import annotations

import threading

from .._host import warn_once_now
from .stack import BUSY
from .versions import JAX_VERSION_TEXT, MISSING, TESTED_RANGE, internal

__all__ = [
    "jit_key_state",
    "LazyKeyState",
    "token_state",
    "devices_state",
    "register_key_states",
    "can_intercept",
    "interception_unavailable",
    "set_thread_token",
    "set_global_token",
    "thread_token",
    "swap_thread_token",
    "restore_thread_token",
    "token_state_in_trace_context",
]

_config = internal("jax._src.config")


def jit_key_state(name: str, doc: str):
    """A thread-local config state that JAX includes in every jit cache key
    (and trace context); None, recorded in MISSING, on a JAX without them."""
    try:
        return _config.string_or_object_state(name, None, doc, include_in_jit_key=True,
                                              include_in_trace_context=True)
    except Exception:  # noqa: BLE001 - a JAX without it
        MISSING.append("jax._src.config.string_or_object_state")
        return None


class LazyKeyState:
    """A :func:`jit_key_state` registered when first asked for (see
    :func:`register_key_states`), not at import: JAX keys its caches on
    every such state, so a new one makes each function compiled before it
    compile once more (importing jax-tap late in a notebook must not re-pay
    the model's compiles; the first block does, once)."""

    _lock = threading.Lock()

    def __init__(self, name: str, doc: str):
        self.name, self.doc, self.made = name, doc, []  # made: [the state] ([None]: this JAX has none)

    def get(self, create: bool = True):
        """The state (None: not registered yet and not ``create``, or a JAX without such states)."""
        if self.made:
            return self.made[0]
        if not create:
            return None
        with self._lock:
            if not self.made:
                self.made.append(jit_key_state(self.name, self.doc))
        return self.made[0]


# While a with-block is active its token separates tapped from clean compilations.
token_state = LazyKeyState("jaxtap_tap_token", "jax-tap: the active tap configuration (internal; part of the jit key).").get
# The devices of the shard_map being bound: a jitted function traced inside
# it (its hops resolve shard -> device when traced) is traced again for
# another mesh of the same shape (see ``.mesh``).
devices_state = LazyKeyState("jaxtap_mesh_devices", "jax-tap: the devices of the shard_map being traced "
                                                    "(internal).").get


def register_key_states() -> None:
    """Register both states now: when a block or wrapper is made, before any
    trace (one registered while a jit traces would change that jit's own
    key between its first call and its second, and compile it again)."""
    token_state()
    devices_state()


def can_intercept() -> bool:
    """False on a JAX without the jit-key state interception needs: blocks
    and wrapped calls then run their code untapped (see ``_lens``)."""
    return token_state() is not None


def interception_unavailable(what) -> bool:
    """True, after one warning, on a JAX without the jit-key state both forms
    need: ``what`` then runs untapped."""
    if can_intercept():
        return False
    missing = f" (missing: {', '.join(MISSING[:4])})" if MISSING else ""
    warn_once_now(f"jax-tap: this JAX ({JAX_VERSION_TEXT}) lacks the jit-key state jax-tap needs{missing}; "
                  f"{what} runs untapped. Install a tested JAX ({TESTED_RANGE}).")
    return True


def set_thread_token(token) -> None:
    """This thread's token; None removes the thread's own value, so the
    thread sees the global one again."""
    state = token_state(create=token is not None)
    if state is not None:
        state.set_local(_config.config_ext.unset if token is None else token)
    BUSY.token_sets += 1


def set_global_token(token) -> None:
    """The token threads without a block of their own see (None: clean)."""
    state = token_state(create=token is not None)
    if state is not None:
        state.set_global(token)


def thread_token():
    state = token_state(create=False)
    return None if state is None else state.value


def swap_thread_token(token):
    """Set this thread's token, returning the one it replaces (None where
    no block ever registered the state: nothing to swap)."""
    state = token_state(create=False)
    return None if state is None else state.swap_local(token)


def restore_thread_token(prev) -> None:
    """Undo :func:`swap_thread_token` (``prev``: what it returned)."""
    state = token_state(create=False)
    if state is not None:
        state.set_local(prev)


def token_state_in_trace_context(token) -> bool:
    """True when ``token`` shows up in JAX's trace context (the jit key)."""
    prev = token_state().swap_local(token)
    try:
        return any(x is token for x in _config.trace_context())
    finally:
        token_state().set_local(prev)
