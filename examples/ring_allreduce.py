"""A ring all-reduce built from `ppermute`, checked against `psum`.

Each of the n devices cuts its vector into n chunks and talks only to its
right-hand neighbour on a ring, n - 1 times in each of two phases:
  1. reduce-scatter: at step s device i sends chunk (i - s) mod n to device
     i + 1, which adds it to its own copy of that chunk; afterwards device i
     holds the sum over all devices of chunk (i + 1) mod n;
  2. all-gather: at step s device i sends chunk (i + 1 - s) mod n, complete,
     and its neighbour keeps it; afterwards every device holds every sum.
Each device sends 2 (n - 1) / n of its vector in all, the least an
all-reduce can, which is why NCCL and Horovod reduce this way.

Run: python examples/ring_allreduce.py
"""

import os

os.environ.setdefault("TFSPMD_NUM_CPU_DEVICES", "8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np
import tensorflow as tf

import tfspmd
from tfspmd import lax
# pylint: enable=g-import-not-at-top,wrong-import-position


def ring_all_reduce(x, axis_name):
  """The sum of `x` over the devices of `axis_name`, by a ring of ppermutes.

  Args:
    x: This device's tensor; its size must divide by the axis size.
    axis_name: The pmap axis to reduce over.

  Returns:
    The sum over the devices, shaped like `x`, on every device.
  """
  n = lax.axis_size(axis_name)
  i = lax.axis_index(axis_name)
  right = [(j, (j + 1) % n) for j in range(n)]
  chunks = tf.reshape(x, [n, -1])

  def chunk(index):
    return tf.gather(chunks, index % n)

  def at(index):
    """A (n, 1) mask selecting the chunk `index` (mod n)."""
    return tf.one_hot(index % n, n, dtype=x.dtype)[:, None]

  for s in range(n - 1):
    received = lax.ppermute(chunk(i - s), axis_name, perm=right)
    chunks = chunks + at(i - s - 1) * received
  for s in range(n - 1):
    received = lax.ppermute(chunk(i + 1 - s), axis_name, perm=right)
    keep = at(i - s)
    chunks = keep * received + (1 - keep) * chunks
  return tf.reshape(chunks, tf.shape(x))


def both_ways(x):
  """`(ring all-reduce, psum)` of the rows of `x`, one row per device."""
  return tfspmd.pmap(lambda v: (ring_all_reduce(v, "i"), lax.psum(v, "i")),
                     axis_name="i")(x)


def main():
  n = tfspmd.device_count()
  ints = np.arange(n * n, dtype=np.int32).reshape(n, n) ** 2
  ring, psum = both_ways(ints)
  print(f"{n} devices, int32 rows of {n}:")
  print("ring all-reduce, device 0:", np.asarray(ring)[0])
  print("psum, device 0:           ", np.asarray(psum)[0])
  print("equal on every device:", np.array_equal(ring, psum))
  floats = np.random.default_rng(0).standard_normal((n, 1024)).astype(
      np.float32)
  ring, psum = both_ways(floats)
  gap = np.max(np.abs(np.asarray(ring) - np.asarray(psum)))
  print(f"float32 rows of 1024: largest |ring - psum| = {gap:.1e} (the sums "
        f"are added in another order)")
  print(f"each device sent 2 * {n - 1} chunks of 1/{n} of its row "
        f"= {2 * (n - 1) / n:.2f} rows")


if __name__ == "__main__":
  main()
