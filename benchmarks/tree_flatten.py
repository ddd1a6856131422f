"""Host cost of flattening and rebuilding a training state of 200 leaves.

Every pmap call flattens its arguments and rebuilds its results, so this is
paid per call on top of the device work. The state is a nested dict as a
model's parameters and optimizer slots are: 50 layers, each with a weight,
a bias and two slots, 200 NumPy leaves in all.

Run: python benchmarks/tree_flatten.py [--rounds N] [--calls N]
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # pylint: disable=wrong-import-position

from benchmarks import timing  # pylint: disable=wrong-import-position
from tfspmd._src.trees import tree  # pylint: disable=wrong-import-position


def state(layers=50):
  """A nested dict of `4 * layers` small arrays."""
  def layer():
    return {"w": np.zeros((4, 4)), "b": np.zeros(4),
            "slots": {"m": np.zeros((4, 4)), "v": np.zeros((4, 4))}}
  return {"params": {f"layer_{i:02d}": layer() for i in range(layers)}}


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--rounds", type=int, default=20)
  parser.add_argument("--calls", type=int, default=100)
  options = parser.parse_args()

  value = state()
  leaves, treedef = tree.flatten(value)
  samples = timing.interleaved(
      {"flatten": lambda: tree.flatten(value),
       "unflatten": lambda: treedef.unflatten(leaves),
       "leaf_paths": lambda: tree.leaf_paths(value, "args")},
      rounds=options.rounds, calls_per_round=options.calls)
  summary = timing.summarize(samples)
  rows = [dict(name=name, **stats) for name, stats in summary.items()]
  timing.print_table(
      f"Flatten and unflatten of a {len(leaves)}-leaf nested dict (medians "
      f"of {options.rounds} x {options.calls} interleaved calls)",
      rows, ["name", "median_us", "p10_us", "p90_us"])
  path = timing.write_results(
      "tree_flatten", {"machine": timing.machine(), "leaves": len(leaves),
                       "summary": summary})
  print(f"\nwrote {path}")


if __name__ == "__main__":
  main()
