"""`out * 2` on a pmap result: on the devices, against a pmap call and the host.

Three ways to double a 64 MiB result (8 MiB per device on 8 devices), each
timed until the doubled values exist on the devices:
  - sharded_array_op: `out * 2`, the ShardedArray operator (DTensor runs the
    multiply on every device's block, the split kept);
  - pmap_call: `tfspmd.pmap(lambda v: v * 2)(out)`, the same work as a
    compiled program;
  - host_round_trip: every device's block copied to the host (what
    `np.asarray(out)` does the first time; it keeps the copy, so it is not
    called here), doubled by NumPy and placed back with a pmap of the
    identity: what arithmetic on a result cost before it had operators.

Run: python benchmarks/array_ops.py [--rounds N] [--mib N]
"""

import argparse
import os
import sys

os.environ.setdefault("TFSPMD_NUM_CPU_DEVICES", "8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # pylint: disable=wrong-import-position
from tensorflow.experimental import dtensor  # pylint: disable=wrong-import-position

import tfspmd  # pylint: disable=wrong-import-position
from benchmarks import timing  # pylint: disable=wrong-import-position


def _on_host(array):
  """The values of `array` copied from its devices now (no cached copy)."""
  return np.concatenate([block.numpy()
                         for block in dtensor.unpack(array.dtensor_value)])


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--rounds", type=int, default=15)
  parser.add_argument("--mib", type=int, default=64)
  options = parser.parse_args()

  count = tfspmd.device_count()
  rows_per_device = (options.mib << 20) // 4 // count // 1024
  identity = tfspmd.pmap(lambda v: v)
  out = identity(np.ones((count, rows_per_device, 1024), np.float32))
  double = tfspmd.pmap(lambda v: v * 2)

  def waited(function):
    def call():
      result = function()
      result.block_until_ready()
      return result
    return call

  contenders = {
      "sharded_array_op": waited(lambda: out * 2),
      "pmap_call": waited(lambda: double(out)),
      "host_round_trip": waited(lambda: identity(_on_host(out) * 2)),
  }
  for name, call in contenders.items():  # the values exist once waited on
    result = call()
    assert result.placement.spec == out.placement.spec, name
    assert float(np.asarray(result)[count - 1, -1, -1]) == 2.0, name
  summary = timing.summarize(timing.interleaved(
      contenders, rounds=options.rounds, calls_per_round=1, warmup=2))
  base = summary["pmap_call"]["median_us"]
  rows = [dict(name=name, median_ms=stats["median_us"] / 1e3,
               p10_ms=stats["p10_us"] / 1e3, p90_ms=stats["p90_us"] / 1e3,
               ratio_to_pmap_call=stats["median_us"] / base)
          for name, stats in summary.items()]
  timing.print_table(
      f"Doubling a {options.mib} MiB result on {count} devices (medians of "
      f"{options.rounds} interleaved rounds)", rows,
      ["name", "median_ms", "p10_ms", "p90_ms", "ratio_to_pmap_call"])
  path = timing.write_results("array_ops", {
      "machine": timing.machine(), "devices": count, "mib": options.mib,
      "results": summary})
  print(f"\nwritten to {path}")


if __name__ == "__main__":
  main()
