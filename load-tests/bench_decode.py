"""Benchmark: decoding one `flare.steps.v1` message, the plain path against the worker's.

Usage: python load-tests/bench_decode.py [--gpus 1024] [--microbatches 16] [--chunks 12]
       [--steps 4] [--ranks 256] [--rounds 15]

The messages are the simulator's, encoded as producers encode them (orjson): TP8·PP8 layouts
(1,024 GPUs by default; 8,192 is TP8·PP8·DP128) give the same ~830 ops per rank-step with
the default shape, so a smaller layout times the same messages faster to build. `--ranks`
ranks of `--steps` consecutive steps are decoded:

- old: `decode_steps` (msgspec to lists, numpy conversion, Python checks), per message;
- new: `StepsDecoder.decode` (what the worker's router uses) once its cache holds the ranks
  (steps after the first), and on the first step (cold: every rank a miss);
- v2: the same steps as `flare.steps.v2` messages (`schemas/steps_v2.py`), decoded by
  `StepsDecoder.decode_v2` once its string cache holds the ranks. The bytes per op of both
  encodings are printed too, raw and as lz4 compresses each step's messages together (the
  producers compress their batches with lz4).

Old and new alternate round by round over the same messages, so machine noise hits both;
the table gives the median over rounds of CPU µs per message and the best round (with an
8,192-GPU simulation in the process the medians vary more from run to run; the best rounds
do not). The second table times the int-column conversions that were tried, on the same
messages: from the message bytes (msgspec to Python ints then numpy, against the same msgspec
parse leaving the columns as raw text), from decoded lists, and from the columns' JSON text.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import cramjam
import msgspec
import numpy as np
import orjson
from bench_header import header

from producers.simulator import ClusterSimulator, Scenario, layout_for_gpus
from producers.simulator.emit import steps_value
from schemas.decode import decode_steps
from schemas.frame import StepFrame
from schemas.steps_decoder import StepsDecoder
from schemas.steps_v2 import encode_steps_value
from schemas.wire import StepsV1

INT_COLS = ("seq", "start_ns", "dur_ns", "bytes")


def per_message_us(fn: Callable[[bytes], object], msgs: list[bytes]) -> float:
    """CPU time of this process per message: what a worker's one-core budget pays, and less
    disturbed than wall time when other processes share the cores."""
    t0 = time.process_time()
    for raw in msgs:
        fn(raw)
    return (time.process_time() - t0) / len(msgs) * 1e6


def _same_step(a: object, b: object) -> bool:
    """Equal steps, strings compared as sequences (one decoder keeps tuples, one lists)."""
    return all(
        list(x) == list(y) if f in ("name", "group") else
        (x.dtype == y.dtype and np.array_equal(x, y)) if isinstance(x, np.ndarray) else x == y
        for f in a.__slots__  # type: ignore[attr-defined]
        for x, y in [(getattr(a, f), getattr(b, f))])


def row(name: str, samples: list[float]) -> str:
    return f"| {name} | {statistics.median(samples):.1f} | {min(samples):.1f} |"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=1024)
    ap.add_argument("--microbatches", type=int, default=16)
    ap.add_argument("--chunks", type=int, default=12)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--ranks", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    sc = Scenario(job="bench", layout=layout_for_gpus(args.gpus), steps=args.steps, seed=1,
                  microbatches=args.microbatches, chunks=args.chunks, heartbeats=False)
    sim = ClusterSimulator(sc)
    frames = [f for f in sim.run() if isinstance(f, StepFrame)]
    steps = [[orjson.dumps(steps_value(f, i)) for i in range(min(args.ranks, f.n_ranks))]
             for f in frames]
    first, warm = steps[0], [raw for s in steps[1:] for raw in s]
    n_ops = [len(msgspec.json.decode(r, type=StepsV1).ops.kind) for r in first]
    kb = statistics.mean(len(r) for r in first) / 1024

    check = StepsDecoder()
    equal = all(_same_step(check.decode(r), decode_steps(r)) for s in steps for r in s)
    v2_steps = [[encode_steps_value(orjson.loads(r)) for r in s] for s in steps]
    v2_warm = [raw for s in v2_steps[1:] for raw in s]
    v2_equal = all(_same_step(StepsDecoder().decode_v2(b), decode_steps(a))
                   for a, b in zip(warm, v2_warm, strict=True))
    old_t, new_t, cold_t, v2_t = [], [], [], []
    for _ in range(args.rounds):
        old_t.append(per_message_us(decode_steps, warm))
        dec = StepsDecoder()
        cold_t.append(per_message_us(dec.decode, first))
        new_t.append(per_message_us(dec.decode, warm))
        dec2 = StepsDecoder()
        dec2.decode_v2(v2_steps[0][0])
        for raw in v2_steps[0]:
            dec2.decode_v2(raw)
        v2_t.append(per_message_us(dec2.decode_v2, v2_warm))

    ops = [msgspec.json.decode(r, type=StepsV1).ops for r in warm[: args.ranks]]
    texts = [[bytes(r) for r in _raw_ints(raw)] for raw in warm[: args.ranks]]
    conv: dict[str, list[float]] = {k: [] for k in (
        "msgspec list[int] + np.array(list, int64) ×4", "msgspec Raw (the same parse, no ints)",
        "np.array(list, int64) ×4",
        "np.fromiter(list, int64) ×4", "np.array(4 lists, int64)",
        "np.fromstring(JSON text) ×4", "np.fromstring(4 texts joined)")}
    for _ in range(args.rounds):
        for name, fn, xs in (
            ("msgspec list[int] + np.array(list, int64) ×4", _msgspec_ints, warm[: args.ranks]),
            ("msgspec Raw (the same parse, no ints)", _raw_ops.decode, warm[: args.ranks]),
            ("np.array(list, int64) ×4", _np_array, ops),
            ("np.fromiter(list, int64) ×4", _np_fromiter, ops),
            ("np.array(4 lists, int64)", _np_stacked, ops),
            ("np.fromstring(JSON text) ×4", _fromstring_each, texts),
            ("np.fromstring(4 texts joined)", _fromstring_joined, texts),
        ):
            conv[name].append(per_message_us(fn, xs))  # type: ignore[arg-type]

    print(header(numpy=np.__version__, msgspec=msgspec.__version__))
    print(f"messages: {args.gpus}-GPU layout, {len(first)} ranks × {len(steps)} steps, "
          f"{min(n_ops)}–{max(n_ops)} ops per message (median {statistics.median(n_ops):.0f}), "
          f"{kb:.1f} KB; cached results equal to decode_steps: {equal}; "
          f"fallbacks {check.fallbacks}, hits {check.hits}, misses {check.misses}")
    print()
    print(f"| decode one message ({args.rounds} rounds) | median CPU µs | best round |")
    print("|---|---:|---:|")
    print(row("old: decode_steps", old_t))
    print(row("new: StepsDecoder, ranks cached (steady state)", new_t))
    print(row("new: StepsDecoder, first step (every rank a miss)", cold_t))
    print(row("v2: StepsDecoder.decode_v2, ranks cached (steady state)", v2_t))
    speedup = statistics.median(old_t) / statistics.median(new_t)
    print(f"\nspeed-up (steady state, medians): {speedup:.2f}×; v2 against new: "
          f"{statistics.median(new_t) / statistics.median(v2_t):.2f}×; v2 decoded equal to "
          f"decode_steps of the same step: {v2_equal}")
    total_ops = sum(len(msgspec.json.decode(r, type=StepsV1).ops.kind) for s in steps
                    for r in s)
    sizes = {name: (sum(len(r) for s in enc for r in s),
                    sum(len(cramjam.lz4.compress(b"".join(s))) for s in enc))
             for name, enc in (("v1 JSON", steps), ("v2 binary", v2_steps))}
    print("\n| encoding | bytes per op | after lz4 (a step's messages together) |")
    print("|---|---:|---:|")
    for name, (raw_b, lz4_b) in sizes.items():
        print(f"| {name} | {raw_b / total_ops:.1f} | {lz4_b / total_ops:.1f} |")
    print()
    print("| int columns of one message | median CPU µs | best round |")
    print("|---|---:|---:|")
    for name, samples in conv.items():
        print(row(name, samples))


class _IntsRaw(msgspec.Struct):
    seq: msgspec.Raw
    start_ns: msgspec.Raw
    dur_ns: msgspec.Raw
    bytes: msgspec.Raw


class _OnlyOps(msgspec.Struct):
    ops: _IntsRaw


class _IntsTyped(msgspec.Struct):
    seq: list[int]
    start_ns: list[int]
    dur_ns: list[int]
    bytes: list[int]


class _OnlyTypedOps(msgspec.Struct):
    ops: _IntsTyped


_raw_ops = msgspec.json.Decoder(_OnlyOps)
_typed_ops = msgspec.json.Decoder(_OnlyTypedOps)


def _raw_ints(raw: bytes) -> list[msgspec.Raw]:
    o = _raw_ops.decode(raw).ops
    return [getattr(o, c) for c in INT_COLS]


def _msgspec_ints(raw: bytes) -> list[np.ndarray]:
    o = _typed_ops.decode(raw).ops  # includes skipping the string columns
    return [np.array(getattr(o, c), dtype=np.int64) for c in INT_COLS]


def _np_array(o: object) -> list[np.ndarray]:
    return [np.array(getattr(o, c), dtype=np.int64) for c in INT_COLS]


def _np_fromiter(o: object) -> list[np.ndarray]:
    return [np.fromiter(getattr(o, c), dtype=np.int64) for c in INT_COLS]


def _np_stacked(o: object) -> np.ndarray:
    return np.array([getattr(o, c) for c in INT_COLS], dtype=np.int64)


def _fromstring_each(texts: list[bytes]) -> list[np.ndarray]:
    return [np.fromstring(t[1:-1], dtype=np.int64, sep=",") for t in texts]


def _fromstring_joined(texts: list[bytes]) -> np.ndarray:
    return np.fromstring(b",".join(t[1:-1] for t in texts), dtype=np.int64, sep=",")


if __name__ == "__main__":
    main()
