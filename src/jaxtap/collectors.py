"""Public collectors module, as jax-tap 0.3.1 code imports it:
``from jaxtap.collectors import FlightRecorder, JSONLWriter, read_jsonl``."""
from ._collectors import FlightRecorder, JSONLWriter, read_jsonl

__all__ = ["FlightRecorder", "JSONLWriter", "read_jsonl"]
