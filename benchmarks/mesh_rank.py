"""What one program of rank-6 blocks costs per call on meshes of 1 to 5 axes.

Every mesh axis, size 1 included, adds a dimension to each tensor of the
vectorized program; slices and broadcasts that would pass rank 8 run on
merged dimensions, and collectives and loop state of such values move flat.
This times one shard_map program on the 8 devices arranged as each mesh,
interleaved round by round, each call's values fetched (`np.asarray`)
before the next: a program of a strided slice, a `tf.where`, a
`tf.while_loop` with a `ppermute` over the last axis and a psum over all
axes, on blocks of shape (2, 1, 2, 1, 2, 3).

Run: python benchmarks/mesh_rank.py [--rounds N] [--calls N]
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

import tfspmd  # pylint: disable=wrong-import-position
from tfspmd import P  # pylint: disable=wrong-import-position
from tfspmd import lax  # pylint: disable=wrong-import-position
from benchmarks import timing  # pylint: disable=wrong-import-position

MESHES = [(8,), (2, 4), (1, 2, 1, 4), (2, 2, 2), (1, 1, 2, 2, 2)]
NAMES = ("dp", "fsdp", "tp", "sp", "ep")
BLOCK = (2, 1, 2, 1, 2, 3)


def mapped_program(shape):
  names = NAMES[:len(shape)]
  mesh = tfspmd.Mesh(np.array(tfspmd.devices()).reshape(shape), names)
  last = names[-1]
  ring = [(k, (k + 1) % shape[-1]) for k in range(shape[-1])]

  def program(block):
    picked = tf.where(block > 0., block, -block)[:, :, 1:, :, :, :2]

    def step(k, total, passing):
      passing = lax.ppermute(passing, last, ring)
      return k + 1, total + passing, passing

    total = tf.while_loop(lambda k, *_: k < 2, step, (0, block, block))[1]
    return total + lax.psum(tf.reduce_sum(picked), names)

  return tfspmd.shard_map(program, mesh=mesh, in_specs=P(names),
                          out_specs=P(names))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=15)
  parser.add_argument("--calls", type=int, default=10)
  args = parser.parse_args()
  x = np.random.default_rng(0).standard_normal(
      (8 * BLOCK[0],) + BLOCK[1:]).astype(np.float32)
  contenders = {}
  reference = None
  for shape in MESHES:
    mapped = mapped_program(shape)
    result = np.asarray(mapped(x))
    # Every mesh computes the same values but the ring: two steps over its
    # last axis, whose size differs between meshes.
    if reference is None:
      reference = result.shape
    assert result.shape == reference, (shape, result.shape)
    contenders[str(shape)] = (lambda m=mapped: np.asarray(m(x)))
  samples = timing.interleaved(contenders, rounds=args.rounds,
                               calls_per_round=args.calls, warmup=5)
  summary = timing.summarize(samples)
  base = summary[str(MESHES[0])]["median_us"]
  rows = [dict(mesh=name, axes=len(eval(name)),  # pylint: disable=eval-used
               median_ms=stats["median_us"] / 1e3,
               p90_ms=stats["p90_us"] / 1e3,
               vs_one_axis=stats["median_us"] / base)
          for name, stats in summary.items()]
  timing.print_table(
      "One rank-6 program per call on each mesh of the 8 devices "
      "(values fetched)", rows,
      ["mesh", "axes", "median_ms", "p90_ms", "vs_one_axis"])
  path = timing.write_results("mesh_rank", {
      "machine": timing.machine(), "rounds": args.rounds,
      "calls_per_round": args.calls, "block": list(BLOCK), "results": rows})
  print(f"\nwrote {path}")


if __name__ == "__main__":
  main()
