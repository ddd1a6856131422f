"""Ops pfor or DTensor cannot map alone, and offsets that differ between devices.

Each case runs on 8 logical CPU devices against NumPy written here: the
per-position route (an op pfor has no converter for), DTensor's replicated
route (an op it has no expander for), slices at per-device offsets with
lax.dynamic_slice's clamping, and the gradients that meet them.
"""

import logging

import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from numpy_reference import finite_difference
from tfspmd import lax

N = 8
RNG = np.random.default_rng(7)


def _pmap(fun, **kwargs):
  return tfspmd.pmap(fun, axis_name="i", **kwargs)


def test_slice_at_axis_index_offset_is_numpys_slice():
  x = RNG.standard_normal((N, 5, 6)).astype(np.float32)
  out = _pmap(lambda v: tf.slice(
      v, tf.stack([lax.axis_index("i") % 4, 1]), [2, 3]))(x)
  expected = np.stack([x[k, k % 4:k % 4 + 2, 1:4] for k in range(N)])
  np.testing.assert_array_equal(np.asarray(out), expected)


def test_slice_past_the_end_is_clamped_as_dynamic_slice():
  x = np.arange(N * 6, dtype=np.float32).reshape(N, 6)
  out = _pmap(lambda v: tf.slice(
      v, tf.reshape(lax.axis_index("i"), [1]), [3]))(x)
  # lax.dynamic_slice: a start past size - 3 becomes size - 3.
  expected = np.stack([x[k, min(k, 3):min(k, 3) + 3] for k in range(N)])
  np.testing.assert_array_equal(np.asarray(out), expected)


def test_slices_of_a_per_device_value_at_the_offsets_of_a_vmap():
  x = RNG.standard_normal((N, 6, 2)).astype(np.float32)

  def f(v):
    starts = tf.range(3) + lax.axis_index("i") % 2
    rows = tfspmd.vmap(lambda s: v[s])(starts)
    blocks = tfspmd.vmap(
        lambda s: tf.slice(v, tf.stack([s, 0]), [2, 2]))(starts)
    return rows, blocks

  rows, blocks = _pmap(f)(x)
  starts = [np.arange(3) + k % 2 for k in range(N)]
  np.testing.assert_array_equal(
      np.asarray(rows), np.stack([x[k, starts[k]] for k in range(N)]))
  np.testing.assert_array_equal(
      np.asarray(blocks),
      np.stack([[x[k, s:s + 2] for s in starts[k]] for k in range(N)]))


def test_index_of_a_rotated_block_is_numpys_block():
  blocks = RNG.standard_normal((N, 3, 2)).astype(np.float32)
  out = _pmap(lambda b: b[(lax.axis_index("i") + 1) % 3])(blocks)
  expected = np.stack([blocks[k, (k + 1) % 3] for k in range(N)])
  np.testing.assert_array_equal(np.asarray(out), expected)


def test_negative_index_and_range_at_per_device_offset():
  x = RNG.standard_normal((N, 4, 6)).astype(np.float32)
  out = _pmap(lambda v: v[-1 - lax.axis_index("i") % 4, 1:4])(x)
  expected = np.stack([x[k, -1 - k % 4, 1:4] for k in range(N)])
  np.testing.assert_array_equal(np.asarray(out), expected)


def test_the_ring_neighbours_row_of_an_all_gather():
  # all_gather(x)[(axis_index + 1) % n], the ring-neighbour idiom: the
  # gathered value is the same on every device, indexed at per-device rows.
  x = RNG.standard_normal((N, 3, 2)).astype(np.float32)

  def neighbours(v):
    gathered = lax.all_gather(v, "i")
    me = lax.axis_index("i")
    return (gathered[(me + 1) % N], gathered[me, 1:],
            tf.slice(gathered, tf.stack([(me + N - 1) % N, 0, 1]),
                     [2, 3, 1]))

  right, own_tail, left_pair = _pmap(neighbours)(x)
  np.testing.assert_array_equal(np.asarray(right), np.roll(x, -1, axis=0))
  np.testing.assert_array_equal(np.asarray(own_tail), x[:, 1:])
  # Device k's slice starts at row k - 1 (mod 8), two rows, clamped as
  # lax.dynamic_slice clamps: device 0's start 7 leaves no second row, so
  # it starts at 6.
  expected = np.stack([x[[min((k - 1) % N, N - 2), min((k - 1) % N, N - 2) + 1],
                         :, 1:] for k in range(N)])
  np.testing.assert_array_equal(np.asarray(left_pair), expected)


def test_fixed_and_own_rows_of_an_all_gather():
  # all_gather(x)[2] takes device 2's block on every device, and
  # all_gather(x)[axis_index] each device's own, as under jax.pmap.
  x = RNG.standard_normal((N, 3, 2)).astype(np.float32)

  def rows(v):
    gathered = lax.all_gather(v, "i")
    return (gathered[2], gathered[lax.axis_index("i")],
            gathered[-1, 1:] + tf.reduce_sum(gathered, 0)[1:])

  third, own, mixed = _pmap(rows)(x)
  np.testing.assert_array_equal(np.asarray(third), np.stack([x[2]] * N))
  np.testing.assert_array_equal(np.asarray(own), x)
  np.testing.assert_allclose(np.asarray(mixed),
                             np.stack([x[-1, 1:] + x.sum(0)[1:]] * N),
                             rtol=1e-6)


def test_column_at_per_device_index():
  x = RNG.standard_normal((N, 4, 6)).astype(np.float32)
  out = _pmap(lambda v: v[:, (lax.axis_index("i") * 5) % 6])(x)
  expected = np.stack([x[k, :, (k * 5) % 6] for k in range(N)])
  np.testing.assert_array_equal(np.asarray(out), expected)


def test_tensor_scatter_nd_update_at_per_device_offset():
  x = RNG.standard_normal((N, 6)).astype(np.float32)
  out = _pmap(lambda v: tf.tensor_scatter_nd_update(
      v, tf.reshape(lax.axis_index("i") % 6, [1, 1]), [-7.]))(x)
  expected = x.copy()
  for k in range(N):
    expected[k, k % 6] = -7.
  np.testing.assert_array_equal(np.asarray(out), expected)


def test_roll_by_per_device_shift_and_its_gradient():
  x = RNG.standard_normal((N, 6)).astype(np.float32)
  shifts = np.arange(N, dtype=np.int32) - 3
  weights = np.cos(np.arange(6)).astype(np.float32)

  def loss_and_gradient(v, shift):
    with tf.GradientTape() as tape:
      tape.watch(v)
      loss = tf.reduce_sum(tf.roll(v, shift, 0) * weights)
    return loss, tape.gradient(loss, v)

  loss, gradient = _pmap(loss_and_gradient)(x, shifts)
  np.testing.assert_allclose(np.asarray(loss), [
      np.sum(np.roll(x[k], shifts[k]) * weights) for k in range(N)],
                             rtol=1e-5)
  # d/dv sum(roll(v, s) * w) = roll(w, -s).
  np.testing.assert_allclose(np.asarray(gradient), np.stack([
      np.roll(weights, -shifts[k]) for k in range(N)]), rtol=1e-6)


def test_bincount_with_fixed_length_is_numpys_bincount():
  ids = RNG.integers(0, 5, (N, 12)).astype(np.int32)
  out = _pmap(lambda i: tf.math.bincount(i, minlength=5, maxlength=5))(ids)
  expected = np.stack([np.bincount(ids[k], minlength=5) for k in range(N)])
  np.testing.assert_array_equal(np.asarray(out), expected)


def test_bincount_by_expert_then_psum_counts_tokens_per_expert():
  ids = RNG.integers(0, 4, (N, 10)).astype(np.int32)
  out = _pmap(lambda i: lax.psum(
      tf.math.bincount(i, minlength=4, maxlength=4), "i"))(ids)
  expected = np.bincount(ids.reshape(-1), minlength=4)
  np.testing.assert_array_equal(np.asarray(out)[0], expected)


def test_determinant_pfor_cannot_map_is_numpys():
  m = (RNG.standard_normal((N, 3, 3)) + 2 * np.eye(3)).astype(np.float32)
  out = _pmap(tf.linalg.det)(m)
  np.testing.assert_allclose(np.asarray(out), np.linalg.det(m), rtol=1e-4)


def test_cumprod_dtensor_cannot_expand_is_numpys():
  x = RNG.uniform(0.5, 1.5, (N, 7)).astype(np.float32)
  out = _pmap(lambda v: tf.math.cumprod(v) * tf.cast(
      lax.axis_index("i"), tf.float32))(x)
  expected = np.cumprod(x, axis=1) * np.arange(N)[:, None]
  np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5)


def test_inverse_and_solve_are_numpys():
  m = (RNG.standard_normal((N, 4, 4)) + 4 * np.eye(4)).astype(np.float32)
  b = RNG.standard_normal((N, 4, 1)).astype(np.float32)
  inverse, solution = _pmap(lambda a, y: (tf.linalg.inv(a),
                                          tf.linalg.solve(a, y)))(m, b)
  np.testing.assert_allclose(np.asarray(inverse), np.linalg.inv(m),
                             atol=1e-5)
  np.testing.assert_allclose(np.asarray(solution), np.linalg.solve(m, b),
                             atol=1e-5)


def test_searchsorted_then_pmax():
  data = np.sort(RNG.standard_normal((N, 9)), axis=1).astype(np.float32)
  queries = RNG.standard_normal((N, 4)).astype(np.float32)
  out = _pmap(lambda d, q: lax.pmax(tf.searchsorted(d, q), "i"))(
      data, queries)
  expected = np.max(np.stack([np.searchsorted(data[k], queries[k])
                              for k in range(N)]), axis=0)
  np.testing.assert_array_equal(np.asarray(out)[0], expected)


def test_gradient_of_determinant_is_finite_difference():
  m = (RNG.standard_normal((N, 3, 3)) + 2 * np.eye(3)).astype(np.float32)

  def gradient(a):
    with tf.GradientTape() as tape:
      tape.watch(a)
      value = tf.linalg.det(a)
    return tape.gradient(value, a)

  out = np.asarray(_pmap(gradient)(m))
  for k in range(N):
    expected = finite_difference(lambda a: np.linalg.det(a.astype(np.float64)),
                                 m[k].astype(np.float64), eps=1e-4)
    np.testing.assert_allclose(out[k], expected, rtol=1e-3, atol=1e-3)


def test_gradient_of_conv1d_with_per_device_filter():
  x = RNG.standard_normal((N, 2, 10, 3)).astype(np.float32)
  kernels = RNG.standard_normal((N, 3, 3, 4)).astype(np.float32)

  def gradient(v, kernel):
    with tf.GradientTape() as tape:
      tape.watch(kernel)
      loss = tf.reduce_sum(tf.nn.conv1d(v, kernel, 1, "VALID") ** 2)
    return tape.gradient(loss, kernel)

  out = np.asarray(_pmap(gradient)(x, kernels))

  def loss(v, kernel):
    windows = np.stack([v[:, t:t + 3] for t in range(8)], axis=1)
    return np.sum(np.einsum("btkc,kco->bto", windows, kernel) ** 2)

  for k in (0, 5):
    expected = finite_difference(
        lambda w, k=k: loss(x[k].astype(np.float64), w),
        kernels[k].astype(np.float64), eps=1e-3)
    np.testing.assert_allclose(out[k], expected, rtol=1e-3, atol=1e-3)


def test_custom_gradient_with_a_collective_inside():
  x = RNG.standard_normal((N, 3)).astype(np.float32)

  @tf.custom_gradient
  def centered(v):
    mean = lax.pmean(v, "i")

    def backward(upstream):
      # The transpose of v - pmean(v): g - pmean(g).
      return upstream - lax.pmean(upstream, "i")
    return v - mean, backward

  def gradient(v):
    with tf.GradientTape() as tape:
      tape.watch(v)
      loss = tf.reduce_sum(centered(v) * tf.cast(lax.axis_index("i"),
                                                 tf.float32))
    return tape.gradient(loss, v)

  out = np.asarray(_pmap(gradient)(x))
  index = np.arange(N, dtype=np.float32)[:, None] * np.ones((1, 3))
  np.testing.assert_allclose(out, index - index.mean(axis=0), rtol=1e-6)


def test_batched_matmul_broadcast_gradient():
  x = RNG.standard_normal((N, 2, 3, 4)).astype(np.float32)
  w = RNG.standard_normal((4, 5)).astype(np.float32)

  def gradient(v, weights):
    with tf.GradientTape() as tape:
      tape.watch(weights)
      loss = tf.reduce_sum(tf.matmul(v, weights))
    return lax.psum(tape.gradient(loss, weights), "i")

  out = np.asarray(_pmap(gradient, in_axes=(0, None))(x, w))
  # d/dw sum(x @ w) = sum over rows of x, for every column.
  expected = np.repeat(x.sum(axis=(0, 1, 2))[:, None], 5, axis=1)
  np.testing.assert_allclose(out[0], expected, rtol=1e-4)


def test_sort_and_top_k_gradients():
  x = RNG.standard_normal((N, 6)).astype(np.float32)
  weights = np.arange(1, 7, dtype=np.float32)

  def gradients(v):
    with tf.GradientTape(persistent=True) as tape:
      tape.watch(v)
      by_sort = tf.reduce_sum(tf.sort(v) * weights)
      by_top_k = tf.reduce_sum(tf.math.top_k(v, 3).values * weights[:3])
    return tape.gradient(by_sort, v), tape.gradient(by_top_k, v)

  sort_gradient, top_k_gradient = _pmap(gradients)(x)
  order = np.argsort(x, axis=1)
  expected_sort = np.zeros_like(x)
  expected_top_k = np.zeros_like(x)
  for k in range(N):
    expected_sort[k, order[k]] = weights
    expected_top_k[k, order[k][::-1][:3]] = weights[:3]
  np.testing.assert_array_equal(np.asarray(sort_gradient), expected_sort)
  np.testing.assert_array_equal(np.asarray(top_k_gradient), expected_top_k)


def test_output_size_that_depends_on_per_device_data_is_a_clear_error():
  with pytest.raises(ValueError, match=r"the op Unique \(Unique\) gets inputs "
                     r"that differ between devices.*static shapes"):
    _pmap(lambda v: tf.unique(v).y)(np.zeros((N, 4), np.int32))


def test_a_route_of_last_resort_prints_no_tensorflow_internals(caplog):
  with caplog.at_level(logging.ERROR, logger="tensorflow"):
    with pytest.raises(ValueError):
      _pmap(lambda v: tf.unique(v).y)(np.ones((N, 4), np.int32))
  assert not [r for r in caplog.records if "pfor" in r.getMessage()]
