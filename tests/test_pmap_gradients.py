"""A GradientTape around a pmap call, and the convention for invariant losses.

Expected gradients are written out with NumPy (analytic) or come from
central finite differences of the pmapped program.
"""

import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from tfspmd import lax

import numpy_reference
from numpy_reference import data


def tape_gradient(mapped, x, weights):
  x = tf.constant(x)
  with tf.GradientTape() as tape:
    tape.watch(x)
    loss = tf.reduce_sum(mapped(x) * weights)
  return tape.gradient(loss, x).numpy()


def test_mapped_input_through_psum_matches_numpy():
  x = data(4, 3)
  grad = tape_gradient(tfspmd.pmap(lambda v: v * lax.psum(v, "i"), "i"), x, 1.)
  # d/dx_k sum_i x_i * S = S + sum_i x_i = 2 S, S = sum_i x_i.
  np.testing.assert_allclose(grad, np.broadcast_to(2 * x.sum(0), x.shape), rtol=1e-5)


def test_broadcast_input_and_read_variable_match_numpy():
  x, w = data(4, 2), data(2, seed=1)
  v = tf.Variable(data(2, seed=2))
  w_tensor = tf.constant(w)
  f = tfspmd.pmap(lambda a, b: a * b * v, "i", in_axes=(0, None))
  with tf.GradientTape() as tape:
    tape.watch(w_tensor)
    loss = tf.reduce_sum(f(x, w_tensor))
  grad_w, grad_v = tape.gradient(loss, [w_tensor, v])
  np.testing.assert_allclose(grad_w, (x * v.numpy()).sum(0), rtol=1e-5)
  np.testing.assert_allclose(grad_v, (x * w).sum(0), rtol=1e-5)


@pytest.mark.parametrize("name", ["all_gather", "ppermute", "psum_scatter",
                                  "all_to_all", "pmax"])
def test_collectives_inside_match_finite_differences(name):
  collectives = {
      "all_gather": lambda v: lax.all_gather(v, "i") * v[0],
      "ppermute": lambda v: lax.ppermute(v, "i", [(0, 1), (1, 3), (3, 0)]) * v,
      "psum_scatter": lambda v: lax.psum_scatter(v * v, "i", tiled=True),
      "all_to_all": lambda v: lax.all_to_all(v, "i", 0, 0) ** 2,
      "pmax": lambda v: lax.pmax(v, "i") * v,
  }
  mapped = tfspmd.pmap(collectives[name], "i")
  x = data(4, 4)
  weights = data(*np.asarray(mapped(x)).shape, seed=3)
  expected = numpy_reference.finite_difference(
      lambda value: float(np.sum(np.asarray(mapped(value)) * weights)), x)
  np.testing.assert_allclose(tape_gradient(mapped, x, weights), expected,
                             rtol=2e-2, atol=2e-2)


def test_an_output_returned_once_is_one_value():
  x = data(4, 3)
  f = tfspmd.pmap(lambda v: lax.psum(v ** 2, "i"), "i", out_axes=None)
  np.testing.assert_allclose(tape_gradient(f, x, 1.), 2 * x, rtol=1e-5)


def test_nested_pmaps_under_a_tape():
  x = data(2, 4, 2)
  f = tfspmd.pmap(tfspmd.pmap(lambda v: v * lax.psum(v, ("i", "j")),
                              axis_name="j"), axis_name="i")
  np.testing.assert_allclose(tape_gradient(f, x, 1.),
                             np.broadcast_to(2 * x.sum((0, 1)), x.shape), rtol=1e-5)


def test_integer_inputs_get_no_gradient_and_results_are_tensors():
  x, k = tf.constant(data(4, 2)), tf.range(4)
  with tf.GradientTape() as tape:
    tape.watch(x)
    out = tfspmd.pmap(lambda a, b: a * tf.cast(b, tf.float32), "i")(x, k)
    loss = tf.reduce_sum(out)
  assert isinstance(out, tf.Tensor)
  grad_x, grad_k = tape.gradient(loss, [x, k])
  np.testing.assert_allclose(grad_x, np.broadcast_to(np.arange(4.)[:, None], (4, 2)))
  assert grad_k is None
  assert isinstance(tfspmd.pmap(lambda a: a)(x), tfspmd.ShardedArray)


def test_gradient_of_an_invariant_loss_counts_every_devices_copy():
  """psum(loss) differentiated inside: each device seeds its copy of it.

  A GradientTape inside the mapped function differentiates that device's
  program, whose output psum(loss) is one of n copies of the total; the
  transpose of psum is psum, so the gradient is n times the device's own
  d loss_i / d w (the behaviour of JAX issue 3970; JAX since its
  varying-manual-axes typing gives 1 times). Differentiate the local loss
  and pmean the gradients to get the data-parallel gradient.
  """
  x, w = data(4, 3), data(3, seed=1)

  def grads(v, weights):
    with tf.GradientTape(persistent=True) as tape:
      tape.watch(weights)
      local = tf.reduce_sum(v * weights) ** 2
      total = lax.psum(local, "i")
    return tape.gradient(total, weights), lax.pmean(tape.gradient(local, weights), "i")

  of_total, mean_of_local = tfspmd.pmap(grads, "i", in_axes=(0, None))(x, w)
  local = 2 * (x @ w)[:, None] * x
  np.testing.assert_allclose(of_total, 4 * local, rtol=1e-5)
  np.testing.assert_allclose(mean_of_local, np.broadcast_to(local.mean(0), (4, 3)), rtol=1e-5)


def test_unsupported_outer_gradient_raises_instead_of_a_wrong_number():
  f = tfspmd.pmap(tfspmd.pmap(lambda v: lax.pmax(v, "i") * v, axis_name="j"),
                  axis_name="i")
  x = tf.constant(data(2, 4))
  with pytest.raises(NotImplementedError, match="open the tape inside"):
    with tf.GradientTape() as tape:
      tape.watch(x)
      loss = tf.reduce_sum(f(x))
    tape.gradient(loss, x)
