"""What each route of an op costs, against the same math on pfor's route.

Three pairs, each a pmap over 8 logical CPU devices on device-resident
input, timed until the result exists on the devices (each result is
fetched once and checked against NumPy first):
  - replicated: `tf.math.cumprod`, which DTensor has no expander for, so
    every device computes it for every device; against
    `exp(cumsum(log x))`, the same values on pfor's route.
  - per position: `tf.math.bincount(ids, minlength=E, maxlength=E)`, which
    pfor has no converter for, so each device counts every device's ids;
    against a sum of one-hot rows, the same counts on pfor's route.
  - dynamic slice: `tf.slice` at an offset from `axis_index` (a gather of
    each device's own rows); against the slice at offset 0.

Run: python benchmarks/op_routes.py [--rounds N] [--rows N]
"""

import argparse
import os
import sys

os.environ.setdefault("TFSPMD_NUM_CPU_DEVICES", "8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # pylint: disable=wrong-import-position
import tensorflow as tf  # pylint: disable=wrong-import-position

import tfspmd  # pylint: disable=wrong-import-position
from benchmarks import timing  # pylint: disable=wrong-import-position
from tfspmd import lax  # pylint: disable=wrong-import-position

BINS = 16


def _pairs(count, rows):
  rng = np.random.default_rng(0)
  positive = rng.uniform(0.9, 1.1, (count, rows, 256)).astype(np.float32)
  ids = rng.integers(0, BINS, (count, rows * 256)).astype(np.int32)
  place = tfspmd.pmap(lambda v: v)
  positive, ids = place(positive), place(ids)
  half = rows // 2
  return {
      "replicated: cumprod": (
          lambda v: tf.math.cumprod(v, axis=1), positive,
          np.cumprod(np.asarray(positive), axis=2)),
      "pfor: exp(cumsum(log))": (
          lambda v: tf.exp(tf.math.cumsum(tf.math.log(v), axis=1)), positive,
          np.cumprod(np.asarray(positive), axis=2)),
      "per position: bincount": (
          lambda i: tf.math.bincount(i, minlength=BINS, maxlength=BINS), ids,
          np.stack([np.bincount(row, minlength=BINS)
                    for row in np.asarray(ids)])),
      "pfor: one-hot sum": (
          lambda i: tf.reduce_sum(tf.one_hot(i, BINS, dtype=tf.int32), 0),
          ids, np.stack([np.bincount(row, minlength=BINS)
                         for row in np.asarray(ids)])),
      "gather: slice at axis_index offset": (
          lambda v: tf.slice(v, tf.stack([lax.axis_index("i") % 2, 0]),
                             [half, 256]), positive,
          np.stack([np.asarray(positive)[k, k % 2:k % 2 + half]
                    for k in range(count)])),
      "pfor: slice at offset 0": (
          lambda v: v[:half], positive, np.asarray(positive)[:, :half]),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--rounds", type=int, default=30)
  parser.add_argument("--rows", type=int, default=128)
  options = parser.parse_args()

  count = tfspmd.device_count()
  contenders = {}
  for name, (function, argument, expected) in _pairs(
      count, options.rows).items():
    mapped = tfspmd.pmap(function, axis_name="i")

    def call(mapped=mapped, argument=argument):
      result = mapped(argument)
      result.block_until_ready()
      return result

    np.testing.assert_allclose(np.asarray(call()), expected, rtol=1e-4,
                               err_msg=name)
    contenders[name] = call
  summary = timing.summarize(timing.interleaved(
      contenders, rounds=options.rounds, calls_per_round=1, warmup=3))
  rows = []
  names = list(summary)
  for route, baseline in zip(names[::2], names[1::2]):
    for name in (route, baseline):
      stats = summary[name]
      rows.append(dict(
          name=name, median_ms=stats["median_us"] / 1e3,
          p10_ms=stats["p10_us"] / 1e3, p90_ms=stats["p90_us"] / 1e3,
          ratio=stats["median_us"] / summary[baseline]["median_us"]))
  timing.print_table(
      f"Routes on {count} devices, {options.rows} x 256 per device (medians "
      f"of {options.rounds} interleaved rounds; ratio to the pfor route "
      f"below each)", rows,
      ["name", "median_ms", "p10_ms", "p90_ms", "ratio"])
  path = timing.write_results("op_routes", {
      "machine": timing.machine(), "devices": count, "rows": options.rows,
      "results": summary})
  print(f"\nwritten to {path}")


if __name__ == "__main__":
  main()
