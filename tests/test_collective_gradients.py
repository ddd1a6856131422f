"""Gradients through each collective inside the mapped function.

A GradientTape inside the per-device function differentiates the
per-device program: each device seeds its own output with a cotangent, and
a collective's transpose carries cotangents back across devices. The
expected gradients are written out per device with NumPy, and checked
against central finite differences of the whole program. The FSDP chain of
all_gathers is also differentiated with the tape around the call.
"""

import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from tfspmd import lax

import numpy_reference

N = 4


def per_device_gradient(collective, x, cotangent):
  """The gradient, on each device, of sum(cotangent_i * collective(x)_i)."""
  def f(v, w):
    with tf.GradientTape() as tape:
      tape.watch(v)
      y = collective(v)
      objective = tf.reduce_sum(y * w)
    return tape.gradient(objective, v)
  return np.asarray(tfspmd.pmap(f, axis_name="i")(x, cotangent))


def numeric_gradient(program, x, cotangent):
  """Central differences of sum over devices of cotangent * program(x)."""
  return numpy_reference.finite_difference(
      lambda value: float(np.sum(cotangent * program(value))), x)


def rng_data(*shape, seed=0):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


CASES = {
    "psum": (lambda v: lax.psum(v, "i"), (3,), (3,)),
    "pmean": (lambda v: lax.pmean(v, "i"), (3,), (3,)),
    "all_gather": (lambda v: lax.all_gather(v, "i", axis=1), (3,), (3, N)),
    "all_gather_tiled": (lambda v: lax.all_gather(v, "i", tiled=True), (2,), (2 * N,)),
    "psum_scatter": (lambda v: lax.psum_scatter(v, "i", scatter_dimension=1), (2, N), (2,)),
    "psum_scatter_tiled": (lambda v: lax.psum_scatter(v, "i", tiled=True), (2 * N,), (2,)),
    "ppermute": (lambda v: lax.ppermute(v, "i", [(0, 2), (2, 3), (3, 0)]), (3,), (3,)),
    "all_to_all": (lambda v: lax.all_to_all(v, "i", 0, 1), (N, 2), (2, N)),
    "pswapaxes": (lambda v: lax.pswapaxes(v, "i", 0), (N, 3), (N, 3)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_gradient_matches_finite_differences(name):
  collective, in_shape, out_shape = CASES[name]
  x = rng_data(N, *in_shape)
  cotangent = rng_data(N, *out_shape, seed=1)
  mapped = tfspmd.pmap(collective, axis_name="i")
  expected = numeric_gradient(lambda v: np.asarray(mapped(v)), x, cotangent)
  np.testing.assert_allclose(per_device_gradient(collective, x, cotangent),
                             expected, rtol=2e-2, atol=2e-2)


def test_psum_gradient_is_psum_of_cotangents():
  x = rng_data(N, 3)
  cotangent = rng_data(N, 3, seed=1)
  grad = per_device_gradient(lambda v: lax.psum(v, "i"), x, cotangent)
  np.testing.assert_allclose(grad, np.broadcast_to(cotangent.sum(0), x.shape), rtol=1e-5)


def test_ppermute_gradient_is_the_inverse_permutation():
  x = rng_data(N, 2)
  cotangent = rng_data(N, 2, seed=1)
  perm = [(0, 1), (1, 2), (2, 3), (3, 0)]
  grad = per_device_gradient(lambda v: lax.ppermute(v, "i", perm), x, cotangent)
  np.testing.assert_allclose(grad, np.roll(cotangent, -1, axis=0), rtol=1e-6)


@pytest.mark.parametrize("name, reduce", [("pmax", np.max), ("pmin", np.min)])
def test_extremum_gradient_goes_to_the_arg_extremum(name, reduce):
  collective = getattr(lax, name)
  x = np.array([[1., 5.], [4., 5.], [3., 0.], [4., 2.]], np.float32)
  cotangent = rng_data(N, 2, seed=1)
  grad = per_device_gradient(lambda v: collective(v, "i"), x, cotangent)
  holds = (x == reduce(x, axis=0)).astype(np.float32)
  expected = cotangent.sum(0) * holds / holds.sum(0)
  np.testing.assert_allclose(grad, expected, rtol=1e-5)


TUPLE_CASES = {
    "all_gather": (lambda v: lax.all_gather(v, ("c", "r"), axis=1), (3,), (3, N)),
    "psum_scatter": (lambda v: lax.psum_scatter(v, ("r", "c"), tiled=True),
                     (2 * N,), (2,)),
    "ppermute": (lambda v: lax.ppermute(v, ("r", "c"), [(0, 3), (3, 1), (1, 0)]),
                 (3,), (3,)),
    "all_to_all": (lambda v: lax.all_to_all(v, ("c", "r"), 0, 1), (N, 2), (2, N)),
}


@pytest.mark.parametrize("name", sorted(TUPLE_CASES))
def test_gradient_over_a_tuple_of_axes_matches_finite_differences(name):
  collective, in_shape, out_shape = TUPLE_CASES[name]
  x = rng_data(2, 2, *in_shape)
  cotangent = rng_data(2, 2, *out_shape, seed=1)

  def nested(function):
    return tfspmd.pmap(tfspmd.pmap(function, axis_name="c"), axis_name="r")

  def gradient(v, w):
    with tf.GradientTape() as tape:
      tape.watch(v)
      objective = tf.reduce_sum(collective(v) * w)
    return tape.gradient(objective, v)

  mapped = nested(collective)
  expected = numeric_gradient(lambda v: np.asarray(mapped(v)), x, cotangent)
  np.testing.assert_allclose(np.asarray(nested(gradient)(x, cotangent)),
                             expected, rtol=2e-2, atol=2e-2)


def chained_gathers_loss(w0, w1, w2, x, c):
  """One device's sum(c * x W0 W1 W2), each W all_gather'ed from its rows."""
  for w in (w0, w1, w2):
    x = x @ lax.all_gather(w, "i", tiled=True)
  return tf.reduce_sum(x * c)


def chained_gathers_gradient(*blocks):
  with tf.GradientTape() as tape:
    tape.watch(blocks[:3])
    loss = chained_gathers_loss(*blocks)
  return tape.gradient(loss, blocks[:3])


def tape_inside_pmap(weights, x, c):
  return tfspmd.pmap(chained_gathers_gradient, axis_name="i")(
      *[w.reshape(N, -1, w.shape[1]) for w in weights], x, c)


def tape_around_pmap(weights, x, c):
  blocks = [tf.constant(w.reshape(N, -1, w.shape[1])) for w in weights]
  with tf.GradientTape() as tape:
    tape.watch(blocks)
    losses = tfspmd.pmap(chained_gathers_loss, axis_name="i")(*blocks, x, c)
    loss = tf.reduce_sum(tf.convert_to_tensor(losses))
  return tape.gradient(loss, blocks)


def tape_inside_shard_map(weights, x, c):
  mesh = tfspmd.Mesh(np.array(tfspmd.devices()[:N]), ("i",))
  return tfspmd.shard_map(chained_gathers_gradient, mesh=mesh,
                          in_specs=tfspmd.P("i"), out_specs=tfspmd.P("i"))(
                              *weights, x.reshape(-1, 8), c.reshape(-1, 8))


def tape_around_shard_map(weights, x, c):
  mesh = tfspmd.Mesh(np.array(tfspmd.devices()[:N]), ("i",))
  loss_fn = tfspmd.shard_map(
      lambda *blocks: lax.psum(chained_gathers_loss(*blocks), "i"), mesh=mesh,
      in_specs=tfspmd.P("i"), out_specs=tfspmd.P())
  variables = [tf.Variable(w) for w in weights]
  with tf.GradientTape() as tape:
    loss = tf.convert_to_tensor(loss_fn(*variables, x.reshape(-1, 8),
                                        c.reshape(-1, 8)))
  return tape.gradient(loss, variables)


@pytest.mark.parametrize("gradient", [
    tape_inside_pmap, tape_around_pmap, tape_inside_shard_map,
    tape_around_shard_map])
def test_gradient_through_chained_all_gathers(gradient):
  # The FSDP pattern: each weight split over the devices by rows, gathered
  # where used. The gradient of the middle weight is a psum_scatter of a
  # value DTensor lays out split along its last axis, which came back
  # scrambled while its sum and the other gradients were right.
  weights = [rng_data(8, 8, seed=k) for k in range(3)]
  x = rng_data(N, 2, 8, seed=3)
  c = rng_data(N, 2, 8, seed=4)
  inputs, cotangent = x.reshape(-1, 8), c.reshape(-1, 8)
  w0, w1, w2 = weights
  expected = [inputs.T @ cotangent @ w2.T @ w1.T,
              (inputs @ w0).T @ cotangent @ w2.T,
              (inputs @ w0 @ w1).T @ cotangent]
  for got, want in zip(gradient(weights, x, c), expected):
    np.testing.assert_allclose(np.asarray(got).reshape(8, 8), want,
                               rtol=1e-4, atol=1e-4)
