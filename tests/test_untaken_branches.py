"""Only the branch a device takes can fail: conds, cases and loops per device.

A program that runs on each device never runs the branch its device does
not take, nor the iterations after its own loop ends. Each expectation is
NumPy arithmetic written here, device by device.
"""

import re

import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from tfspmd import lax

from child_process import run_python

N = 8


def rows(width=4):
  return np.arange(N * width, dtype=np.float32).reshape(N, width)


def run(fun, *args, **kwargs):
  return np.asarray(tfspmd.pmap(fun, "i", **kwargs)(*args))


def test_a_scatter_out_of_range_in_the_untaken_branch():
  # The Lorenz ODE Cloud TPU colab draws lines this way.
  def draw(x):
    del x
    i = lax.axis_index("i")
    return tf.cond(
        i < 3, lambda: tf.tensor_scatter_nd_add(tf.zeros([3]), [[i]], [1.]),
        lambda: tf.zeros([3]))

  expected = np.zeros((N, 3), np.float32)
  for device in range(3):
    expected[device, device] = 1.
  np.testing.assert_array_equal(run(draw, np.zeros(N)), expected)


def test_a_gather_out_of_range_in_the_untaken_branch():
  x = rows()

  def pick(v):
    i = lax.axis_index("i")
    return tf.cond(i < 4, lambda: tf.gather(v, i), lambda: tf.constant(-1.))

  expected = [x[d, d] if d < 4 else -1. for d in range(N)]
  np.testing.assert_array_equal(run(pick, x), expected)


def test_a_gather_nd_and_a_segment_sum_in_the_untaken_branch():
  x = rows()

  def pick(v):
    i = lax.axis_index("i")
    return tf.cond(
        i < 2,
        lambda: tf.gather_nd(v, [i]) + tf.math.unsorted_segment_sum(
            v, [i, 0, 0, 1], 2)[0],
        lambda: tf.constant(0.))

  expected = []
  for d in range(N):
    if d >= 2:
      expected.append(0.)
      continue
    segments = np.zeros(2, np.float32)
    for value, segment in zip(x[d], [d, 0, 0, 1]):
      segments[segment] += value
    expected.append(x[d, d] + segments[0])
  np.testing.assert_array_equal(run(pick, x), expected)


def test_an_integer_division_by_zero_in_the_untaken_branch():
  def divide(x):
    del x
    i = lax.axis_index("i")
    return tf.cond(i < 4, lambda: (10 // (i - 5), 10 % (i - 5)),
                   lambda: (tf.constant(0), tf.constant(0)))

  quotient, remainder = tfspmd.pmap(divide, "i")(np.zeros(N))
  np.testing.assert_array_equal(
      np.asarray(quotient), [10 // (d - 5) if d < 4 else 0 for d in range(N)])
  np.testing.assert_array_equal(
      np.asarray(remainder), [10 % (d - 5) if d < 4 else 0 for d in range(N)])


def test_an_integer_to_a_negative_power_in_the_untaken_branch():
  def power(x):
    i = lax.axis_index("i")
    return tf.cond(i < 4, lambda: tf.pow(x, 3 - i), lambda: x // (i - 3))

  # Devices 4 to 7 would raise 2 to the powers -1 to -4 in the branch they
  # do not take, and device 3 would divide by 0 in the other.
  x = np.full(N, 2, np.int32)
  np.testing.assert_array_equal(
      run(power, x), [2 ** (3 - d) if d < 4 else 2 // (d - 3)
                      for d in range(N)])


def test_a_check_in_the_untaken_branch_does_not_fail():
  def inverse(x):
    del x
    i = tf.cast(lax.axis_index("i"), tf.float32)
    return tf.cond(i < 4, lambda: tf.debugging.check_numerics(
        1. / (i - 4.), "inverse"), lambda: tf.constant(0.))

  np.testing.assert_allclose(
      run(inverse, np.zeros(N)),
      [1. / (d - 4.) if d < 4 else 0. for d in range(N)], rtol=1e-6)


_TAKEN_BRANCH_FAILS = """
import numpy as np
import tensorflow as tf
import tfspmd
from tfspmd import lax

def pick(v):
  i = lax.axis_index("i")
  return tf.cond(i < 6, lambda: tf.gather(v, i), lambda: tf.constant(-1.))

try:
  out = tfspmd.pmap(pick, "i")(np.arange(32, dtype=np.float32).reshape(8, 4))
  print("VALUES", np.asarray(out).tolist())
except tf.errors.InvalidArgumentError as e:
  print("ERROR", " ".join(str(e).split()))
"""


def test_the_taken_branch_still_fails_where_the_device_fails():
  # Devices 4 and 5 take the branch with an index past the 4 rows. In a
  # process of its own: after a program fails, later ones in the same
  # process run differently. TensorFlow's kernels, which DTensor's executor
  # runs on CPU, refuse the index.
  lines = run_python(_TAKEN_BRANCH_FAILS,
                     TFSPMD_EXECUTOR="dtensor").stdout.splitlines()
  assert len(lines) == 1 and lines[0].startswith("ERROR"), lines
  assert re.search(r"indices\[0\] = [45] is not in \[0, 4\)", lines[0]), lines


def test_the_taken_branch_clamps_its_index_as_jax_does_on_the_host():
  # XLA, which compiles the host executor's program, clamps a gather's index
  # into the array, as jax.pmap's gathers do: devices 4 and 5 read row 3.
  lines = run_python(_TAKEN_BRANCH_FAILS,
                     TFSPMD_EXECUTOR="host").stdout.splitlines()
  rows = np.arange(32, dtype=np.float32).reshape(8, 4)
  expected = [float(rows[d, min(d, 3)]) if d < 6 else -1. for d in range(8)]
  assert lines == [f"VALUES {expected}"], lines


def test_switch_case_gathers_only_in_the_branch_taken():
  x = rows()

  def pick(v):
    i = lax.axis_index("i")
    return tf.switch_case(i % 3, [lambda: tf.gather(v, i // 2),
                                  lambda: tf.gather(v, (i - 4) % 4),
                                  lambda: v[1]])

  expected = [x[d, d // 2] if d % 3 == 0 else
              x[d, (d - 4) % 4] if d % 3 == 1 else x[d, 1] for d in range(N)]
  np.testing.assert_array_equal(run(pick, x), expected)


def test_tf_case_with_a_per_device_predicate():
  x = rows()

  def pick(v):
    i = lax.axis_index("i")
    return tf.case([(i < 2, lambda: tf.gather(v, i + 2)),
                    (i < 5, lambda: tf.gather(v, i - 2))],
                   default=lambda: tf.gather(v, i - 5))

  expected = [x[d, d + 2] if d < 2 else x[d, d - 2] if d < 5 else x[d, d - 5]
              for d in range(N)]
  np.testing.assert_array_equal(run(pick, x), expected)


def test_a_loop_that_ended_on_a_device_computes_nothing_that_fails():
  x = rows()

  def countdown(v):
    count = lax.axis_index("i") % 5
    return tf.while_loop(
        lambda k, total: k > 0,
        lambda k, total: (k - 1, total + tf.gather(v, k - 1)),
        (count, 0.))[1]

  expected = [x[d, :d % 5].sum() for d in range(N)]
  np.testing.assert_array_equal(run(countdown, x), expected)


def test_nested_conds_guard_with_both_predicates():
  x = rows()

  def pick(v):
    i = lax.axis_index("i")
    # Every index is in range where its branch is taken, and 10 or more on
    # each device that does not take it (the inner or the outer branch).
    past = (i // 6) * 10
    return tf.cond(
        i < 6,
        lambda: tf.cond(i % 2 == 0,
                        lambda: tf.gather(v, i // 2 + i % 2 * 10 + past),
                        lambda: tf.gather(v, i // 2 + (1 - i % 2) * 10 +
                                          past)),
        lambda: tf.constant(-1.))

  expected = [-1. if d >= 6 else x[d, d // 2] for d in range(N)]
  np.testing.assert_array_equal(run(pick, x), expected)


def test_a_cond_in_a_nested_pmap_over_two_axes():
  x = np.arange(2 * 4 * 3, dtype=np.float32).reshape(2, 4, 3)

  def inner(v):
    i = lax.axis_index("i")
    j = lax.axis_index("j")
    return tf.cond(i + j < 3, lambda: tf.gather(v, i + j),
                   lambda: tf.constant(0.))

  out = tfspmd.pmap(tfspmd.pmap(inner, "j"), "i")(x)
  expected = [[x[a, b, a + b] if a + b < 3 else 0. for b in range(4)]
              for a in range(2)]
  np.testing.assert_array_equal(np.asarray(out), expected)


def test_the_gradient_through_an_untaken_gather():
  x = rows()

  def grad(v):
    i = lax.axis_index("i")
    with tf.GradientTape() as tape:
      tape.watch(v)
      y = tf.cond(i < 4, lambda: tf.gather(v, i) ** 2,
                  lambda: tf.reduce_sum(v))
    return tape.gradient(y, v)

  expected = np.zeros_like(x)
  for d in range(N):
    if d < 4:
      expected[d, d] = 2 * x[d, d]
    else:
      expected[d] = 1.
  np.testing.assert_allclose(run(grad, x), expected)


def test_the_gradient_of_a_gather_at_a_per_device_index():
  w = np.arange(1., 5., dtype=np.float32)
  x = rows()

  def grad(weights, v):
    i = tf.cast(v[0], tf.int32) // 4 % 4
    with tf.GradientTape() as tape:
      tape.watch(weights)
      y = tf.gather(weights, i) ** 2
    return lax.psum(tape.gradient(y, weights), "i")

  expected = np.zeros(4, np.float32)
  for d in range(N):
    index = int(x[d, 0]) // 4 % 4
    expected[index] += 2 * w[index]
  out = run(grad, w, x, in_axes=(None, 0))
  np.testing.assert_allclose(out, np.broadcast_to(expected, (N, 4)))


def test_a_print_in_the_untaken_branch_does_not_print(capfd):
  def shout(v):
    i = lax.axis_index("i")
    return tf.cond(i == 2, lambda: (tf.print("device", i), v + 1)[1],
                   lambda: v)

  np.testing.assert_array_equal(run(shout, rows()),
                                rows() + (np.arange(N) == 2)[:, None])
  assert capfd.readouterr().err.count("device") == 1


@pytest.mark.parametrize("segment_op, reference", [
    (tf.math.segment_sum, lambda v: v.sum() if v.size else 0.),
    (tf.math.segment_mean, lambda v: v.mean() if v.size else 0.),
    (tf.math.segment_max, lambda v: v.max() if v.size else 0.),
    (tf.math.segment_min, lambda v: v.min() if v.size else 0.),
    (tf.math.segment_prod, lambda v: v.prod() if v.size else 1.),
], ids=["sum", "mean", "max", "min", "prod"])
def test_segment_reductions_over_constant_ids_have_a_static_size(
    segment_op, reference):
  x = rows() - 10.
  ids = np.array([0, 0, 2, 2])
  out = run(lambda v: segment_op(v, ids.tolist()) * 2., x)
  expected = [[reference(x[d][ids == s]) * 2. for s in range(3)]
              for d in range(N)]
  np.testing.assert_allclose(out, expected, rtol=1e-6)
