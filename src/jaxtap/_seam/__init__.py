"""The jax-internals seam.

Every use of ``jax._src``, every primitive name and every equation parameter
name that jax-tap depends on lives in this package, so that a JAX upgrade
touches it alone; it speaks one vocabulary to the rest of jax-tap whatever
the JAX version (0.10.2 to 0.12.x are tested). ``tests/test_seam.py`` pins
each assumption and fails loudly, naming it, on a JAX that breaks one.

* :mod:`.versions` - the JAX version, the tested range, guarded imports of
  internals;
* :mod:`.eqns` - primitives, their names, the parameters read and written;
* :mod:`.staging` - trace, bind and evaluate equations as JAX does;
* :mod:`.stack` - interception, call-stack and trace heuristics;
* :mod:`.keys` - the jit-key config states that keep blocks' compilations apart;
* :mod:`.backward` - cotangent taps: scan's autodiff rules wrapped while a
  scope asks, each backward scan mapped to its forward twin;
* :mod:`.mesh` - many devices and processes: manual axes, shard indices,
  the device of each shard, the process;
* :mod:`.forwarding` - carry leaves JAX's loop front ends moved out of the
  carry, put back where ``select`` expects them;
* :mod:`.callback` - the host callback every hop stages (``jax.debug.callback``'s
  custom call, without its per-call host cost);
* :mod:`.monitor` - compile-time signals: top-level jit calls, JAX's
  monitoring spans, weak-type promotions (jit-event and trace-time taps).
"""
from .backward import *  # noqa: F401,F403
from .callback import *  # noqa: F401,F403
from .forwarding import *  # noqa: F401,F403
from .keys import *  # noqa: F401,F403
from .eqns import *  # noqa: F401,F403
from .mesh import *  # noqa: F401,F403
from .stack import *  # noqa: F401,F403
from .staging import *  # noqa: F401,F403
from .versions import (JAX_VERSION, JAX_VERSION_TEXT, JOIN_BY_DTYPE, MISSING, TESTED_RANGE,  # noqa: F401
                       check_at_import, tested)
from . import monitor  # noqa: F401,E402  (compile-time signals: jit calls, spans, promotions)
