"""A training program with a loop: one function per device against DTensor's expansion.

tfspmd runs a program with a loop (`steps=`, tf.while_loop) as one function
per device, and a program without one under DTensor's multi-device
expansion (one function over all devices), which about halves a short
call's cost. This measures what the expansion would give the loop programs:
the same data-parallel MLP step at K = 10 and 100 steps per call, traced
once as tfspmd chooses and once with the expansion, the contenders
alternating round by round, each call waiting for its losses.

Run: python benchmarks/loop_expansion.py [--rounds N]
"""

import argparse
import os
import sys

os.environ.setdefault("TFSPMD_NUM_CPU_DEVICES", "8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # pylint: disable=wrong-import-position

import tfspmd  # pylint: disable=wrong-import-position
from benchmarks import timing  # pylint: disable=wrong-import-position
from benchmarks.steps_per_call import init_params  # pylint: disable=wrong-import-position
from benchmarks.steps_per_call import placed_batches  # pylint: disable=wrong-import-position
from benchmarks.steps_per_call import train_step  # pylint: disable=wrong-import-position
from tfspmd._src.executors import dtensor_settings  # pylint: disable=wrong-import-position

STEPS_PER_CALL = (10, 100)


def _contender(k, x, y, params, expanded):
  """A call of the K-step program; `expanded` traces it under the expansion."""
  def step(params, x, y):  # a function of its own: pmap keeps one per function
    return train_step(params, x, y)

  train = tfspmd.pmap(step, "batch", in_axes=(None, 0, 0),
                      out_axes=(None, 0), steps=k)
  state = {"params": params}

  def call():
    state["params"], losses = train(state["params"], x, y)
    np.asarray(losses)

  has_loop = dtensor_settings._has_loop  # pylint: disable=protected-access
  if expanded:
    # The program's switches are chosen when it is traced, by the first call.
    dtensor_settings._has_loop = lambda graph_def: False  # pylint: disable=protected-access
  try:
    call()
  finally:
    dtensor_settings._has_loop = has_loop  # pylint: disable=protected-access
  (program,) = train._programs.values()  # pylint: disable=protected-access
  assert program.expanded == expanded
  return call


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--rounds", type=int, default=10)
  options = parser.parse_args()

  devices = tfspmd.device_count()
  rng = np.random.default_rng(1)
  place = tfspmd.pmap(lambda v: v)
  contenders = {}
  for k in STEPS_PER_CALL:
    x, y = placed_batches(place, rng, devices, k)
    for expanded in (False, True):
      name = f"K={k} {'expanded' if expanded else 'one function per device'}"
      contenders[name] = _contender(k, x, y, init_params(), expanded)
  summary = timing.summarize(timing.interleaved(
      contenders, rounds=options.rounds, calls_per_round=1, warmup=2))
  rows = []
  for k in STEPS_PER_CALL:
    per_device = summary[f"K={k} one function per device"]["median_us"]
    expanded = summary[f"K={k} expanded"]["median_us"]
    rows.append(dict(steps_per_call=k, per_device_ms=per_device / 1e3,
                     expanded_ms=expanded / 1e3,
                     expanded_over_per_device=expanded / per_device))
  timing.print_table(
      f"MLP training program with a loop, {devices} devices, medians of "
      f"{options.rounds} interleaved calls", rows,
      ["steps_per_call", "per_device_ms", "expanded_ms",
       "expanded_over_per_device"])
  path = timing.write_results("loop_expansion", {
      "machine": timing.machine(), "devices": devices, "rows": rows,
      "raw": summary})
  print(f"\nwrote {path}")


if __name__ == "__main__":
  main()
