"""Loops, conditionals, randomness and gather-swap on a 2 x 4 mesh (nested pmaps).

Expectations are NumPy, device by device, over the outer axis 'r' and the
inner axis 'c'.
"""

import numpy as np
import tensorflow as tf

import tfspmd
from tfspmd import lax

from executors import as_the_program_runs
import numpy_reference

R, C = 2, 4


def data(*shape, seed=0):
  return np.random.default_rng(seed).standard_normal((R, C) + shape).astype(
      np.float32)


def nested(fun, *args, inner=None, outer=None):
  inner = inner or {}
  outer = outer or {}
  return np.asarray(tfspmd.pmap(tfspmd.pmap(fun, "c", **inner), "r", **outer)(
      *args))


def test_cond_per_device_on_a_2d_mesh():
  x = data(3)
  out = nested(lambda v: tf.cond(tf.reduce_sum(v) > 0, lambda: v * 10.,
                                 lambda: -v), x)
  np.testing.assert_allclose(
      out, np.where(x.sum(-1, keepdims=True) > 0, 10 * x, -x), rtol=1e-6)


def test_scan_with_a_psum_over_both_axes():
  x = data(3)
  out = nested(lambda v: tf.scan(lambda a, e: a + lax.psum(e, ("r", "c")), v),
               x)
  totals = x.sum((0, 1))
  later = np.concatenate([[0.], np.cumsum(totals[1:])])
  np.testing.assert_allclose(out, x[..., :1] + later, rtol=1e-5, atol=1e-5)


def test_loop_with_collectives_over_each_axis():
  x = data(3)
  out = nested(lambda v: tf.while_loop(
      lambda k, c: k < 2,
      lambda k, c: (k + 1, lax.pmean(c, "c") + lax.psum(c, "r")), (0, v))[1], x)
  c = x.astype(np.float64)
  for _ in range(2):
    c = c.mean(1, keepdims=True) + c.sum(0, keepdims=True)
  np.testing.assert_allclose(out, c, rtol=1e-5)


def test_seed_folded_with_the_linear_index_of_both_axes():
  seed = np.array([1, 2], np.int32)
  out = nested(lambda s: tf.random.stateless_normal(
      [2], seed=tf.random.experimental.stateless_fold_in(
          s, lax.axis_index(("r", "c")))), seed,
               inner=dict(in_axes=None, axis_size=C),
               outer=dict(in_axes=None, axis_size=R))
  draw = as_the_program_runs(lambda k: tf.random.stateless_normal(
      [2], seed=tf.random.experimental.stateless_fold_in(seed, k)))
  expected = np.stack([draw(k).numpy()
                       for k in range(R * C)]).reshape(R, C, 2)
  np.testing.assert_array_equal(out, expected)


def test_pswapaxes_after_an_all_gather_over_the_inner_axis():
  v = data(C, 3, seed=1)
  out = nested(lambda w: lax.pswapaxes(w + lax.all_gather(w[0], "c"), "c", 0),
               v)
  # Device (r, c) gets row c of every device (r, j): v[r, j, c] + v[r, c, 0].
  expected = np.swapaxes(v, 1, 2) + v[:, :, None, 0, :]
  np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_gradient_through_a_loop_with_a_psum_over_the_outer_axis():
  x = data(3) * 0.5

  def grad(v):
    with tf.GradientTape() as tape:
      tape.watch(v)
      y = tf.while_loop(lambda k, c: k < 2,
                        lambda k, c: (k + 1, lax.psum(c * c, "r") * 0.1),
                        (0, v), maximum_iterations=2)[1]
      loss = tf.reduce_sum(y)
    return tape.gradient(loss, v)

  def total_loss(flat):
    c = flat.reshape(x.shape)
    for _ in range(2):
      c = np.broadcast_to((c * c).sum(0, keepdims=True) * 0.1, c.shape)
    return c.sum()

  expected = numpy_reference.finite_difference(
      total_loss, x.astype(np.float64).reshape(-1), eps=1e-5).reshape(x.shape)
  np.testing.assert_allclose(nested(grad, x), expected, rtol=1e-4, atol=1e-6)
