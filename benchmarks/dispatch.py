"""Per-call cost of pmap(lambda x: x + 1.0) against one raw DTensor jit call.

Both run on the same 8-device mesh with the input already on the devices:
  - raw_dtensor_function: `tf.function(lambda x: x + 1.0, jit_compile=True)`
    called with a DTensor, as a DTensor user would write it;
  - raw_dtensor_concrete: the same through its ConcreteFunction (the floor);
  - tfspmd_pmap: `tfspmd.pmap(lambda x: x + 1.0)` fed its own previous result.

Run: python benchmarks/dispatch.py [--rounds N] [--calls N]
"""

import argparse
import os
import sys

os.environ.setdefault("TFSPMD_NUM_CPU_DEVICES", "8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # pylint: disable=wrong-import-position
import tensorflow as tf  # pylint: disable=wrong-import-position
from tensorflow.experimental import dtensor  # pylint: disable=wrong-import-position

import tfspmd  # pylint: disable=wrong-import-position
from benchmarks import timing  # pylint: disable=wrong-import-position


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--rounds", type=int, default=20)
  parser.add_argument("--calls", type=int, default=50)
  options = parser.parse_args()

  count = tfspmd.device_count()
  step = tfspmd.pmap(lambda x: x + 1.0)
  state = {"pmap": step(np.zeros((count, 16), np.float32))}
  mesh = state["pmap"].placement.mesh
  layout = dtensor.Layout([mesh.dim_names[0], dtensor.UNSHARDED], mesh)
  raw_input = dtensor.pack([tf.zeros((1, 16))] * count, layout)
  raw = tf.function(lambda x: x + 1.0, jit_compile=True)
  concrete = raw.get_concrete_function(raw_input)

  def call_pmap():
    state["pmap"] = step(state["pmap"])

  samples = timing.interleaved(
      {"raw_dtensor_function": lambda: raw(raw_input),
       "raw_dtensor_concrete": lambda: concrete(raw_input),
       "tfspmd_pmap": call_pmap},
      rounds=options.rounds, calls_per_round=options.calls)
  summary = timing.summarize(samples)
  base = summary["raw_dtensor_function"]["median_us"]
  rows = [dict(name=name, **stats, ratio_to_raw_function=stats["median_us"] / base)
          for name, stats in summary.items()]
  timing.print_table(
      f"Per-call cost, x + 1.0 on {count} devices, input on the devices "
      f"(medians of {options.rounds} x {options.calls} interleaved calls)",
      rows, ["name", "median_us", "p10_us", "p90_us", "ratio_to_raw_function"])
  np.testing.assert_allclose(state["pmap"].numpy()[0, 0],
                             20 + options.rounds * options.calls + 1)
  path = timing.write_results("dispatch", {
      "machine": timing.machine(), "devices": count, "results": summary,
      "ratio_pmap_to_raw_function": summary["tfspmd_pmap"]["median_us"] / base,
      "ratio_pmap_to_raw_concrete": summary["tfspmd_pmap"]["median_us"] /
                                    summary["raw_dtensor_concrete"]["median_us"]})
  print(f"\nwritten to {path}")


if __name__ == "__main__":
  main()
