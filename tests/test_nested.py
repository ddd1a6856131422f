"""Nested pmaps: N-D meshes, collectives over outer, inner and both axes."""

import dataclasses
import functools

import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from tfspmd import lax
from tfspmd._src.runtime import devices as devices_lib


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


# --- nested axes crossing processes: the errors one process can show ------
#
# Each case fakes a second process (tfspmd.process_count() is 2, this one
# process 0): the errors come while the program traces, before any device
# would wait on the other process.


@pytest.fixture(name="two_processes")
def fixture_two_processes(monkeypatch):
  """Fakes 2 processes; returns a devices= list of 2 devices in each."""
  monkeypatch.setattr(devices_lib, "process_count", lambda: 2)
  mine = tfspmd.devices()[:2]
  theirs = [dataclasses.replace(d, process_index=1)
            for d in tfspmd.devices()[2:4]]
  return list(mine) + theirs


def _inner(axis_size, name="i"):
  return tfspmd.pmap(lambda v: lax.psum(v, name), axis_name=name,
                     axis_size=axis_size)


def test_an_axis_size_that_is_no_multiple_of_the_part(two_processes):
  del two_processes
  with pytest.raises(ValueError) as raised:
    tfspmd.pmap(_inner(3), axis_name="o")(np.zeros((1, 2)))
  assert str(raised.value) == (
      "pmap was given axis_size=3, but its mapped arguments have size 2 "
      "along the mapped axis. With several processes a nested pmap's "
      "axis_size is the global size of its axis, and each process passes the "
      "positions of it that its devices hold: a divisor of axis_size "
      "(docs/multiprocess.md).")


def test_global_sizes_that_do_not_divide_the_grid(two_processes):
  del two_processes
  # 2 processes passing 1 x 2 positions: 4, which 'i' (6) does not divide.
  with pytest.raises(ValueError) as raised:
    tfspmd.pmap(_inner(6), axis_name="o")(np.zeros((1, 2)))
  assert str(raised.value) == (
      "pmap: the nested axes crossing processes, 'i' (6), have global sizes "
      "whose product 6 does not divide the 4 grid positions the processes' "
      "inputs hold (2 processes passing 2 each); the outermost axis takes the "
      "positions left, so give those nested pmaps axis_size= values whose "
      "product divides 4, each a multiple of the positions a process passes "
      "along its axis (docs/multiprocess.md).")


_NOT_AN_INPUT = (
    "pmap: the nested pmap over axis 'i' has global size 4, which crosses "
    "processes, but a mapped argument has size 2 and is not an input of the "
    "outermost pmap; with several processes only the outermost pmap's inputs "
    "can be each process's part of an axis crossing processes: map the "
    "inputs of the outermost pmap (docs/multiprocess.md).")


@pytest.mark.parametrize("inner_args", [
    lambda x: (tf.ones([2]),),
    lambda x: (x * 2,),
    lambda x: (x, tf.ones([2])),
], ids=["a constant", "computed from an input", "a constant beside an input"])
def test_a_crossing_axis_over_a_value_that_is_no_input(two_processes,
                                                       inner_args):
  del two_processes
  inner = tfspmd.pmap(lambda *v: lax.psum(sum(v), "i"), axis_name="i",
                      axis_size=4)
  with pytest.raises(ValueError) as raised:
    tfspmd.pmap(lambda x: inner(*inner_args(x)), axis_name="o")(
        np.zeros((1, 2)))
  assert str(raised.value) == _NOT_AN_INPUT


@pytest.mark.parametrize("sizes, shapes, held", [
    ((4, 8), ((1, 2), (1, 2)), "2 of 8"),
    ((4, 4), ((1, 2), (1, 1)), "1 of 4"),
], ids=["other axis sizes", "other parts"])
def test_crossing_pmaps_at_one_depth_that_disagree(two_processes, sizes,
                                                   shapes, held):
  del two_processes
  i, j = _inner(sizes[0], "i"), _inner(sizes[1], "j")
  with pytest.raises(ValueError) as raised:
    tfspmd.pmap(lambda x, y: (i(x), j(y)), axis_name="o")(
        *(np.zeros(shape) for shape in shapes))
  assert str(raised.value) == (
      f"pmap: the nested pmaps over axes 'i' and 'j' run at one depth, so "
      f"they share a mesh dimension, but their axes cross processes "
      f"differently: the inputs of 'i' hold 2 of its 4 positions, those of "
      f"'j' {held}. Give the nested pmaps at one depth the same axis_size, "
      f"and pass each the same positions of it (docs/multiprocess.md).")


@pytest.mark.parametrize("shape", [(1, 2), (2, 2)],
                         ids=["the grid's block", "a device per outer row"])
def test_devices_with_a_crossing_axis(two_processes, shape):
  with pytest.raises(ValueError) as raised:
    tfspmd.pmap(_inner(4), axis_name="o", devices=two_processes)(
        np.zeros(shape))
  assert str(raised.value) == (
      "pmap: the nested pmap over axis 'i' has global size 4, of which its "
      "inputs hold 2 positions, so its axis crosses processes; an axis "
      "crossing processes needs the outermost pmap without devices=. Leave "
      "devices= out: the nested pmaps' axes then form a grid over "
      "tfspmd.devices() in process order (outer axis slowest), and each "
      "process passes, for each mapped input, the block of it that its own "
      "devices hold (docs/multiprocess.md).")


def test_devices_over_processes_keep_their_size_error(two_processes):
  with pytest.raises(ValueError) as raised:
    tfspmd.pmap(lambda v: lax.psum(v, "i"), axis_name="i",
                devices=two_processes)(np.zeros((3, 2)))
  assert str(raised.value) == (
      "pmap was given 4 devices (2 in this process), but the mapped axis has "
      "size 3; with devices=, the mapped size must equal the number of local "
      "devices given.")


def test_devices_over_processes_with_nested_pmaps_that_do_not_fit(
    two_processes):
  # devices= gives the outermost axis its devices, the nested axes none.
  with pytest.raises(ValueError) as raised:
    tfspmd.pmap(tfspmd.pmap(lambda v: v, axis_name="i"), axis_name="o",
                devices=two_processes)(np.zeros((2, 2)))
  assert str(raised.value) == (
      "compiling computation that requires 8 replicas (4 x 2 nested pmaps), "
      "but only 4 devices are available (num_replicas=8).")
