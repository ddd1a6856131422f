"""Gradients through each collective inside the mapped function.

A GradientTape inside the per-device function differentiates the
per-device program: each device seeds its own output with a cotangent, and
a collective's transpose carries cotangents back across devices. The
expected gradients are written out per device with NumPy, and checked
against central finite differences of the whole program.
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
