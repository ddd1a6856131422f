"""The README's digits example: 8-device training against one-device `fit`.

Each round is a fresh process that runs `examples/train_digits.py`'s
training both ways, as a user runs it: `data_parallel(model).fit` over the
devices (its trace, first run and 12 epochs), then Keras' `model.fit` on one
device from the same weights. Fresh processes, since the first call's trace
and compile are what a short training run pays. The figures are medians over
the rounds, the two contenders timed in the same process each round; the
trained models are checked equal (to 1e-5) in every round.

Run: python benchmarks/keras_fit.py [--rounds N] [--epochs N] [--executor E]
(needs the `examples` extra: scikit-learn; E: tfspmd's executor)
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import timing  # pylint: disable=wrong-import-position

_ROUND = """
import json, os, sys
sys.path.insert(0, {root!r})
os.environ["TFSPMD_NUM_CPU_DEVICES"] = "8"
os.environ["TFSPMD_EXECUTOR"] = {executor!r}
from examples import train_digits
import tempfile
with tempfile.TemporaryDirectory() as out:
  result = train_digits.run({epochs}, os.path.join(out, "loss.png"),
                            verbose=0)
print("ROUND", json.dumps(dict(same=bool(result["same"]),
                               parallel=result["parallel_seconds"],
                               single=result["single_seconds"])))
"""


def one_round(epochs, executor):
  """(8-device seconds, one-device seconds) of a fresh process's run."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  printed = subprocess.run(
      [sys.executable, "-c", _ROUND.format(root=root, epochs=epochs,
                                           executor=executor)],
      check=True, capture_output=True, text=True).stdout
  result = json.loads(printed.split("ROUND ", 1)[1])
  if not result["same"]:
    raise SystemExit("the 8-device and one-device runs differ by more than "
                     "1e-5")
  return result["parallel"], result["single"]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--epochs", type=int, default=12)
  parser.add_argument("--executor", default="auto",
                      choices=["auto", "host", "dtensor"])
  options = parser.parse_args(argv)
  rounds = [one_round(options.epochs, options.executor)
            for _ in range(options.rounds)]
  parallel = statistics.median(p for p, _ in rounds)
  single = statistics.median(s for _, s in rounds)
  ratios = statistics.median(p / s for p, s in rounds)
  rows = [{"contender": (f"data_parallel(model).fit, 8 devices "
                         f"({options.executor})"),
           "median_s": parallel},
          {"contender": "keras Model.fit, 1 device", "median_s": single},
          {"contender": "ratio (8 devices / 1 device), median of rounds",
           "median_s": ratios}]
  timing.print_table(
      f"digits, {options.epochs} epochs, {options.rounds} fresh processes",
      rows, ["contender", "median_s"])
  path = timing.write_results(f"keras_fit_{options.executor}", {
      "machine": timing.machine(), "epochs": options.epochs,
      "rounds": [{"parallel_s": p, "single_s": s} for p, s in rounds],
      "median_parallel_s": parallel, "median_single_s": single,
      "median_ratio": ratios})
  print(f"\nwrote {path}")


if __name__ == "__main__":
  main()
