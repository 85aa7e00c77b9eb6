"""Print bench/results.json as the Markdown tables of bench/README.md.

    python bench/table.py [results.json]
"""
import json
import os
import sys

LABELS = {
    "bare": "bare",
    "raw debug.callback (floor)": "raw `jax.debug.callback` (floor)",
    "XLA host callback, no-op (reference)": "XLA's bare host callback, same payload (reference)",
    "verbose sample_every=1": "`verbose`, sample_every=1, scalar select",
    "verbose sample_every=10": "`verbose`, sample_every=10",
    "verbose sample_every=100": "`verbose`, sample_every=100",
    "progress idiom select=()": "progress idiom `select=lambda _: ()`",
    "buffered flush_every=10": "buffered `flush_every=10` (every step recorded)",
    "buffered flush_every=100": "buffered `flush_every=100`",
    "buffered flush_every=1000": "buffered `flush_every=1000`",
    "primitive tap sin every step": "primitive tap `on(\"sin\")`, every step",
    "primitive tap sin sample_every=100": "primitive tap `on(\"sin\")`, sample_every=100",
    "primitive tap sin, buffered flush_every=100": "primitive tap `on(\"sin\")`, buffered `flush_every=100`",
    "watch_nan sin (never trips)": "`watch_nan(\"sin\")`, never trips",
    "with-form select=mean": "with-form, select=mean",
    "bare after a with-block": "bare, called after a with-block",
    "nested scans, bare": "nested scans, bare (per inner step)",
    "nested scans, verbose": "nested scans, outer and inner emit, per inner step",
    "nested scans, buffered flush_every=100": "nested scans, buffered `flush_every=100`, per inner step",
    "while, bare": "while loop, bare",
    "while, verbose": "while loop, per step",
    "while, buffered flush_every=100": "while loop, buffered `flush_every=100`",
    "vmap 8 lanes, bare": "`vmap`, 8 lanes, bare",
    "vmap 8 lanes, verbose select=leaf": "`vmap`, 8 lanes, select one leaf",
    "1 lane, verbose select=leaf": "1 lane, select one leaf",
    "vmap 8 lanes, buffered flush_every=100": "`vmap`, 8 lanes, buffered `flush_every=100` (8 events a step)",
    "buffered K=100, recorder only (columns)": "buffered `flush_every=100`, recorder only (columns)",
    "buffered K=100, JSONLWriter": "buffered `flush_every=100`, `JSONLWriter` (block writes)",
    "buffered K=100, on_block consumer": "buffered `flush_every=100`, an `on_block` consumer",
    "buffered K=1000, recorder only (columns)": "buffered `flush_every=1000`, recorder only (columns)",
    "buffered K=1000, JSONLWriter": "buffered `flush_every=1000`, `JSONLWriter` (block writes)",
    "buffered K=1000, on_block consumer": "buffered `flush_every=1000`, an `on_block` consumer",
    "JSONLWriter, whole carry, every step": "`JSONLWriter`, the whole carry (4 floats), every step",
    "JSONLWriter, whole carry, buffered K=1000": "`JSONLWriter`, the whole carry (4 floats), `flush_every=1000`",
    "grad, bare": "`grad` through the scan, bare",
    "grad, buffered flush_every=100": "`grad` through the scan, buffered `flush_every=100`",
}


def main(path):
    with open(path) as fh:
        r = json.load(fh)
    print("| arm | µs / step | first call (s) |")
    print("|---|---:|---:|")
    for name, arm in r["arms"].items():
        us = arm["us_per_step"]
        first = arm["first_call_s"]
        cell = f"{us:.3g}" if us < 10 else f"{us:.1f}"
        print(f"| {LABELS.get(name, name)} | {cell} | {'-' if first < 1e-3 else f'{first:.2f}'} |")
    print()
    print("| ratio | measured | target |")
    print("|---|---:|---:|")
    for name, value in r["ratios"].items():
        target = r["targets"].get(name)
        print(f"| {name} | {value:.3f} | {'' if target is None else target} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "results.json"))
