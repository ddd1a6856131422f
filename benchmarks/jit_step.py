"""A training step under tfspmd.jit against the same shard_map called directly.

The step (a linear layer's squared loss, its gradient averaged over 'data'
of a 4 x 2 mesh) is a shard_map. Contenders, interleaved round by round,
each carrying its own state from call to call and waiting for it:

  jit, shard_map built per call   `tfspmd.jit` of a function that builds
                                  the shard_map on every call (JAX's form)
  shard_map called directly       the same shard_map, built once

The table gives median milliseconds per call and their ratio (the target:
jit within 1.2x of the direct call).

Run: python -m benchmarks.jit_step [--rounds N]
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
from tfspmd import NamedSharding  # pylint: disable=wrong-import-position
from tfspmd import P  # pylint: disable=wrong-import-position


def per_device_step(state, x):
  with tf.GradientTape() as tape:
    tape.watch(state["w"])
    loss = tf.reduce_mean((x @ state["w"]) ** 2)
  grad = lax.pmean(tape.gradient(loss, state["w"]), "data")
  return ({"w": state["w"] - 0.01 * grad, "count": state["count"] + 1},
          lax.pmean(loss, "data"))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=30)
  options = parser.parse_args()
  mesh = tfspmd.make_mesh((4, 2), ("data", "model"))
  specs = dict(mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()))
  direct = tfspmd.shard_map(per_device_step, **specs)

  @tfspmd.jit
  def jitted(state, x):
    return tfspmd.shard_map(per_device_step, **specs)(state, x)

  rng = np.random.default_rng(0)
  x = tfspmd.device_put(rng.standard_normal((256, 64)).astype(np.float32),
                        NamedSharding(mesh, P("data")))
  first = {"w": rng.standard_normal((64, 32)).astype(np.float32) * 0.1,
           "count": np.int32(0)}
  states = {"jit, shard_map built per call": first,
            "shard_map called directly": first}
  steps = {"jit, shard_map built per call": jitted,
           "shard_map called directly": direct}

  def contender(name):
    def call():
      states[name], loss = steps[name](states[name], x)
      float(loss)
      return tfspmd.block_until_ready(states[name])
    return call

  samples = timing.interleaved({name: contender(name) for name in steps},
                               rounds=options.rounds, calls_per_round=5,
                               warmup=10)
  summary = timing.summarize(samples)
  base = summary["shard_map called directly"]["median_us"]
  rows = [dict(contender=name, median_ms=s["median_us"] / 1e3,
               p90_ms=s["p90_us"] / 1e3, over_direct=s["median_us"] / base)
          for name, s in summary.items()]
  timing.print_table(
      f"A training step on a 4 x 2 mesh (8 CPU devices), medians of "
      f"{options.rounds * 5} calls each, interleaved", rows,
      ["contender", "median_ms", "p90_ms", "over_direct"])
  losses = [float(np.asarray(states[name]["w"]).sum()) for name in steps]
  print(f"\nBoth carried the same weights: sums {losses[0]:.6f} and "
        f"{losses[1]:.6f}")
  path = timing.write_results("jit_step", dict(
      machine=timing.machine(), rows=rows, load_average=os.getloadavg()))
  print(f"Results written to {path}")


if __name__ == "__main__":
  main()
