"""Mesh axes cost the per-device program no rank it can see.

Each mesh axis (size 1 included) adds a dimension to every tensor of the
vectorized program, and TensorFlow's CPU kernels of slices and broadcasts
stop at rank 8. The same programs of rank-6 to rank-8 blocks run on meshes
of one to five axes; expectations are NumPy arithmetic written here.
"""

import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from tfspmd import P
from tfspmd import lax

MESHES = [(8,), (2, 4), (1, 2, 1, 4), (2, 2, 2), (1, 1, 2, 2, 2)]
NAMES = ("dp", "fsdp", "tp", "sp", "ep")


def mesh_of(shape):
  names = NAMES[:len(shape)]
  return tfspmd.Mesh(np.array(tfspmd.devices()).reshape(shape), names), names


@pytest.mark.parametrize("shape", MESHES, ids=str)
def test_a_rank_6_program_runs_on_every_mesh(shape):
  mesh, names = mesh_of(shape)
  block = [2, 1, 2, 1, 2, 3]
  x = (np.arange(8 * np.prod(block), dtype=np.float32).reshape(
      [16] + block[1:]) / 100.)

  def program(b):
    y = tf.expand_dims(b, 0)[0]                    # rank 7, then back to 6
    y = tf.where(y > 0.5, y, -y)
    y = y[:, :, 1:, :, :, :2]
    return b * 2. + lax.psum(tf.reduce_sum(y), names)

  out = tfspmd.shard_map(program, mesh=mesh, in_specs=P(names),
                         out_specs=P(names))(x)
  picked = np.where(x > 0.5, x, -x).reshape([8] + block)[:, :, :, 1:, :, :,
                                                          :2]
  np.testing.assert_allclose(np.asarray(out), x * 2. + picked.sum(),
                             rtol=1e-5)


@pytest.mark.parametrize("shape", [(1, 2, 1, 4), (2, 2, 2)], ids=str)
def test_a_rank_8_block_sliced_and_selected(shape):
  # A rank-7 block, tf.expand_dims to rank 8, a strided slice, tf.where
  # against a broadcast operand, and a psum.
  mesh, names = mesh_of(shape)
  block = [2, 1, 3, 1, 2, 1, 2]
  x = np.random.default_rng(0).standard_normal([16] + block[1:]).astype(
      np.float32)

  def program(b):
    e = tf.expand_dims(b, 3)                       # [2,1,3,1,1,2,1,2]
    s = e[:, :, 1:, :, :, :, :, :1]                # [2,1,2,1,1,2,1,1]
    picked = tf.where(s > 0., s, tf.zeros([1, 1, 2, 1, 1, 1, 1, 1]) - 1.)
    return lax.psum(picked, names[-1])

  out = np.asarray(tfspmd.shard_map(program, mesh=mesh, in_specs=P(names),
                                    out_specs=P(names))(x))
  blocks = x.reshape([8] + block)[:, :, :, :, None]
  picked = blocks[:, :, :, 1:, :, :, :, :, :1]
  picked = np.where(picked > 0, picked, -1.)
  by_mesh = picked.reshape(shape + picked.shape[1:])
  summed = by_mesh.sum(axis=len(shape) - 1, keepdims=True)
  expected = np.broadcast_to(summed, by_mesh.shape).reshape(
      (16,) + picked.shape[2:])
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


def test_a_loop_with_ppermute_and_a_psum_over_two_axes_at_rank_6():
  mesh, names = mesh_of((2, 2, 2))
  block = [1, 2, 1, 2, 1, 3]
  x = np.random.default_rng(1).standard_normal([8] + block[1:]).astype(
      np.float32)
  ring = [(k, (k + 1) % 2) for k in range(2)]

  def program(b):
    def step(k, total, passing):
      passing = lax.ppermute(passing, "tp", ring)
      return k + 1, total + passing, passing
    total = tf.while_loop(lambda k, *_: k < 2, step, (0, b, b))[1]
    return lax.psum(total, ("fsdp", "tp"))

  out = np.asarray(tfspmd.shard_map(program, mesh=mesh, in_specs=P(names),
                                    out_specs=P(names))(x))
  by_mesh = x.reshape((2, 2, 2) + tuple(block))
  # Two ring steps over an axis of 2 bring each block back: b + other + b.
  totals = by_mesh + by_mesh.sum(axis=2, keepdims=True)
  summed = totals.sum(axis=(1, 2), keepdims=True)
  expected = np.broadcast_to(summed, by_mesh.shape).reshape(x.shape)
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_a_slice_no_merge_can_lower_is_refused_before_it_runs():
  mesh, names = mesh_of((1, 1, 2, 2, 2))
  x = np.zeros([8, 3, 2, 3, 2, 3, 2, 3], np.float32)

  def program(b):
    return b[1:, :, 1:, :, 1:, :, 1:]

  with pytest.raises(ValueError, match="rank .* mapped axes"):
    tfspmd.shard_map(program, mesh=mesh, in_specs=P(names),
                     out_specs=P(names))(x)


COLLECTIVE_BLOCK = (2, 1, 2, 1, 2, 4)


def _by_group(x, shape):
  """Device blocks `[groups, n, *block]`: a group differs in the last axis."""
  return x.reshape((-1, shape[-1]) + COLLECTIVE_BLOCK)


def _from_groups(values, x):
  return values.reshape(x.shape)


def _all_gather_sum(x, shape):
  groups = _by_group(x, shape)
  return _from_groups(np.broadcast_to(groups.sum(1, keepdims=True),
                                      groups.shape), x)


def _all_gather_first(x, shape):
  groups = _by_group(x, shape)
  return _from_groups(np.broadcast_to(groups[:, :1], groups.shape), x)


def _psum_scatter_tiled_back(x, shape):
  groups = _by_group(x, shape)
  n = shape[-1]
  total = groups.sum(1)
  chunks = np.split(total, n, axis=-1)
  out = np.stack([np.tile(chunks[k], (1,) * 5 + (n,)) for k in range(n)], 1)
  return _from_groups(out, x)


def _all_to_all_last_dim(x, shape):
  groups = _by_group(x, shape)
  n = shape[-1]
  out = np.stack([np.concatenate(
      [np.split(groups[:, j], n, axis=-1)[k] for j in range(n)], axis=-1)
                  for k in range(n)], 1)
  return _from_groups(out, x)


def _gradient_of_psum_of_squares(x, shape):
  mask = np.zeros(COLLECTIVE_BLOCK, np.float32)
  mask[:, :, 1:] = 1.
  blocks = x.reshape((-1,) + COLLECTIVE_BLOCK)
  return (16. * blocks * mask).reshape(x.shape)


def _psum_of_squares_gradient_program(names):
  def program(b):
    with tf.GradientTape() as tape:
      tape.watch(b)
      y = tf.reduce_sum(lax.psum(b * b, names)[:, :, 1:])
    return tape.gradient(y, b)
  return program


COLLECTIVES = {
    "all_gather": (lambda names: lambda b: tf.reduce_sum(
        lax.all_gather(b, names[-1]), 0), _all_gather_sum),
    "all_gather_tiled": (lambda names: lambda b: lax.all_gather(
        b, names[-1], axis=0, tiled=True)[:2], _all_gather_first),
    "psum_scatter": (lambda names: lambda b: tf.tile(lax.psum_scatter(
        b, names[-1], scatter_dimension=5, tiled=True),
                                                    [1] * 5 + [2]),
                     _psum_scatter_tiled_back),
    "all_to_all": (lambda names: lambda b: lax.all_to_all(
        b, names[-1], 5, 5, tiled=True), _all_to_all_last_dim),
    "gradient_of_psum": (_psum_of_squares_gradient_program,
                         _gradient_of_psum_of_squares),
}


@pytest.mark.parametrize("shape", [(2, 2, 2), (1, 1, 2, 2, 2)], ids=str)
@pytest.mark.parametrize("collective", sorted(COLLECTIVES))
def test_every_collective_of_rank_6_blocks_on_meshes_of_3_and_5_axes(
    shape, collective):
  mesh, names = mesh_of(shape)
  x = np.random.default_rng(2).standard_normal(
      (8 * COLLECTIVE_BLOCK[0],) + COLLECTIVE_BLOCK[1:]).astype(np.float32)
  program, reference = COLLECTIVES[collective]
  out = tfspmd.shard_map(program(names), mesh=mesh, in_specs=P(names),
                         out_specs=P(names))(x)
  np.testing.assert_allclose(np.asarray(out), reference(x, shape),
                             rtol=1e-5, atol=1e-5)


def test_the_gradient_of_a_concat_of_slices_on_a_four_axis_mesh():
  # Rotary embeddings concatenate slices of the last dimension; their
  # gradient slices at offsets TensorFlow computes (ConcatOffset) and puts
  # the slices' gradients back (StridedSliceGrad), at rank 9 here.
  mesh, names = mesh_of((1, 2, 1, 4))
  x = np.arange(128, dtype=np.float32).reshape(16, 2, 1, 1, 4) / 100

  def program(b):
    with tf.GradientTape() as tape:
      tape.watch(b)
      c = tf.concat([b[..., 2:], b[..., :2]], axis=-1)
      y = tf.reduce_sum(c * tf.range(4, dtype=tf.float32))
    return tape.gradient(y, b)

  out = tfspmd.shard_map(program, mesh=mesh, in_specs=P(names),
                         out_specs=P(names))(x)
  # c[k] = b[(k + 2) % 4], weighted by k: b[j] gets weight (j - 2) % 4.
  weights = np.array([(j - 2) % 4 for j in range(4)], np.float32)
  np.testing.assert_array_equal(np.asarray(out),
                                np.broadcast_to(weights, x.shape))


# Each activation with the derivative NumPy writes for it, of its input x.
ACTIVATIONS = {
    "tanh": (tf.tanh, lambda x: 1 - np.tanh(x) ** 2),
    "sigmoid": (tf.sigmoid, lambda x: np.exp(-x) / (1 + np.exp(-x)) ** 2),
    "relu": (tf.nn.relu, lambda x: (x > 0).astype(x.dtype)),
    "softplus": (tf.nn.softplus, lambda x: 1 / (1 + np.exp(-x))),
    "sqrt": (tf.sqrt, lambda x: 0.5 / np.sqrt(x)),
    "rsqrt": (tf.math.rsqrt, lambda x: -0.5 * x ** -1.5),
}


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_the_gradient_of_an_activation_of_rank_8_blocks_on_three_axes(
    activation):
  # The gradient's other operand (the weights) is the same on every device,
  # and pfor would tile it to the blocks' shape at rank 11.
  function, derivative = ACTIVATIONS[activation]
  mesh, names = mesh_of((2, 2, 2))
  block = (1, 2, 1, 3, 1, 2, 1, 2)
  x = np.random.default_rng(0).uniform(0.5, 2.0, size=(8,) + block[1:])
  x = x.astype(np.float32)
  weights = np.cos(np.arange(np.prod(block))).reshape(block).astype(
      np.float32)

  def gradient(v):
    with tf.GradientTape() as tape:
      tape.watch(v)
      loss = tf.reduce_sum(function(v) * weights)
    return tape.gradient(loss, v)

  out = tfspmd.shard_map(gradient, mesh=mesh, in_specs=P(names),
                         out_specs=P(names))(x)
  np.testing.assert_allclose(
      np.asarray(out), derivative(x.astype(np.float64)) * weights[0],
      rtol=1e-5, atol=1e-6)
