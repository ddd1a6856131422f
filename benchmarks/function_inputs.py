"""What a user's tf.function pays for tfspmd looking at every call's inputs.

A tf.function that takes a ShardedArray or calls a pmap checks, at each
call, which inputs are DTensors and on which mesh, and copies plain tensors
given beside them whole to the DTensors' devices (`function_inputs`). The
cases, on every device (8 logical CPU devices), float32 (8, 128) inputs,
interleaved round by round, each call waited for before the next:

  - dtensors/checked: `a + b` of two DTensors, the function marked as tfspmd
    marks one (its inputs are checked);
  - dtensors/unchecked: the same function as TensorFlow alone calls it;
  - plain_beside/placed: the checked function given a DTensor and a plain
    tensor, which tfspmd copies to the devices;
  - plain_beside/by_hand: the unchecked function given the DTensor and the
    plain tensor copied by the caller (`dtensor.copy_to_mesh`), as a DTensor
    user must.

`checking_us` is dtensors/checked minus dtensors/unchecked; `placing_us`
is plain_beside/placed minus plain_beside/by_hand.

Run: python benchmarks/function_inputs.py [--rounds N] [--calls N]
"""

import argparse
import os
import sys

os.environ.setdefault("TFSPMD_NUM_CPU_DEVICES", "8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)

import numpy as np  # pylint: disable=wrong-import-position
import tensorflow as tf  # pylint: disable=wrong-import-position
from tensorflow.experimental import dtensor  # pylint: disable=wrong-import-position

import tfspmd  # pylint: disable=wrong-import-position
from tfspmd._src.core import tf_internal  # pylint: disable=wrong-import-position
from tfspmd._src.executors import dtensor_device  # pylint: disable=wrong-import-position
from tfspmd._src.runtime import function_inputs  # pylint: disable=wrong-import-position

from benchmarks import timing  # pylint: disable=wrong-import-position

_FEATURES = 128


def _settle(result):
  """Waits for the devices to finish `result` (untimed)."""
  tf_internal.wait_for_pending_ops()
  dtensor.unpack(result)


def _checked_sum(a, b):
  function_inputs.mark(tf.compat.v1.get_default_graph())
  return a + b


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--rounds", type=int, default=20)
  parser.add_argument("--calls", type=int, default=50)
  options = parser.parse_args()

  count = tfspmd.device_count()
  host = np.arange(count * _FEATURES, dtype=np.float32).reshape(
      count, _FEATURES)
  split = tfspmd.pmap(lambda x: x + 0.)(host).dtensor_value
  other = tfspmd.pmap(lambda x: x * 2.)(host).dtensor_value
  plain = tf.constant(host)
  whole = dtensor.Layout.replicated(dtensor.fetch_layout(split).mesh, 2)
  checked = tf.function(_checked_sum)
  unchecked = tf.function(lambda a, b: a + b)

  def by_hand():
    with dtensor_device.entry:
      placed = dtensor.copy_to_mesh(plain, whole)
    return unchecked(split, placed)

  contenders = {
      "dtensors/checked": lambda: checked(split, other),
      "dtensors/unchecked": lambda: unchecked(split, other),
      "plain_beside/placed": lambda: checked(split, plain),
      "plain_beside/by_hand": by_hand,
  }
  samples = timing.interleaved(contenders, rounds=options.rounds,
                               calls_per_round=options.calls, settle=_settle)
  summary = timing.summarize(samples)
  median = {name: stats["median_us"] for name, stats in summary.items()}
  rows = [dict(case=name, median_us=stats["median_us"],
               p90_us=stats["p90_us"]) for name, stats in summary.items()]
  timing.print_table(
      f"a user's tf.function on {count} devices (medians of "
      f"{options.rounds} x {options.calls} interleaved calls, each from "
      f"idle devices)", rows, ["case", "median_us", "p90_us"])
  checking = median["dtensors/checked"] - median["dtensors/unchecked"]
  placing = median["plain_beside/placed"] - median["plain_beside/by_hand"]
  print(f"\nchecking_us {checking:.1f}   placing_us {placing:.1f}")

  # Every route computed the same values.
  for result in (checked(split, other), unchecked(split, other)):
    np.testing.assert_array_equal(
        np.concatenate([c.numpy() for c in dtensor.unpack(result)]), 3 * host)
  for result in (checked(split, plain), by_hand()):
    np.testing.assert_array_equal(
        np.concatenate([c.numpy() for c in dtensor.unpack(result)]), 2 * host)
  path = timing.write_results("function_inputs", {
      "machine": timing.machine(), "devices": count, "results": summary,
      "checking_us": checking, "placing_us": placing})
  print(f"\nwritten to {path}")


if __name__ == "__main__":
  main()
