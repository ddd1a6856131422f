"""tfspmd.vmap: vectorizing with named axes, alone and with pmap.

Expected values are NumPy arithmetic on the slices.
"""

import collections

import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from tfspmd import lax

from numpy_reference import data


def test_maps_over_the_given_axes_of_pytrees():
  Pair = collections.namedtuple("Pair", "a b")
  x, y = data(3, 4), data(4, 3, seed=1)
  f = tfspmd.vmap(lambda p, s: {"sum": p.a + p.b, "scaled": p.a * s},
                  in_axes=(Pair(0, 1), None), out_axes={"sum": 1, "scaled": 0})
  out = f(Pair(x, y), np.float32(2.))
  np.testing.assert_allclose(out["sum"], (x + y.T).T, rtol=1e-6)
  np.testing.assert_allclose(out["scaled"], x * 2, rtol=1e-6)


def test_keyword_arguments_and_axis_size():
  out = tfspmd.vmap(lambda x, *, y: x + y)(np.ones(3, np.float32),
                                          y=np.arange(3, dtype=np.float32))
  np.testing.assert_array_equal(out, [1., 2., 3.])
  ranks = tfspmd.vmap(lambda: lax.axis_index("k"), axis_name="k",
                      axis_size=5)()
  np.testing.assert_array_equal(ranks, np.arange(5))


def test_out_axes_none_for_a_reduced_output():
  x = data(5, 2)
  out = tfspmd.vmap(lambda v: lax.psum(v, "b"), axis_name="b",
                    out_axes=None)(x)
  np.testing.assert_allclose(out, x.sum(0), rtol=1e-5)


def test_collectives_over_a_vmapped_axis():
  x = data(4, 4, 2)
  ring = [(k, (k + 1) % 4) for k in range(4)]

  def f(v):
    return (lax.psum(v, "b"), lax.pmean(v, "b"), lax.pmax(v, "b"),
            lax.all_gather(v, "b"), lax.psum_scatter(v, "b"),
            lax.ppermute(v, "b", ring), lax.all_to_all(v, "b", 0, 0),
            lax.axis_index("b"))

  out = [np.asarray(o) for o in tfspmd.vmap(f, axis_name="b")(x)]
  np.testing.assert_allclose(out[0], np.broadcast_to(x.sum(0), x.shape), rtol=1e-5)
  np.testing.assert_allclose(out[1], np.broadcast_to(x.mean(0), x.shape), rtol=1e-5)
  np.testing.assert_array_equal(out[2], np.broadcast_to(x.max(0), x.shape))
  np.testing.assert_array_equal(out[3], np.broadcast_to(x, (4,) + x.shape))
  np.testing.assert_allclose(out[4], x.sum(0), rtol=1e-5)
  np.testing.assert_array_equal(out[5], np.roll(x, 1, axis=0))
  np.testing.assert_array_equal(out[6], np.swapaxes(x, 0, 1))
  np.testing.assert_array_equal(out[7], np.arange(4))


def test_vmap_inside_pmap_with_collectives_over_both_names():
  x = data(4, 3, 2)

  def per_example(v):
    return (lax.psum(v, "b"), lax.psum(v, "i"), lax.psum(v, ("i", "b")),
            lax.all_gather(v, ("i", "b")), lax.axis_index(("i", "b")),
            lax.ppermute(v, "b", [(0, 1), (1, 2), (2, 0)]))

  out = [np.asarray(o) for o in tfspmd.pmap(
      tfspmd.vmap(per_example, axis_name="b"), axis_name="i")(x)]
  np.testing.assert_allclose(out[0], np.broadcast_to(x.sum(1, keepdims=True), x.shape), rtol=1e-5)
  np.testing.assert_allclose(out[1], np.broadcast_to(x.sum(0, keepdims=True), x.shape), rtol=1e-5)
  np.testing.assert_allclose(out[2], np.broadcast_to(x.sum((0, 1), keepdims=True), x.shape),
                             rtol=1e-5)
  np.testing.assert_array_equal(out[3], np.broadcast_to(x.reshape(12, 2), (4, 3, 12, 2)))
  np.testing.assert_array_equal(out[4], np.arange(12).reshape(4, 3))
  np.testing.assert_array_equal(out[5], np.roll(x, 1, axis=1))


def test_exchanges_over_a_vmapped_axis_inside_pmap():
  # The pmap's own axis moves blocks with DTensor's all-to-all; a vmap's
  # axis is not split over devices and must not take that route.
  x = data(4, 2, 2, 4)

  def per_example(v):
    return (lax.all_to_all(v, "b", 0, 0), lax.psum_scatter(v, "b"),
            lax.pswapaxes(v, "i", 1),
            lax.psum_scatter(v, "i", scatter_dimension=1, tiled=True))

  out = [np.asarray(o) for o in tfspmd.pmap(
      tfspmd.vmap(per_example, axis_name="b"), axis_name="i")(x)]
  np.testing.assert_array_equal(out[0], np.swapaxes(x, 1, 2))
  np.testing.assert_allclose(out[1], x.sum(1), rtol=1e-5)
  np.testing.assert_array_equal(out[2], np.transpose(x, (3, 1, 2, 0)))
  np.testing.assert_allclose(out[3], np.transpose(x.sum(0), (2, 0, 1))[..., None],
                             rtol=1e-5)


def test_pmap_inside_vmap_inside_pmap():
  y = data(2, 3, 4)
  f = tfspmd.pmap(tfspmd.vmap(tfspmd.pmap(
      lambda v: lax.psum(v, ("i", "j")) + lax.pmax(v, "b"), axis_name="j"),
                              axis_name="b"), axis_name="i")
  expected = y.sum((0, 2), keepdims=True) + y.max(1, keepdims=True)
  np.testing.assert_allclose(np.asarray(f(y)), expected, rtol=1e-5)


def test_nested_vmaps_and_linear_axis_index():
  f = tfspmd.vmap(tfspmd.vmap(
      lambda v: v + tf.cast(lax.axis_index(("a", "c")), tf.float32)
      - lax.pmean(v, "a"), axis_name="c"), axis_name="a")
  x = data(2, 3)
  np.testing.assert_allclose(
      f(x), x + np.arange(6).reshape(2, 3) - x.mean(0, keepdims=True),
      rtol=1e-5, atol=1e-6)


def test_gradient_through_vmap_with_a_collective():
  x = tf.constant(data(4, 3))
  with tf.GradientTape() as tape:
    tape.watch(x)
    y = tfspmd.vmap(lambda v: v * lax.psum(v, "b"), axis_name="b")(x)
    loss = tf.reduce_sum(y)
  # d/dx_k sum_j x_j * S with S = sum_j x_j: S + sum_j x_j = 2S per column.
  np.testing.assert_allclose(tape.gradient(loss, x),
                             np.broadcast_to(2 * x.numpy().sum(0), (4, 3)), rtol=1e-5)


def test_vmap_in_a_users_tf_function():
  f = tfspmd.vmap(lambda v: v - lax.pmean(v, "b"), axis_name="b")
  loop = tf.function(lambda x: f(f(x)))
  x = data(3, 2)
  np.testing.assert_allclose(loop(x), x - x.mean(0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("value", [True, False, 2, 2.5, "double", "", None])
def test_an_unmapped_python_value_reaches_the_function_as_it_is(value):
  # As in jax.vmap (JAX 0.10.2 passes each of these through, its type
  # unchanged), the function may branch on it in Python.
  seen = []

  def scale(x, flag):
    seen.append(flag)
    return x * 2 if flag else x

  x = np.arange(3, dtype=np.float32)
  out = tfspmd.vmap(scale, in_axes=(0, None))(x, value)
  np.testing.assert_array_equal(out, x * 2 if value else x)
  assert all(type(s) is type(value) and s == value for s in seen), seen
  inside = tfspmd.pmap(lambda rows: tfspmd.vmap(scale, in_axes=(0, None))(
      rows, value))(np.tile(x, (8, 1)))
  np.testing.assert_array_equal(inside, np.tile(x * 2 if value else x, (8, 1)))


def test_errors_name_vmap_and_the_argument():
  with pytest.raises(ValueError, match="vmap got inconsistent sizes"):
    tfspmd.vmap(lambda a, b: a + b)(np.zeros(3), np.zeros(4))
  with pytest.raises(ValueError, match="already bound"):
    tfspmd.pmap(tfspmd.vmap(lambda v: v, axis_name="i"), axis_name="i")(
        np.zeros((2, 3)))
  with pytest.raises(ValueError, match=r"in_axes.*args\[0\]"):
    tfspmd.vmap(lambda a: a, in_axes=2)(np.zeros(3))
  with pytest.raises(NameError, match="unbound axis name: 'z'"):
    tfspmd.vmap(lambda v: lax.psum(v, "z"), axis_name="b")(np.zeros(3))
  with pytest.raises(TypeError, match="`fun` must be callable"):
    tfspmd.vmap(3)
