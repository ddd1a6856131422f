"""Collectives with axis_index_groups against a NumPy reference, on 8 devices.

The reference runs each group on its own: device d's group lists the
devices `members`, d is the k-th of them, and its result is the
collective's result over `[x[m] for m in members]` at position k (the
order the group lists, as in JAX).
"""

import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from tfspmd import lax

import numpy_reference
from numpy_reference import data

N = 8
GROUPS = {
    "halves": [[0, 1, 2, 3], [4, 5, 6, 7]],
    "strided": [[0, 4], [1, 5], [2, 6], [3, 7]],
    "shuffled": [[3, 0], [6, 1], [2, 7], [5, 4]],
}


def run(function, *args, debug=False):
  return np.asarray(tfspmd.pmap(function, axis_name="i", debug=debug)(*args))


def grouped(x, groups, per_device):
  """`per_device(group_values, k)` for each device d, the k-th of its group."""
  results = [None] * len(x)
  for members in groups:
    values = [x[m] for m in members]
    for k, m in enumerate(members):
      results[m] = per_device(values, k)
  return np.stack(results)


def exchange(values, k, split, concat):
  """all_to_all's result at position k: block k of each, joined at `concat`."""
  return np.stack([np.take(v, k, axis=split) for v in values], axis=concat)


def cases(size):
  """name -> (collective(groups), input shape, reference(values, k))."""
  return {
      "psum": (lambda g: lambda v: lax.psum(v, "i", axis_index_groups=g),
               (3,), lambda vs, k: np.sum(vs, 0)),
      "pmean": (lambda g: lambda v: lax.pmean(v, "i", axis_index_groups=g),
                (3,), lambda vs, k: np.mean(vs, 0)),
      "pmax": (lambda g: lambda v: lax.pmax(v, "i", axis_index_groups=g),
               (3,), lambda vs, k: np.max(vs, 0)),
      "pmin": (lambda g: lambda v: lax.pmin(v, "i", axis_index_groups=g),
               (3,), lambda vs, k: np.min(vs, 0)),
      "all_gather": (
          lambda g: lambda v: lax.all_gather(v, "i", axis_index_groups=g),
          (3,), lambda vs, k: np.stack(vs)),
      "all_gather_axis_1": (
          lambda g: lambda v: lax.all_gather(v, "i", axis=1,
                                             axis_index_groups=g),
          (2, 3), lambda vs, k: np.stack(vs, 1)),
      "all_gather_tiled": (
          lambda g: lambda v: lax.all_gather(v, "i", tiled=True,
                                             axis_index_groups=g),
          (2,), lambda vs, k: np.concatenate(vs)),
      "psum_scatter": (
          lambda g: lambda v: lax.psum_scatter(v, "i", axis_index_groups=g),
          (size, 3), lambda vs, k: np.sum(vs, 0)[k]),
      "psum_scatter_dimension_1_tiled": (
          lambda g: lambda v: lax.psum_scatter(
              v, "i", scatter_dimension=1, tiled=True, axis_index_groups=g),
          (2, 2 * size), lambda vs, k: np.split(np.sum(vs, 0), size, 1)[k]),
      "all_to_all": (
          lambda g: lambda v: lax.all_to_all(v, "i", 0, 0,
                                             axis_index_groups=g),
          (size, 2), lambda vs, k: exchange(vs, k, 0, 0)),
      "all_to_all_split_1_concat_0": (
          lambda g: lambda v: lax.all_to_all(v, "i", 1, 0,
                                             axis_index_groups=g),
          (3, size), lambda vs, k: exchange(vs, k, 1, 0)),
      "all_to_all_tiled": (
          lambda g: lambda v: lax.all_to_all(v, "i", 0, 1, tiled=True,
                                             axis_index_groups=g),
          (2 * size, 3), lambda vs, k: np.concatenate(
              [np.split(v, size)[k] for v in vs], 1)),
      "pswapaxes": (
          lambda g: lambda v: lax.pswapaxes(v, "i", 1, axis_index_groups=g),
          (2, size), lambda vs, k: exchange(vs, k, 1, 1)),
  }


@pytest.mark.parametrize("groups", sorted(GROUPS))
@pytest.mark.parametrize("name", sorted(cases(1)))
def test_collective_within_groups(name, groups):
  members = GROUPS[groups]
  collective, shape, reference = cases(len(members[0]))[name]
  x = data(N, *shape)
  np.testing.assert_allclose(run(collective(members), x),
                             grouped(x, members, reference), rtol=1e-5,
                             atol=1e-6)


def test_psum_example_from_jax():
  got = run(lambda v: lax.psum(v, "i", axis_index_groups=[[0, 1], [2, 3]]),
            np.arange(4.0, dtype=np.float32))
  np.testing.assert_array_equal(got, [1., 1., 5., 5.])


def test_all_gather_keeps_the_order_the_group_lists():
  got = run(lambda v: lax.all_gather(v, "i",
                                     axis_index_groups=[[3, 0], [2, 1]]),
            np.arange(4))
  np.testing.assert_array_equal(got, [[3, 0], [2, 1], [2, 1], [3, 0]])


def test_psum_of_a_constant_is_the_group_size():
  def f(v):
    return v * lax.psum(1, "i", axis_index_groups=GROUPS["strided"])
  np.testing.assert_array_equal(run(f, np.ones(N, np.float32)), np.full(N, 2.))


def test_same_value_on_every_device():
  # A value that does not vary along the axis takes the step's short path.
  def f(_):
    return (lax.psum(tf.constant(3.), "i", axis_index_groups=GROUPS["halves"]),
            lax.all_gather(tf.constant(3.), "i",
                           axis_index_groups=GROUPS["shuffled"]),
            lax.psum_scatter(tf.ones(2), "i",
                             axis_index_groups=GROUPS["shuffled"]))
  total, gathered, scattered = tfspmd.pmap(f, axis_name="i")(np.zeros(N))
  np.testing.assert_array_equal(np.asarray(total), np.full(N, 12.))
  np.testing.assert_array_equal(np.asarray(gathered), np.full((N, 2), 3.))
  np.testing.assert_array_equal(np.asarray(scattered), np.full(N, 2.))


def test_bool_psum_counts_within_groups():
  x = np.array([True, True, False, True, False, False, True, True])
  got = run(lambda b: lax.psum(b, "i", axis_index_groups=GROUPS["halves"]), x)
  np.testing.assert_array_equal(got, [3, 3, 3, 3, 2, 2, 2, 2])


@pytest.mark.parametrize("name", ["psum", "all_gather", "psum_scatter",
                                  "all_to_all"])
def test_debug_mode_gives_the_compiled_result(name):
  members = GROUPS["shuffled"]
  collective, shape, reference = cases(2)[name]
  x = data(N, *shape)
  np.testing.assert_allclose(run(collective(members), x, debug=True),
                             grouped(x, members, reference), rtol=1e-5)


# --- nested pmaps: rows 'r' (2) x columns 'c' (4) -----------------------------


def nested(function, debug=False):
  return tfspmd.pmap(tfspmd.pmap(function, axis_name="c", debug=debug),
                     axis_name="r", debug=debug)


def over_linear(x, names, groups, per_device):
  """`grouped` over the linear index of `names` of a [2, 4, ...] value."""
  order = [("r", "c").index(n) for n in names]
  inverse = list(np.argsort(order))
  moved = np.transpose(x, order + list(range(2, x.ndim)))
  flat = moved.reshape((8,) + x.shape[2:])
  result = grouped(flat, groups, per_device)
  shaped = result.reshape(moved.shape[:2] + result.shape[1:])
  return np.transpose(shaped, inverse + list(range(2, shaped.ndim)))


@pytest.mark.parametrize("debug", [False, True])
@pytest.mark.parametrize("names", [("r", "c"), ("c", "r")])
def test_nested_over_a_tuple_of_axes(names, debug):
  members = GROUPS["shuffled"]
  x = data(2, 4, 2)

  def f(v):
    return (lax.psum(v, names, axis_index_groups=members),
            lax.all_gather(v, names, axis_index_groups=members),
            lax.all_to_all(v, names, 0, 0, axis_index_groups=members))

  total, gathered, exchanged = nested(f, debug)(x)
  np.testing.assert_allclose(
      np.asarray(total),
      over_linear(x, names, members, lambda vs, k: np.sum(vs, 0)), rtol=1e-5)
  np.testing.assert_array_equal(
      np.asarray(gathered),
      over_linear(x, names, members, lambda vs, k: np.stack(vs)))
  np.testing.assert_array_equal(
      np.asarray(exchanged),
      over_linear(x, names, members, lambda vs, k: exchange(vs, k, 0, 0)))


def test_nested_over_one_axis():
  x = data(2, 4, 2)

  def f(v):
    return (lax.psum(v, "c", axis_index_groups=[[0, 3], [2, 1]]),
            lax.all_gather(v, "c", axis_index_groups=[[0, 3], [2, 1]]),
            lax.pmax(v, "r", axis_index_groups=[[1, 0]]))

  total, gathered, biggest = nested(f)(x)
  for r in range(2):
    np.testing.assert_allclose(
        np.asarray(total)[r],
        grouped(x[r], [[0, 3], [2, 1]], lambda vs, k: np.sum(vs, 0)),
        rtol=1e-5)
    np.testing.assert_array_equal(
        np.asarray(gathered)[r],
        grouped(x[r], [[0, 3], [2, 1]], lambda vs, k: np.stack(vs)))
  np.testing.assert_array_equal(np.asarray(biggest),
                                np.broadcast_to(x.max(0), x.shape))


def test_shard_map_over_both_mesh_axes():
  members = GROUPS["shuffled"]
  mesh = tfspmd.Mesh(np.array(tfspmd.devices()[:N]).reshape(2, 4), ("r", "c"))
  f = tfspmd.shard_map(
      lambda v: lax.psum(v, ("r", "c"), axis_index_groups=members), mesh=mesh,
      in_specs=tfspmd.P("r", "c"), out_specs=tfspmd.P("r", "c"))
  x = data(2, 4)
  np.testing.assert_allclose(
      np.asarray(f(x)),
      over_linear(x, ("r", "c"), members, lambda vs, k: np.sum(vs, 0)),
      rtol=1e-5)


# --- gradients ----------------------------------------------------------------


def per_device_gradient(collective, x, cotangent, debug=False):
  """The gradient, on each device, of sum(cotangent_i * collective(x)_i)."""
  def f(v, w):
    with tf.GradientTape() as tape:
      tape.watch(v)
      objective = tf.reduce_sum(collective(v) * w)
    return tape.gradient(objective, v)
  return run(f, x, cotangent, debug=debug)


def numeric_gradient(program, x, cotangent):
  return numpy_reference.finite_difference(
      lambda value: float(np.sum(cotangent * program(value))), x)


@pytest.mark.parametrize("name", [
    "psum", "pmax", "all_gather_tiled", "psum_scatter",
    "all_to_all_split_1_concat_0"])
def test_gradient_matches_finite_differences(name):
  members = GROUPS["shuffled"]
  collective, shape, _ = cases(2)[name]
  function = collective(members)
  x = data(N, *shape)
  out_shape = tfspmd.pmap(function, axis_name="i")(x).shape[1:]
  cotangent = data(N, *out_shape, seed=1)
  expected = numeric_gradient(lambda v: run(function, v), x, cotangent)
  np.testing.assert_allclose(per_device_gradient(function, x, cotangent),
                             expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("debug", [False, True])
def test_psum_gradient_is_the_grouped_psum_of_cotangents(debug):
  members = GROUPS["strided"]
  x = data(N, 3)
  cotangent = data(N, 3, seed=1)
  grad = per_device_gradient(
      lambda v: lax.psum(v, "i", axis_index_groups=members), x, cotangent,
      debug=debug)
  np.testing.assert_allclose(
      grad, grouped(cotangent, members, lambda vs, k: np.sum(vs, 0)),
      rtol=1e-5)


def test_gradient_with_the_tape_around_the_pmap():
  members = GROUPS["shuffled"]
  x = tf.constant(data(N, 3))
  cotangent = data(N, 3, seed=1)
  mapped = tfspmd.pmap(
      lambda v: lax.psum(v * v, "i", axis_index_groups=members), axis_name="i")
  with tf.GradientTape() as tape:
    tape.watch(x)
    loss = tf.reduce_sum(tf.convert_to_tensor(mapped(x)) * cotangent)
  summed = grouped(cotangent, members, lambda vs, k: np.sum(vs, 0))
  np.testing.assert_allclose(tape.gradient(loss, x), 2 * x.numpy() * summed,
                             rtol=1e-5)


def test_gradient_over_a_tuple_of_axes_in_nested_pmaps():
  members = GROUPS["shuffled"]
  x = data(2, 4, 3)
  cotangent = data(2, 4, 3, seed=1)

  def gradient(v, w):
    with tf.GradientTape() as tape:
      tape.watch(v)
      objective = tf.reduce_sum(
          lax.psum(v, ("c", "r"), axis_index_groups=members) * w)
    return tape.gradient(objective, v)

  np.testing.assert_allclose(
      np.asarray(nested(gradient)(x, cotangent)),
      over_linear(cotangent, ("c", "r"), members, lambda vs, k: np.sum(vs, 0)),
      rtol=1e-5)
