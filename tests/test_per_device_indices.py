"""Scatters and gathers at indices that differ between devices.

Each device scatters into (or gathers from) its own tensor at its own
indices, as a program running on it would; the expectations are NumPy
loops written here, device by device. An index outside the tensor drops
its update, as in XLA and JAX.
"""

import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from tfspmd._src.core import route_log

N = 8


def numpy_scatter(kind, tensor, indices, updates):
  """One device's scatter, update by update in the order given."""
  out = tensor.copy()
  depth = indices.shape[-1]
  rows = updates.reshape((-1,) + tensor.shape[depth:])
  for index, row in zip(indices.reshape(-1, depth), rows):
    if any(i < 0 or i >= d for i, d in zip(index, tensor.shape)):
      continue
    at = tuple(index)
    if kind in ("add", "scatter_nd"):
      out[at] = out[at] + row
    elif kind == "sub":
      out[at] = out[at] - row
    elif kind == "max":
      out[at] = np.maximum(out[at], row)
    elif kind == "min":
      out[at] = np.minimum(out[at], row)
    else:
      out[at] = row
  return out


SCATTERS = {
    "add": tf.tensor_scatter_nd_add,
    "sub": tf.tensor_scatter_nd_sub,
    "max": tf.tensor_scatter_nd_max,
    "min": tf.tensor_scatter_nd_min,
    "update": tf.tensor_scatter_nd_update,
}


def per_device_indices(shape, count, depth, seed):
  """Each device's indices: repeats within a device, some out of range."""
  rng = np.random.default_rng(seed)
  indices = np.stack([rng.integers(0, shape[axis], size=(N, count))
                      for axis in range(depth)], axis=-1).astype(np.int32)
  indices[1, 0] = indices[1, 1]      # two updates to one element
  indices[2, 0, 0] = shape[0]        # past the end: dropped
  indices[3, 1, -1] = -1             # negative: dropped, not wrapped
  return indices


@pytest.mark.parametrize("kind", sorted(SCATTERS))
@pytest.mark.parametrize("shape,depth", [((6,), 1), ((5, 3), 1),
                                         ((4, 5), 2), ((3, 4, 2), 2)])
def test_tensor_scatter_at_per_device_indices(kind, shape, depth):
  rng = np.random.default_rng(len(shape) * 10 + depth)
  tensor = rng.standard_normal((N,) + shape).astype(np.float32)
  indices = per_device_indices(shape, 4, depth, seed=depth)
  updates = rng.standard_normal((N, 4) + shape[depth:]).astype(np.float32)
  scatter = SCATTERS[kind]
  with route_log.recording() as routes:
    got = np.asarray(tfspmd.pmap(scatter)(tensor, indices, updates))
  # Each device's own ops: nothing copied once per position.
  assert route_log.PER_POSITION not in routes, routes
  want = np.stack([numpy_scatter(kind, t, i, u)
                   for t, i, u in zip(tensor, indices, updates)])
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_updates_to_one_element_take_the_last_given():
  indices = np.zeros((N, 3, 1), np.int32)
  updates = np.arange(N * 3, dtype=np.float32).reshape(N, 3)
  got = np.asarray(tfspmd.pmap(
      lambda i, u: tf.tensor_scatter_nd_update(tf.zeros([4]), i, u))(
          indices, updates))
  np.testing.assert_array_equal(got[:, 0], updates[:, -1])
  np.testing.assert_array_equal(got[:, 1:], 0)


def test_scatter_nd_at_per_device_indices_adds_repeats():
  indices = per_device_indices((5, 2), 6, 2, seed=3)
  updates = np.arange(N * 6, dtype=np.int32).reshape(N, 6)
  got = np.asarray(tfspmd.pmap(
      lambda i, u: tf.scatter_nd(i, u, [5, 2]))(indices, updates))
  want = np.stack([numpy_scatter("scatter_nd", np.zeros((5, 2), np.int32),
                                 i, u) for i, u in zip(indices, updates)])
  np.testing.assert_array_equal(got, want)


def test_max_with_infinite_updates_and_a_nan_left_alone():
  tensor = np.zeros((N, 4), np.float32)
  tensor[:, 3] = np.nan
  indices = np.tile(np.array([[0], [1], [1]], np.int32), (N, 1, 1))
  updates = np.tile(np.array([-np.inf, np.inf, 2.], np.float32), (N, 1))
  got = np.asarray(tfspmd.pmap(tf.tensor_scatter_nd_max)(
      tensor, indices, updates))
  np.testing.assert_array_equal(got[:, :3],
                                np.tile([0., np.inf, 0.], (N, 1)))
  assert np.isnan(got[:, 3]).all()


def test_a_scatter_into_a_large_tensor_takes_the_op_itself():
  # 2,000 updates into 1,000 elements is past the comparison's size.
  rng = np.random.default_rng(5)
  indices = rng.integers(0, 1000, size=(N, 2000, 1)).astype(np.int32)
  updates = rng.standard_normal((N, 2000)).astype(np.float32)
  got = np.asarray(tfspmd.pmap(
      lambda i, u: tf.tensor_scatter_nd_add(tf.zeros([1000]), i, u))(
          indices, updates))
  want = np.stack([numpy_scatter("add", np.zeros(1000, np.float32), i, u)
                   for i, u in zip(indices, updates)])
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", sorted(SCATTERS))
@pytest.mark.parametrize("shape,depth", [((1000,), 1), ((40, 30), 2)])
def test_the_ops_own_route_drops_indices_outside_too(kind, shape, depth):
  # Past the comparison's size, each device's scatter is the op itself,
  # whose kernel refuses an index outside; it must drop it as XLA does.
  rng = np.random.default_rng(depth)
  tensor = rng.standard_normal((N,) + shape).astype(np.float32)
  indices = per_device_indices(shape, 2000, depth, seed=7)
  updates = rng.standard_normal((N, 2000) + shape[depth:]).astype(np.float32)
  got = np.asarray(tfspmd.pmap(SCATTERS[kind])(tensor, indices, updates))
  want = np.stack([numpy_scatter(kind, t, i, u)
                   for t, i, u in zip(tensor, indices, updates)])
  if kind == "update":
    # Several updates to one element: the op's own route does not say
    # which one lands; every element holds its old value or one of them.
    for t, i, u, g in zip(tensor, indices, updates, got):
      candidates = {k: {v} for k, v in np.ndenumerate(t)}
      for index, value in zip(map(tuple, i), u):
        if index in candidates:
          candidates[index].add(value)
      assert all(g[k] in values for k, values in candidates.items())
    untouched = np.ones(tensor.shape, bool)
    for d in range(N):
      for index in map(tuple, indices[d]):
        if all(0 <= c < s for c, s in zip(index, shape)):
          untouched[(d,) + index] = False
    np.testing.assert_array_equal(got[untouched], tensor[untouched])
  else:
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("scatter", [
    lambda i, u: tf.scatter_nd(i, u, [3, 2]),
    lambda i, u: tf.tensor_scatter_nd_update(tf.zeros([3, 2], tf.bool), i, u),
])
def test_bool_scatters_take_the_op_and_drop_indices_outside(scatter):
  indices = np.array([[[0], [2]], [[3], [1]], [[-1], [0]], [[1], [9]]] * 2,
                     np.int32)
  flags = np.ones((N, 2, 2), bool)
  got = np.asarray(tfspmd.pmap(scatter)(indices, flags))
  want = np.zeros((N, 3, 2), bool)
  for d in range(N):
    for (k,) in indices[d]:
      if 0 <= k < 3:
        want[d, k] = True
  np.testing.assert_array_equal(got, want)


def test_the_same_indices_on_every_device_drop_those_outside():
  tensor = np.arange(N * 1000, dtype=np.float32).reshape(N, 1000)
  indices = np.array([[3], [1000], [-2], [999]], np.int32)
  got = np.asarray(tfspmd.pmap(
      lambda t, u: tf.tensor_scatter_nd_add(t, tf.constant(indices), u),
      in_axes=(0, None))(tensor, np.ones(4, np.float32)))
  want = tensor.copy()
  want[:, 3] += 1
  want[:, 999] += 1
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("mesh_shape", [(8,), (2, 4)])
def test_the_same_indices_in_a_shard_map_over_axes_that_do_not_divide_rows(
    mesh_shape):
  # A (1, 5) block on each device of a (2, 4) mesh: on DTensor's mesh the
  # scatter's tensor has a dimension of 4 split over 'tp', past which the
  # dropped index 7 must not add a row. JAX (x.at[0, [1, 3, 7]].set(...) in
  # jax.shard_map) gives the rows below.
  names = ("dp", "tp")[:len(mesh_shape)]
  mesh = tfspmd.make_mesh(mesh_shape, names)
  tensor = np.arange(8 * 5, dtype=np.float32).reshape(8, 5)
  spec = tfspmd.P(names)

  def update(block):
    return tf.tensor_scatter_nd_update(
        block, tf.constant([[0, 1], [0, 3], [0, 7]]),
        tf.constant([-1., -2., -3.]))

  got = tfspmd.shard_map(update, mesh=mesh, in_specs=spec,
                         out_specs=spec)(tensor)
  want = tensor.copy()
  want[:, [1, 3]] = [-1., -2.]
  np.testing.assert_array_equal(np.asarray(got), want)


def test_gather_nd_of_shared_params_at_per_device_indices():
  params = np.arange(24, dtype=np.float32).reshape(4, 3, 2)
  indices = np.random.default_rng(2).integers(
      0, 3, size=(N, 5, 2)).astype(np.int32)
  with route_log.recording() as routes:
    got = np.asarray(tfspmd.pmap(
        lambda i: tf.gather_nd(tf.constant(params), i))(indices))
  assert route_log.PER_POSITION not in routes, routes
  want = np.stack([params[i[:, 0], i[:, 1]] for i in indices])
  np.testing.assert_array_equal(got, want)


def test_scatter_in_a_per_device_loop_draws_each_devices_pixels():
  # The Lorenz colab's drawing: a loop with per-device bounds lighting one
  # pixel a pass, in a branch taken on some devices.
  lower = np.array([0, 2, 5, 1, 0, 3, 7, 4], np.int32)
  upper = np.array([3, 2, 9, 6, 1, 8, 9, 4], np.int32)

  def draw(lo, hi):
    def body(x, image):
      return x + 1, tf.tensor_scatter_nd_add(
          image, tf.stack([x, x % 3])[None], [tf.cast(x, tf.float32)])
    return tf.cond(
        lo < hi,
        lambda: tf.while_loop(lambda x, _: x < hi, body,
                              (lo, tf.zeros([10, 3])))[1],
        lambda: tf.fill([10, 3], -1.))

  got = np.asarray(tfspmd.pmap(draw)(lower, upper))
  want = np.zeros((N, 10, 3), np.float32)
  for d in range(N):
    if lower[d] >= upper[d]:
      want[d] = -1.
    for x in range(lower[d], upper[d]):
      want[d, x, x % 3] += x
  np.testing.assert_array_equal(got, want)


def test_bool_updates_and_a_scatter_of_no_updates():
  rng = np.random.default_rng(4)
  indices = rng.integers(0, 5, size=(N, 3, 1)).astype(np.int32)
  flags = rng.integers(0, 2, size=(N, 3)).astype(bool)
  got = np.asarray(tfspmd.pmap(lambda i, u: tf.scatter_nd(i, u, [5]))(
      indices, flags))
  want = np.zeros((N, 5), bool)
  for d in range(N):
    for (k,), flag in zip(indices[d], flags[d]):
      want[d, k] |= flag
  np.testing.assert_array_equal(got, want)
  tensor = np.arange(N * 4, dtype=np.float32).reshape(N, 4)
  got = np.asarray(tfspmd.pmap(tf.tensor_scatter_nd_update)(
      tensor, np.zeros((N, 0, 1), np.int32), np.zeros((N, 0), np.float32)))
  np.testing.assert_array_equal(got, tensor)


@pytest.mark.parametrize("scatter", [
    lambda v: tf.tensor_scatter_nd_update(tf.zeros((2, 4)), [[0]], v[None]),
    lambda v: tf.scatter_nd([[0]], v[None], (2, 4)),
])
def test_rows_scattered_into_new_zeros_then_summed_and_split(scatter):
  # The psum_scatter after it splits the scattered rows over the devices,
  # so DTensor lays the scatter out for that split.
  rows = np.arange(8, dtype=np.float32).reshape(2, 4)
  got = np.asarray(tfspmd.pmap(
      lambda v: tfspmd.lax.psum_scatter(scatter(v), "i", tiled=True), "i",
      devices=tfspmd.devices()[:2])(rows))
  np.testing.assert_array_equal(got[0, 0], rows.sum(axis=0))
  np.testing.assert_array_equal(got[1, 0], np.zeros(4))
