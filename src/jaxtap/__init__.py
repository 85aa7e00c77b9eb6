"""jax-tap: zero-code-change runtime telemetry for JAX control flow.

>>> import jaxtap as tap
"""
from jax.lax import scan as original_scan
from jax.lax import while_loop as original_while_loop

from ._blocks import TapBlock
from ._collectors import FlightRecorder
from ._emit import TapSelectError
from ._event import TapEvent
from ._host import TapWarning
from ._jsonl import JSONLWriter
from ._jsonl_read import iter_jsonl, read_jsonl, read_jsonl_columns
from ._record import TapContext, emergency_restore, record
from ._toolkit import on, primitives, print, watch_nan  # noqa: A004
from ._verbose import verbose
from ._version import __version__

__all__ = [
    "FlightRecorder",
    "JSONLWriter",
    "TapBlock",
    "TapContext",
    "TapEvent",
    "TapSelectError",
    "TapWarning",
    "__version__",
    "emergency_restore",
    "iter_jsonl",
    "on",
    "original_scan",
    "original_while_loop",
    "primitives",
    "print",
    "read_jsonl",
    "read_jsonl_columns",
    "record",
    "verbose",
    "watch_nan",
]
