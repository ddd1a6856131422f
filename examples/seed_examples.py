"""Every example of the jax.pmap reference and tutorials, written with TensorFlow.

Run: python examples/seed_examples.py  (8 logical CPU devices unless
TFSPMD_NUM_CPU_DEVICES says otherwise, or an accelerator is present).
"""

import functools
import os

os.environ.setdefault("TFSPMD_NUM_CPU_DEVICES", "8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # pylint: disable=g-import-not-at-top,wrong-import-position
import tfspmd  # pylint: disable=g-import-not-at-top,wrong-import-position
from tfspmd import lax  # pylint: disable=g-import-not-at-top,wrong-import-position


def squares():
  """pmap as a map along the leading axis: [0 1 4 9 16 25 36 49]."""
  return tfspmd.pmap(lambda x: x ** 2)(tf.range(8))


def batched_dot():
  """A leading axis of 3 runs on 3 of the devices."""
  x = tf.reshape(tf.range(3 * 2 * 2.), (3, 2, 2))
  y = tf.reshape(tf.range(3 * 2 * 2.), (3, 2, 2)) ** 2
  return tfspmd.pmap(tf.linalg.matmul)(x, y)


def too_many_replicas():
  """Mapping 9 elements over 8 devices is an error; returns its message."""
  try:
    tfspmd.pmap(lambda x: x ** 2)(tf.range(9))
  except ValueError as e:
    return str(e)
  raise AssertionError("pmap over 9 elements on 8 devices did not raise")


def broadcast_argument():
  """in_axes=None broadcasts y to every device: ([4. 5.], [8. 8.])."""
  x, y = tf.range(2.), 4.
  return tfspmd.pmap(lambda x, y: (x + y, y * 2.), in_axes=(0, None))(x, y)


def normalize_by_psum():
  """x / psum(x): [0. 0.16666667 0.33333334 0.5], summing to 1."""
  f = lambda x: x / lax.psum(x, axis_name="i")
  return tfspmd.pmap(f, axis_name="i")(tf.range(4.))


@functools.partial(tfspmd.pmap, axis_name="rows")
@functools.partial(tfspmd.pmap, axis_name="cols")
def normalize_rows_and_cols(x):
  row_normed = x / lax.psum(x, "rows")
  col_normed = x / lax.psum(x, "cols")
  doubly_normed = x / lax.psum(x, ("rows", "cols"))
  return row_normed, col_normed, doubly_normed


def nested_normalize():
  """Nested pmaps over a 4 x 2 mesh of devices, with psum over each axis."""
  return normalize_rows_and_cols(tf.reshape(tf.range(8.), (4, 2)))


def device_subsets():
  """Two computations on disjoint devices: the first six and the last two."""
  devices = tfspmd.devices()

  @functools.partial(tfspmd.pmap, axis_name="i", devices=devices[:6])
  def f1(x):
    return x / lax.psum(x, axis_name="i")

  @functools.partial(tfspmd.pmap, axis_name="i", devices=devices[-2:])
  def f2(x):
    return lax.psum(x ** 2, axis_name="i")

  return f1(tf.range(6.)), f2(tf.constant([2., 3.]))


def tutorial_scale_by_two(num_devices, per_device=4):
  """The tutorial's scale_by_two over data of shape (devices, 4)."""
  def scale_by_two(x):
    print("Compiling and running scale_by_two...")
    return x * 2
  data = tf.reshape(tf.range(num_devices * per_device), (num_devices, per_device))
  return tfspmd.pmap(scale_by_two)(data)


def tutorial_scale_and_add(num_devices, per_device=4):
  """x * 2 + y with y = 100.0 broadcast to every device."""
  def scale_and_add(x, y):
    return tf.cast(x, tf.float32) * 2 + y
  data = tf.reshape(tf.range(num_devices * per_device), (num_devices, per_device))
  return tfspmd.pmap(scale_and_add, in_axes=(0, None))(data, tf.constant(100.0))


def tutorial_scale_and_sum(num_devices, per_device=4):
  """Each device's scaled rows, and the psum of the per-device sums."""
  def scale_and_sum(x):
    scaled_x = x * 2
    local_sum = tf.reduce_sum(scaled_x)
    global_sum = lax.psum(local_sum, axis_name="devices")
    return scaled_x, global_sum
  data = tf.reshape(tf.range(num_devices * per_device), (num_devices, per_device))
  return tfspmd.pmap(scale_and_sum, axis_name="devices")(data)


def named_axis_computation():
  """The mesh tutorial: 4 devices named 'data_parallel_axis'."""
  data = tf.reshape(tf.range(4 * 5), (4, 5))
  return tfspmd.pmap(lambda x: x * 2, axis_name="data_parallel_axis",
                     in_axes=0)(data)


def main():
  num_devices = tfspmd.device_count()
  print(f"Number of devices available: {num_devices}")
  print(f"Available devices: {list(tfspmd.devices())}")

  print("\n# pmap(lambda x: x ** 2)(tf.range(8))")
  print(squares())
  print("\n# pmap(tf.linalg.matmul)(x, y) over 3 devices")
  print(batched_dot())
  print("\n# 9 elements on 8 devices")
  print("ValueError:", too_many_replicas())
  print("\n# in_axes=(0, None)")
  print(broadcast_argument())
  out = normalize_by_psum()
  print("\n# x / psum(x, 'i')")
  print(out)
  print(tf.reduce_sum(out).numpy())
  row_normed, col_normed, doubly_normed = nested_normalize()
  print("\n# nested pmaps 'rows' x 'cols'")
  print(tf.reduce_sum(row_normed, 0).numpy())
  print(tf.reduce_sum(col_normed, 1).numpy())
  print(tf.reduce_sum(doubly_normed, (0, 1)).numpy())
  first, last = device_subsets()
  print("\n# devices=devices()[:6] and devices()[-2:]")
  print(first)
  print(last)

  print("\n# tutorial: scale_by_two")
  result = tutorial_scale_by_two(num_devices)
  print(f"Output shape: {result.shape}")
  print(f"Output type: {type(result).__name__}")
  print(f"Output content:\n{result}")
  print("\n# tutorial: scale_and_add, in_axes=(0, None)")
  print(tutorial_scale_and_add(num_devices))
  scaled, total = tutorial_scale_and_sum(num_devices)
  print("\n# tutorial: scale_and_sum with psum")
  print(f"Output scaled data:\n{scaled}")
  print(f"Output sum (replicated across devices): {total}")
  print(f"Expected global sum: {2 * sum(range(num_devices * 4))}")
  print(f"Sum computed by pmap (device 0): {int(total[0])}")
  print("\n# mesh tutorial: axis_name='data_parallel_axis' on 4 devices")
  print(named_axis_computation())


if __name__ == "__main__":
  main()
