"""A pmapped function called from inside the user's own tf.function.

The user's function takes the DTensors of pmap results
(`ShardedArray.dtensor_value`), so TensorFlow runs it with DTensor; each
pmap call inside becomes one call op of the user's graph.
"""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfspmd
from tfspmd import lax


def test_training_loop_with_tf_range_matches_numpy():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((8, 16, 3)).astype(np.float32)
  y = x @ np.array([1., -2., .5], np.float32)

  def step(w, xb, yb):
    with tf.GradientTape() as tape:
      tape.watch(w)
      loss = tf.reduce_mean((tf.linalg.matvec(xb, w) - yb) ** 2)
    return w - 0.1 * lax.pmean(tape.gradient(loss, w), "i"), lax.pmean(loss, "i")

  pstep = tfspmd.pmap(step, "i", in_axes=(None, 0, 0), out_axes=None)

  @tf.function
  def train(w, xb, yb):
    loss = tf.constant(0.)
    for _ in tf.range(20):
      w, loss = pstep(w, xb, yb)
    return w, loss

  w0, loss0 = pstep(np.zeros(3, np.float32), x, y)  # places everything once
  placed_x = tfspmd.pmap(lambda v: v)(x)
  placed_y = tfspmd.pmap(lambda v: v)(y)
  w, loss = train(w0.dtensor_value, placed_x.dtensor_value, placed_y.dtensor_value)

  expected = np.zeros(3)
  xs, ys = x.reshape(-1, 3).astype(np.float64), y.reshape(-1)
  for _ in range(21):
    loss_expected = np.mean((xs @ expected - ys) ** 2)
    expected = expected - 0.1 * 2 * xs.T @ (xs @ expected - ys) / len(ys)
  np.testing.assert_allclose(w.numpy(), expected, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(loss.numpy(), loss_expected, rtol=1e-4)
  assert float(loss0) > float(loss)


def test_sharded_results_of_a_users_function_go_back_into_pmap():
  double = tfspmd.pmap(lambda v: v * 2.)
  placed = tfspmd.pmap(lambda v: v + 0.)(np.arange(8, dtype=np.float32))
  twice = tf.function(lambda v: double(double(v)))(placed.dtensor_value)
  np.testing.assert_array_equal(double(twice), np.arange(8) * 8.)


def test_dynamic_shapes_are_a_clear_error():
  f = tfspmd.pmap(lambda v: v)
  g = tf.function(lambda v: f(v),
                  input_signature=[tf.TensorSpec([None], tf.float32)])
  with pytest.raises(ValueError, match="needs static shapes"):
    g.get_concrete_function()


def test_a_sharded_array_given_to_a_users_function_stays_on_the_devices():
  double = tfspmd.pmap(lambda v: v * 2.)
  out = tfspmd.pmap(lambda v: v + 0.)(np.arange(8, dtype=np.float32))
  traces = []

  @tf.function
  def twice(v):
    traces.append(v.shape)
    return double(double(v))

  result = twice(out)
  assert dtensor.is_dtensor(result)
  np.testing.assert_array_equal(dtensor.unpack(result)[3], [12.])
  np.testing.assert_array_equal(double(result), np.arange(8) * 8.)
  twice(out)
  assert traces == [tf.TensorShape([8])]


def test_pmaps_over_two_device_counts_in_one_function():
  double = tfspmd.pmap(lambda v: v * 2.)
  eight = tfspmd.pmap(lambda v: v + 0.)(np.arange(8, dtype=np.float32))
  four = tfspmd.pmap(lambda v: v + 0.)(np.arange(4, dtype=np.float32))
  first, second = tf.function(lambda a, b: (double(a), double(b)))(eight, four)
  np.testing.assert_array_equal(double(first), np.arange(8) * 4.)
  np.testing.assert_array_equal(double(second), np.arange(4) * 4.)
