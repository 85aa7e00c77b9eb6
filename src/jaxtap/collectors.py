"""Public collectors module, as jax-tap 0.3.1 code imports it:
``from jaxtap.collectors import FlightRecorder, JSONLWriter, read_jsonl``."""
from ._collectors import FlightRecorder
from ._jsonl import JSONLWriter
from ._jsonl_read import iter_jsonl, read_jsonl, read_jsonl_columns

__all__ = ["FlightRecorder", "JSONLWriter", "read_jsonl", "iter_jsonl", "read_jsonl_columns"]
