"""pmap(..., steps=K): K iterations of a step function in one call.

Expected values come from NumPy loops over the same steps.
"""

import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from tfspmd import lax

from executors import on_host


def test_running_sum_per_device_and_per_step_outputs():
  x = np.arange(24, dtype=np.float32).reshape(4, 3, 2)
  step = lambda total, v: (total + v, total * 2)
  total, ys = tfspmd.pmap(step, steps=3)(np.zeros((4, 2), np.float32), x)
  np.testing.assert_array_equal(total, x.sum(1))
  expected = np.stack([2 * x[:, :t].sum(1) for t in range(3)], axis=1)
  np.testing.assert_array_equal(ys, expected)


def test_one_step_is_one_call():
  total, ys = tfspmd.pmap(lambda c, v: (c + v, v), steps=1)(
      np.ones(2, np.float32), np.full((2, 1), 5., np.float32))
  np.testing.assert_array_equal(total, [6., 6.])
  np.testing.assert_array_equal(ys, [[5.], [5.]])


def test_the_step_is_traced_once_whatever_the_steps():
  traced = []

  def step(total, v):
    traced.append(total.shape)
    return total + v, total

  x = np.arange(12, dtype=np.float32).reshape(2, 3, 2)
  total, ys = tfspmd.pmap(step, steps=3)(np.zeros((2, 2), np.float32), x)
  np.testing.assert_array_equal(total, x.sum(1))
  np.testing.assert_array_equal(
      ys, np.stack([x[:, :t].sum(1) for t in range(3)], axis=1))
  # On the host executor one trace of the step serves every iteration of
  # the loop; DTensor's executor expands a first step apart from the loop.
  assert len(traced) == (1 if on_host() else 2), traced


def test_data_parallel_regression_matches_numpy_training():
  rng = np.random.default_rng(0)
  devices, steps, batch = 8, 6, 4
  x = rng.standard_normal((devices, steps, batch, 3)).astype(np.float32)
  y = x @ np.array([1., -2., .5], np.float32) + 0.1

  def train_step(params, xb, yb):
    with tf.GradientTape() as tape:
      tape.watch(params)
      w, b = params
      loss = tf.reduce_mean((tf.linalg.matvec(xb, w) + b - yb) ** 2)
    grads = lax.pmean(tape.gradient(loss, params), "i")
    return [p - 0.1 * g for p, g in zip(params, grads)], lax.pmean(loss, "i")

  train = tfspmd.pmap(train_step, "i", in_axes=(None, 0, 0),
                      out_axes=(None, 0), steps=steps)
  params, losses = train([np.zeros(3, np.float32), np.float32(0.)], x, y)

  w, b = np.zeros(3), 0.
  expected_losses = []
  for t in range(steps):
    xb, yb = x[:, t].reshape(-1, 3).astype(np.float64), y[:, t].reshape(-1)
    error = xb @ w + b - yb
    expected_losses.append(np.mean(error ** 2))
    w, b = w - 0.1 * 2 * xb.T @ error / len(yb), b - 0.1 * 2 * error.mean()
  np.testing.assert_allclose(params[0], w, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(params[1], b, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(losses), np.broadcast_to(
      expected_losses, (devices, steps)), rtol=1e-5)


def test_collectives_and_nested_pmaps_inside_the_steps():
  x = np.arange(16, dtype=np.float32).reshape(2, 2, 4)  # device, step, inner

  def step(carry, v):
    inner = tfspmd.pmap(lambda u: lax.psum(u, ("i", "j")), axis_name="j")(v)
    return carry + inner, lax.ppermute(v, "i", [(0, 1), (1, 0)])

  carry, ys = tfspmd.pmap(step, "i", steps=2)(np.zeros((2, 4), np.float32), x)
  np.testing.assert_array_equal(carry, np.full((2, 4), x.sum()))
  np.testing.assert_array_equal(ys, x[::-1])


def test_errors_say_what_steps_needs():
  step = lambda c, v: (c + v, v)
  with pytest.raises(ValueError, match="`steps` must be a positive int"):
    tfspmd.pmap(step, steps=0)
  with pytest.raises(ValueError, match=r"args\[1\] is a per-step input.*length 3"):
    tfspmd.pmap(step, steps=3)(np.zeros(2), np.zeros((2, 4)))
  with pytest.raises(TypeError, match=r"must return a pair \(carry, output\)"):
    tfspmd.pmap(lambda c, v: c + v, steps=2)(np.zeros(2), np.zeros((2, 2)))
  with pytest.raises(TypeError, match="another structure"):
    tfspmd.pmap(lambda c, v: ((c, c), v), steps=2)(np.zeros(2), np.zeros((2, 2)))
  with pytest.raises(TypeError, match=r"carry leaf args\[0\].*keeps its shape"):
    tfspmd.pmap(lambda c, v: (tf.cast(c, tf.int32), v), steps=2)(
        np.zeros(2, np.float32), np.zeros((2, 2), np.float32))
  with pytest.raises(ValueError, match="steps= is for the outermost pmap"):
    tfspmd.pmap(tfspmd.pmap(lambda v: v, axis_name="j", steps=2),
                axis_name="i")(np.zeros((2, 2)))
  with pytest.raises(ValueError, match="out_axes=None for output"):
    tfspmd.pmap(step, steps=2, out_axes=None)(np.zeros(2), np.zeros((2, 2)))
