"""Indexing with new axes inside a pmap (DTensor crashed on some, TF 2.21).

`x[None]`, `x[1:3, None]` and `x[None, ...]` of a per-device value are
computed as a slice and a reshape (tfspmd/_src/rewrites/new_axis.py), and their
gradients as the gradient of that slice; they used to end in undecodable
error bytes or a segmentation fault of the process.
"""

import numpy as np
import pytest
import tensorflow as tf

import tfspmd

INDEXINGS = {
    "x[None]": lambda x: x[None],
    "x[:, None]": lambda x: x[:, None],
    "x[None, ...]": lambda x: x[None, ...],
    "x[1:3, None]": lambda x: x[1:3, None],
    "x[None, None, 1]": lambda x: x[None, None, 1],
    "x[..., None]": lambda x: x[..., None],
    "x[::-1, None, 1:3]": lambda x: x[::-1, None, 1:3],
}


@pytest.mark.parametrize("name", sorted(INDEXINGS))
def test_new_axis_of_a_per_device_value_matches_numpy(name):
  x = np.arange(8 * 3 * 4, dtype=np.float32).reshape(8, 3, 4)
  index = INDEXINGS[name]
  out = tfspmd.pmap(lambda v: index(v) * 2.)(x)
  np.testing.assert_array_equal(out, np.stack([index(row) * 2. for row in x]))


@pytest.mark.parametrize("name", sorted(INDEXINGS))
def test_gradient_of_a_new_axis_matches_numpy(name):
  x = np.arange(8 * 3 * 4, dtype=np.float32).reshape(8, 3, 4)
  index = INDEXINGS[name]
  weights = np.random.default_rng(0).standard_normal(
      index(x[0]).shape).astype(np.float32)

  def grad(v):
    with tf.GradientTape() as tape:
      tape.watch(v)
      loss = tf.reduce_sum(index(v) ** 2 * weights) / 2
    return tape.gradient(loss, v)

  want = np.zeros_like(x)
  for row, grad_row in zip(x, want):
    index(grad_row)[...] += index(row) * weights  # basic indexing: a view
  np.testing.assert_array_equal(tfspmd.pmap(grad)(x), want)


def test_broadcast_to_of_a_new_axis():
  x = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
  out = tfspmd.pmap(lambda v: tf.broadcast_to(v[None], [2, 3]))(x)
  np.testing.assert_array_equal(out, np.broadcast_to(x[:, None], (8, 2, 3)))


def test_new_axis_in_nested_pmaps_and_vmap():
  x = np.arange(4 * 2 * 3, dtype=np.float32).reshape(4, 2, 3)
  nested = tfspmd.pmap(tfspmd.pmap(lambda v: v[None] + 1., "c"), "r")(x)
  np.testing.assert_array_equal(nested, x[:, :, None] + 1.)
  inner_vmap = tfspmd.pmap(tfspmd.vmap(lambda v: v[:, None]))(x)
  np.testing.assert_array_equal(inner_vmap, x[..., None])


def test_new_axis_of_a_replicated_value_written_in_full_is_placed():
  x = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
  w = np.arange(12, dtype=np.float32).reshape(3, 4)
  f = lambda v, u: tf.linalg.matvec(u[None, :, :][0], v, transpose_a=True)
  out = tfspmd.pmap(f, in_axes=(0, None))(x, w)
  np.testing.assert_array_equal(out, x @ w)
