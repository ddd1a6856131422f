"""Steps per second of a data-parallel MLP step at K = 1, 10, 100 steps per call.

`tfspmd.pmap(step, steps=K)` runs K training steps in one compiled call (a
loop inside the program), so the per-call dispatch is paid once per K steps.
Each contender trains the same MLP on batches already on the devices and
waits for its result; the contenders alternate round by round.

Run: python benchmarks/steps_per_call.py [--rounds N]
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
from tfspmd import lax  # pylint: disable=wrong-import-position

PER_DEVICE_BATCH, FEATURES, HIDDEN, CLASSES = 32, 64, 128, 10
STEPS_PER_CALL = (1, 10, 100)


def init_params():
  rng = np.random.default_rng(0)
  return [rng.standard_normal((FEATURES, HIDDEN)).astype(np.float32) * 0.1,
          np.zeros(HIDDEN, np.float32),
          rng.standard_normal((HIDDEN, CLASSES)).astype(np.float32) * 0.1,
          np.zeros(CLASSES, np.float32)]


def train_step(params, x, y):
  with tf.GradientTape() as tape:
    tape.watch(params)
    w1, b1, w2, b2 = params
    logits = tf.nn.relu(x @ w1 + b1) @ w2 + b2
    loss = tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
  grads = lax.pmean(tape.gradient(loss, params), "batch")
  return [p - 0.1 * g for p, g in zip(params, grads)], lax.pmean(loss, "batch")


def placed_batches(place, rng, devices, k):
  """Random `(x, y)` for K steps of every device, placed on the devices."""
  x = place(rng.standard_normal(
      (devices, k, PER_DEVICE_BATCH, FEATURES)).astype(np.float32))
  y = place(rng.integers(0, CLASSES, (devices, k, PER_DEVICE_BATCH)).astype(
      np.int32))
  return x, y


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--rounds", type=int, default=7)
  options = parser.parse_args()

  devices = tfspmd.device_count()
  rng = np.random.default_rng(1)
  place = tfspmd.pmap(lambda v: v)
  params = tfspmd.pmap(lambda p: p, in_axes=None, out_axes=None,
                       axis_size=devices)(init_params())
  contenders, state = {}, {}
  for k in STEPS_PER_CALL:
    x, y = placed_batches(place, rng, devices, k)
    train = tfspmd.pmap(train_step, "batch", in_axes=(None, 0, 0),
                        out_axes=(None, 0), steps=k)
    state[k] = params

    def call(k=k, train=train, x=x, y=y):
      state[k], losses = train(state[k], x, y)
      losses.block_until_ready()

    start = time.perf_counter()
    call()
    print(f"K={k}: first call (trace + compile) {time.perf_counter() - start:.1f} s")
    contenders[f"K={k}"] = call

  samples = timing.interleaved(contenders, rounds=options.rounds,
                               calls_per_round=3, warmup=2)
  summary = timing.summarize(samples)
  rows = []
  for k in STEPS_PER_CALL:
    stats = summary[f"K={k}"]
    steps_per_second = k / (stats["median_us"] * 1e-6)
    rows.append(dict(steps_per_call=k, call_median_ms=stats["median_us"] / 1e3,
                     step_ms=stats["median_us"] / 1e3 / k,
                     steps_per_second=steps_per_second,
                     examples_per_second=steps_per_second * devices * PER_DEVICE_BATCH))
  base = rows[0]["steps_per_second"]
  for row in rows:
    row["speedup_vs_K1"] = row["steps_per_second"] / base
  timing.print_table(
      f"Data-parallel MLP step ({FEATURES}-{HIDDEN}-{CLASSES}, {PER_DEVICE_BATCH} "
      f"examples per device, {devices} devices), medians of "
      f"{options.rounds} x 3 interleaved calls",
      rows, ["steps_per_call", "call_median_ms", "step_ms", "steps_per_second",
             "examples_per_second", "speedup_vs_K1"])
  path = timing.write_results("steps_per_call", {
      "machine": timing.machine(), "devices": devices, "rows": rows,
      "raw": summary})
  print(f"\nwrote {path}")


if __name__ == "__main__":
  main()
