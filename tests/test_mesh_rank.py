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
