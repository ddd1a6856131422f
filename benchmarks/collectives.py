"""Latency of each collective of tfspmd.lax, input already on the devices.

Every contender is a pmap whose per-device program is one collective, called
on a ShardedArray placed once, with 16 B, 64 KiB and 16 MiB of float32 per
device. Two floors come first: a no-op pmap (`x + 0`, which DTensor folds to
an identity), the cost of one call, and `axis_index`, which needs no
communication. Contenders of one
size are measured side by side in interleaved rounds and compared by medians.
A pmap call returns before the devices finish (DTensor runs each device's
program asynchronously), so every timed call waits for its result.

Logical CPU devices share one host's memory and cores, so these numbers are
the overheads of each lowering (the collective ops DTensor emitted, the
copies and buffers around them), not the cost of a network.

Run: python -m benchmarks.collectives [--rounds N] [--calls N]
"""

import argparse
import os
import sys
import time

os.environ.setdefault("TFSPMD_NUM_CPU_DEVICES", "8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # pylint: disable=wrong-import-position
import tensorflow as tf  # pylint: disable=wrong-import-position

import tfspmd  # pylint: disable=wrong-import-position
from benchmarks import timing  # pylint: disable=wrong-import-position

lax = tfspmd.lax
AXIS = "i"
SIZES = (("16 B", 16), ("64 KiB", 64 << 10), ("16 MiB", 16 << 20))


def collectives(count):
  """{name: (per-device program, needs a leading axis of `count` blocks)}.

  Collectives that split a dimension over the devices get a per-device value
  of shape [count, k]; at 16 B that is rounded up to one float per device
  (32 B on 8 devices), and the recorded byte count says so.
  """
  ring = [(i, (i + 1) % count) for i in range(count)]
  # A shuffle with no fixed point and no single shift: reversal.
  reverse = list(range(count))[::-1]
  return {
      "noop (x + 0)": (lambda x: x + 0.0, False),
      "axis_index": (lambda x: x + tf.cast(lax.axis_index(AXIS), x.dtype), False),
      "psum": (lambda x: lax.psum(x, AXIS), False),
      "pmean": (lambda x: lax.pmean(x, AXIS), False),
      "pmax": (lambda x: lax.pmax(x, AXIS), False),
      "pmin": (lambda x: lax.pmin(x, AXIS), False),
      "all_gather": (lambda x: lax.all_gather(x, AXIS), False),
      "all_gather tiled": (lambda x: lax.all_gather(x, AXIS, tiled=True), False),
      "psum_scatter": (lambda x: lax.psum_scatter(x, AXIS), True),
      "psum_scatter tiled": (lambda x: lax.psum_scatter(x, AXIS, tiled=True),
                             True),
      "ppermute (ring shift)": (lambda x: lax.ppermute(x, AXIS, ring), False),
      "pshuffle (reversal)": (lambda x: lax.pshuffle(x, AXIS, reverse), False),
      "all_to_all": (lambda x: lax.all_to_all(x, AXIS, 0, 0), True),
      "pswapaxes": (lambda x: lax.pswapaxes(x, AXIS, 0), True),
  }


def per_device_shape(nbytes, count, blocked):
  floats = max(1, nbytes // 4)
  if blocked:
    return (count, max(1, floats // count))
  return (floats,)


def calls_per_round(nbytes, calls):
  """Fewer calls per round for big inputs, so a run stays within minutes."""
  return max(1, min(calls, calls * (1 << 20) // nbytes))


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--rounds", type=int, default=10)
  parser.add_argument("--calls", type=int, default=20,
                      help="calls per round, scaled down above 1 MiB per "
                      "device (1 at 16 MiB with the default)")
  options = parser.parse_args()

  count = tfspmd.device_count()
  programs = collectives(count)
  place = tfspmd.pmap(lambda x: x, axis_name=AXIS)
  results = {}
  load_before = os.getloadavg()
  started = time.perf_counter()
  for label, nbytes in SIZES:
    calls = calls_per_round(nbytes, options.calls)
    contenders, sizes, inputs = {}, {}, {}
    for name, (program, blocked) in programs.items():
      shape = per_device_shape(nbytes, count, blocked)
      if shape not in inputs:
        inputs[shape] = place(np.ones((count,) + shape, np.float32))
      placed = inputs[shape]
      mapped = tfspmd.pmap(program, axis_name=AXIS)
      mapped(placed).block_until_ready()  # Traces outside the timed calls.
      contenders[name] = (lambda mapped=mapped, placed=placed:
                          mapped(placed).block_until_ready())
      sizes[name] = 4 * int(np.prod(shape))
    samples = timing.interleaved(contenders, rounds=options.rounds,
                                 calls_per_round=calls, warmup=min(calls, 5))
    results[label] = {
        name: dict(stats, bytes_per_device=sizes[name])
        for name, stats in timing.summarize(samples).items()}

  rows = []
  for name in programs:
    row = {"collective": name}
    for label, _ in SIZES:
      row[label] = round(results[label][name]["median_us"])
    rows.append(row)
  timing.print_table(
      f"Median latency in us, {count} logical CPU devices, input on the "
      f"devices ({options.rounds} interleaved rounds per size)",
      rows, ["collective"] + [label for label, _ in SIZES])
  smallest, nbytes = SIZES[0]
  padded = [name for name in programs
            if results[smallest][name]["bytes_per_device"] > nbytes]
  if padded:
    print(f"\nAt {smallest}, {', '.join(padded)} get one float32 per device "
          f"({4 * count} B): they split a dimension over the devices.")
  path = timing.write_results("collectives", {
      "machine": timing.machine(), "devices": count,
      # Other work on a shared machine inflates the timings: keep the load.
      "load_average_1_5_15min": {"before": load_before,
                                 "after": os.getloadavg()},
      "rounds": options.rounds,
      "calls_per_round": {label: calls_per_round(nbytes, options.calls)
                          for label, nbytes in SIZES},
      "results": results})
  print(f"\nwritten to {path} ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
  main()
