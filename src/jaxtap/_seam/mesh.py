"""The seam's view of many devices and processes: which mesh axes are manual
where a hop is traced (inside ``shard_map`` / ``pmap``), which device runs
each shard, and which process this is.

JAX's host callbacks do not say which device called them. Inside
``shard_map`` the shard is computed on device (``lax.axis_index`` over the
manual axes) and travels with the hop; the device is resolved on the host
from the concrete mesh ``shard_map`` was bound with, which the with-form
records while the body is traced (:func:`binding_shard_map`).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Optional, Sequence

import jax
import numpy as np
from jax import lax

from .keys import devices_state
from .versions import internal

__all__ = ["shard_map_p", "manual_axes", "shard_index", "varying_like", "replicated", "local_hop",
           "typed_sharding", "inside_shard_map", "shard_map_with_body", "shard_devices", "binding_shard_map",
           "process_tag", "Origin", "hop_origin"]

_mesh = internal("jax._src.mesh")
_distributed = internal("jax._src.distributed")
_config = internal("jax._src.config")
_shard_map_mod = internal("jax._src.shard_map")
shard_map_p = getattr(_shard_map_mod, "shard_map_p", None)


class _Bound(threading.local):
    def __init__(self):
        self.meshes = []  # the meshes of the shard_maps being bound on this thread, innermost last
        self.split_axes = None  # inside a per-shard hop: the axes its values are split along


_BOUND = _Bound()


class binding_shard_map:
    """While a ``shard_map`` is bound (its body traced) on this thread: its
    mesh, for the hops traced inside (see :func:`shard_devices`)."""

    __slots__ = ("mesh", "prev")

    def __init__(self, params):
        self.mesh = params.get("mesh")

    def __enter__(self):
        _BOUND.meshes.append(self.mesh)
        state = devices_state()
        if state is not None:
            try:
                ids = tuple(int(d.id) for d in self.mesh.devices.flat)
            except Exception:  # noqa: BLE001 - an abstract mesh: the enclosing one's devices hold
                ids = state.value
            self.prev = state.swap_local(ids)

    def __exit__(self, *exc):
        _BOUND.meshes.pop()
        state = devices_state()
        if state is not None:
            state.set_local(self.prev)
        return False


@contextlib.contextmanager
def inside_shard_map(params):
    """Trace as ``shard_map`` traces its body (the equation's ``params``):
    its axes manual, its mesh bound (for the devices of the hops traced)."""
    mesh, axes = params["mesh"], params["newly_manual_axes"]
    with _shard_map_mod._extend_axis_env(mesh, axes), \
            _mesh.use_abstract_mesh(_shard_map_mod._as_manual_mesh(mesh, axes)), \
            _config._check_vma(params["check_vma"]), binding_shard_map(params):
        yield


def shard_map_with_body(params, jaxpr, n_consts, n_extra):
    """shard_map params for a new open body taking ``n_consts`` leading and
    ``n_extra`` trailing inputs more, each replicated (``P()``)."""
    p = dict(params)
    rep = jax.sharding.PartitionSpec()
    p["jaxpr"] = jaxpr
    p["in_specs"] = (rep,) * n_consts + tuple(params["in_specs"]) + (rep,) * n_extra
    return p


def _abstract_mesh():
    try:
        return _mesh.get_abstract_mesh()
    except Exception:  # noqa: BLE001 - a JAX without it: no manual axes known
        return None


def manual_axes() -> tuple:
    """The mesh axes that are manual where we are tracing, in mesh order
    (empty outside ``shard_map`` / ``pmap``)."""
    if _BOUND.split_axes is not None:
        return _BOUND.split_axes
    am = _abstract_mesh()
    if am is None or getattr(am, "empty", True):
        return ()
    manual = set(getattr(am, "manual_axes", ()) or ())
    return tuple(a for a in am.axis_names if a in manual)


def shard_index(axes: Sequence[str]):
    """On device: this shard's flat index over ``axes`` (int32)."""
    return lax.convert_element_type(lax.axis_index(tuple(axes)), np.int32)


def _typed_mesh(sharding):
    """The mesh a value's type holds (explicit axes, outside any manual
    context), or None."""
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or getattr(mesh, "empty", True) or getattr(mesh, "manual_axes", ()):
        return None
    return mesh


def _varying(x) -> frozenset:
    mat = getattr(x, "manual_axis_type", None)
    if mat is None:
        mat = getattr(getattr(x, "aval", None), "manual_axis_type", None)
    return frozenset(getattr(mat, "varying", ()) or ())


def varying_like(x, ref):
    """``x`` (a value we create, e.g. a zeroed buffer) typed as ``ref`` (an
    aval or ShapeDtypeStruct of the values it will hold): on the same mesh
    where the type holds one (explicit axes), and varying over the manual
    axes ``ref`` varies over, so a loop may carry both (JAX checks that a
    carry's type does not change)."""
    sharding = getattr(ref, "sharding", None)
    mesh = _typed_mesh(sharding)
    if mesh is not None:
        lead = (None,) * (np.ndim(x) - len(ref.shape))  # x's leading axes (a buffer's rows) are not split
        spec = jax.sharding.PartitionSpec(*lead, *sharding.spec)
        x = jax.sharding.reshard(x, jax.sharding.NamedSharding(mesh, spec))
    axes = _varying(ref) - _varying(x)
    if not axes:
        return x
    return lax.pcast(x, tuple(sorted(axes)), to="varying")


def replicated(x):
    """``x`` (traced) unsharded, where its type says it is sharded (a mesh
    with explicit axes): what a host hop, one operand packed from many
    values, needs. Anything else is returned as it is."""
    try:
        sharding = jax.typeof(x).sharding
        spec = sharding.spec
    except Exception:  # noqa: BLE001 - no sharding in its type
        return x
    if getattr(sharding.mesh, "empty", True) or all(p is None for p in spec):
        return x
    return jax.sharding.reshard(x, jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec()))


def typed_sharding(specs) -> bool:
    """Does any of ``specs`` (ShapeDtypeStructs / avals) hold a mesh in its
    type (explicit axes)?"""
    return any(_typed_mesh(getattr(spec, "sharding", None)) is not None for spec in specs)


def _typed_layout(args):
    """(mesh, specs) of traced values whose types hold their sharding (a
    mesh with explicit axes), or None."""
    mesh, specs = None, []
    for a in args:
        try:
            sharding = jax.typeof(a).sharding
        except Exception:  # noqa: BLE001 - a Python scalar, an untyped value
            specs.append(jax.sharding.PartitionSpec())
            continue
        m = _typed_mesh(sharding)
        if m is None:
            specs.append(jax.sharding.PartitionSpec())
            continue
        if mesh is not None and m != mesh:
            return None
        mesh = m
        specs.append(sharding.spec)
    return None if mesh is None else (mesh, specs)


def local_hop(args, stage) -> bool:
    """Run ``stage(*local_args)`` once per shard of ``args`` (traced values
    sharded by their types), inside a ``shard_map`` over the mesh axes they
    are split along, so each shard ships only its own piece (no gather).
    False (nothing staged) when no argument is sharded by its type."""
    layout = _typed_layout(args)
    if layout is None:
        return False
    mesh, specs = layout
    used = {a for spec in specs for part in spec if part is not None
            for a in ((part,) if isinstance(part, str) else part)}
    if not used:
        return False
    split = tuple(a for a in mesh.axis_names if a in used)
    rest = tuple(a for a in mesh.axis_names if a not in used)

    def each(*local):
        # every axis manual (JAX cannot close over values on explicit axes),
        # one hop per distinct piece: the first device along the others
        prev, _BOUND.split_axes = _BOUND.split_axes, split
        try:
            if rest:
                lax.cond(lax.eq(shard_index(rest), np.int32(0)), lambda: (stage(*local), ())[1], lambda: ())
            else:
                stage(*local)
        finally:
            _BOUND.split_axes = prev
        return ()

    jax.shard_map(each, mesh=mesh, in_specs=tuple(specs), out_specs=())(*args)
    return True


def _concrete(candidate, names) -> Optional[object]:
    try:
        devices = getattr(candidate, "devices", None)
    except Exception:  # noqa: BLE001 - an AbstractMesh refuses to say
        return None
    if isinstance(devices, np.ndarray) and tuple(getattr(candidate, "axis_names", ())) == tuple(names):
        return candidate
    return None


def shard_devices(axes: Sequence[str]) -> Optional[list]:
    """Device ids by flat shard index over ``axes``, from the concrete mesh
    of the innermost ``shard_map`` being bound (or the context mesh of
    ``jax.set_mesh``); None when no concrete mesh is known. A shard of a
    partly automatic mesh is reported by its first device (index 0 along
    the automatic axes), where JAX runs its callbacks."""
    am = _abstract_mesh()
    if am is None or not axes:
        return None
    names = tuple(am.axis_names)
    mesh = None
    for m in reversed(_BOUND.meshes):
        mesh = _concrete(m, names)
        if mesh is not None:
            break
    if mesh is None:
        try:
            mesh = _concrete(_mesh.get_concrete_mesh(), names)
        except Exception:  # noqa: BLE001
            mesh = None
    if mesh is None:
        return None
    sizes = [mesh.devices.shape[names.index(a)] for a in axes]
    out = []
    for flat in np.ndindex(*sizes):
        where = [0] * len(names)
        for a, i in zip(axes, flat):
            where[names.index(a)] = i
        out.append(int(mesh.devices[tuple(where)].id))
    return out


def process_tag() -> Optional[int]:
    """``jax.process_index()`` once ``jax.distributed`` runs more than one
    process, else None. Read from the distributed state, never by starting
    a backend (that would break a later ``jax.distributed.initialize``)."""
    state = getattr(_distributed, "global_state", None)
    try:
        if state is None or state.client is None or int(state.num_processes) <= 1:
            return None
        return int(state.process_id)
    except Exception:  # noqa: BLE001 - a JAX that moved it: one process
        return None


class Origin:
    """Where a hop's events come from: the manual axes its shard index is
    taken over (traced on device), the device of each shard, the process."""

    __slots__ = ("axes", "devices", "process")

    def __init__(self, axes, devices, process):
        self.axes, self.devices, self.process = tuple(axes), devices, process

    def tags(self, shard=None) -> tuple:
        """``(shard, device, process)`` of an event of ``shard``."""
        device = None
        if shard is not None and self.devices is not None and 0 <= shard < len(self.devices):
            device = self.devices[shard]
        return (shard, device, self.process)


def hop_origin() -> Optional[Origin]:
    """The origin of a hop traced here; None on one device in one process
    (events then carry no origin tags)."""
    axes = manual_axes()
    process = process_tag()
    if not axes and process is None:
        return None
    return Origin(axes, shard_devices(axes), process)
