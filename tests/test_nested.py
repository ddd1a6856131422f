"""Nested pmaps: N-D meshes, collectives over outer, inner and both axes."""

import functools

import numpy as np
import tensorflow as tf

import tfspmd
from tfspmd import lax


def test_psum_over_outer_axis_from_inner_pmap():
  @functools.partial(tfspmd.pmap, axis_name="r")
  @functools.partial(tfspmd.pmap, axis_name="c")
  def f(x):
    return lax.psum(x, "r"), lax.psum(x, "c"), lax.psum(x, ("c", "r"))

  x = np.arange(8., dtype=np.float32).reshape(2, 4)
  by_row, by_col, both = f(x)
  np.testing.assert_allclose(by_row, np.broadcast_to(x.sum(0), x.shape))
  np.testing.assert_allclose(by_col, np.broadcast_to(x.sum(1, keepdims=True), x.shape))
  np.testing.assert_allclose(both, np.full(x.shape, x.sum()))


def test_three_levels_of_nesting_on_a_2x2x2_mesh():
  @functools.partial(tfspmd.pmap, axis_name="a")
  @functools.partial(tfspmd.pmap, axis_name="b")
  @functools.partial(tfspmd.pmap, axis_name="c")
  def f(x):
    index = lax.axis_index(("a", "b", "c"))
    return (lax.psum(x, "a"), lax.psum(x, ("a", "c")),
            lax.psum(x, ("a", "b", "c")), index, lax.axis_index("b"))

  x = np.arange(8 * 3, dtype=np.float32).reshape(2, 2, 2, 3)
  sum_a, sum_ac, total, index, index_b = f(x)
  np.testing.assert_allclose(sum_a, np.broadcast_to(x.sum(0, keepdims=True), x.shape))
  np.testing.assert_allclose(sum_ac, np.broadcast_to(x.sum((0, 2), keepdims=True), x.shape))
  np.testing.assert_allclose(total, np.broadcast_to(x.sum((0, 1, 2), keepdims=True), x.shape))
  np.testing.assert_array_equal(index, np.arange(8).reshape(2, 2, 2))
  np.testing.assert_array_equal(index_b, np.broadcast_to(np.arange(2)[None, :, None], (2, 2, 2)))
  assert total.placement.spec == ("axis_0", "axis_1", "axis_2", None)
  assert len({shard.device for shard in total.addressable_shards}) == 8


def test_nested_inputs_are_split_over_both_mesh_dims():
  inner = tfspmd.pmap(lambda x: x * 2, axis_name="c")
  outer = tfspmd.pmap(inner, axis_name="r")
  x = np.arange(4 * 2 * 3, dtype=np.float32).reshape(4, 2, 3)
  out = outer(x)
  np.testing.assert_allclose(out, x * 2)
  program = next(iter(outer._programs.values()))  # pylint: disable=protected-access
  assert program.input_placements[0].spec == ("axis_0", "axis_1", None)
  assert out.placement.spec == ("axis_0", "axis_1", None)
  for shard in out.addressable_shards:
    assert shard.data.shape == (1, 1, 3)


def test_inner_pmap_over_a_non_leading_axis_with_a_broadcast_weight():
  def layer(x, w):
    # x: (batch,) per outer device, w: (features, batch) split over 'm'.
    return tfspmd.pmap(lambda wm: lax.psum(tf.reduce_sum(wm * x), "m"),
                       axis_name="m", in_axes=1)(w)

  x = np.arange(2 * 3, dtype=np.float32).reshape(2, 3)
  w = np.arange(3 * 4, dtype=np.float32).reshape(3, 4)
  out = tfspmd.pmap(layer, axis_name="d", in_axes=(0, None))(x, w)
  expected = np.stack([np.full(4, np.sum(w * row[:, None])) for row in x])
  np.testing.assert_allclose(out, expected)


def test_outer_out_axes_none_from_nested():
  @functools.partial(tfspmd.pmap, axis_name="r", out_axes=None)
  @functools.partial(tfspmd.pmap, axis_name="c", out_axes=None)
  def total(x):
    return lax.psum(x, ("r", "c"))

  x = np.arange(8., dtype=np.float32).reshape(4, 2)
  out = total(x)
  assert out.shape == ()
  assert float(out) == x.sum()


def test_nested_pmap_with_static_args_and_in_axes_none():
  @functools.partial(tfspmd.pmap, axis_name="r", in_axes=(0, None))
  def outer(x, y):
    return tfspmd.pmap(lambda v, s: v * s + tf.cast(lax.axis_index("r"), v.dtype),
                       axis_name="c",
                       in_axes=(0, None), static_broadcasted_argnums=1)(x, 3.0) + y

  x = np.ones((2, 4), np.float32)
  out = outer(x, np.float32(10.))
  np.testing.assert_allclose(out, 3.0 + 10. + np.arange(2)[:, None] * np.ones((2, 4)))
