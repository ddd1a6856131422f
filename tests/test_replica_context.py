"""tf.distribute's replica context inside a mapped function.

Code written for `Strategy.run` (`tf.nn.compute_average_loss`, a replica
context's `all_reduce`) sees the devices of the bound axes as its replicas.
The expected numbers are NumPy's, as MirroredStrategy over 8 replicas
computes them.
"""

import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from tfspmd import lax

N = 8


def test_compute_average_loss_divides_by_the_global_batch(each_executor):
  del each_executor  # unused
  rng = np.random.default_rng(0)
  x = rng.standard_normal((N, 4, 3)).astype(np.float32)
  y = rng.standard_normal((N, 4)).astype(np.float32)
  w = np.array([0.5, -1., 2.], np.float32)

  def step(w, x, y):
    with tf.GradientTape() as tape:
      tape.watch(w)
      per_example = tf.square(tf.linalg.matvec(x, w) - y)
      loss = tf.nn.compute_average_loss(per_example)
    grad = lax.psum(tape.gradient(loss, w), "i")
    return lax.psum(loss, "i"), grad

  loss, grad = tfspmd.pmap(step, "i", in_axes=(None, 0, 0))(w, x, y)
  flat_x, flat_y = x.reshape(-1, 3), y.reshape(-1)
  residual = flat_x @ w - flat_y
  np.testing.assert_allclose(loss, np.full(N, np.mean(residual ** 2)),
                             rtol=1e-5)
  np.testing.assert_allclose(
      grad, np.broadcast_to(2 * flat_x.T @ residual / len(flat_y), (N, 3)),
      rtol=1e-5)


def test_scale_regularization_loss_divides_by_the_replicas():
  out = tfspmd.pmap(lambda v: tf.nn.scale_regularization_loss(v))(
      np.full(N, 4., np.float32))
  np.testing.assert_allclose(out, np.full(N, 4. / N))


def _replicas(v):
  return tf.distribute.get_strategy().num_replicas_in_sync + 0 * v


def test_the_replicas_are_the_devices_of_the_bound_axes():
  ones = np.ones((2, 4), np.float32)
  np.testing.assert_array_equal(tfspmd.pmap(_replicas)(ones[:, 0]), [2, 2])
  nested = tfspmd.pmap(tfspmd.pmap(_replicas, "inner"), "outer")(ones)
  np.testing.assert_array_equal(nested, np.full((2, 4), 8))
  mesh = tfspmd.make_mesh((2, 4), ("a", "b"))
  mapped = tfspmd.shard_map(_replicas, mesh=mesh, in_specs=tfspmd.P("a", "b"),
                            out_specs=tfspmd.P("a", "b"))(ones)
  np.testing.assert_array_equal(mapped, np.full((2, 4), 8))
  # A vmap's axis is no replica.
  np.testing.assert_array_equal(tfspmd.vmap(_replicas)(ones[:, 0]), [1, 1])
  # Outside, the default strategy.
  assert tf.distribute.get_strategy().num_replicas_in_sync == 1


def test_the_replica_contexts_collectives_are_the_axes_collectives():
  x = np.arange(N * 2, dtype=np.float32).reshape(N, 2)

  def collectives(v):
    context = tf.distribute.get_replica_context()
    return (context.all_reduce(tf.distribute.ReduceOp.SUM, v),
            context.all_reduce("mean", v),
            context.all_gather(v, axis=0),
            context.replica_id_in_sync_group)

  total, mean, gathered, replica = tfspmd.pmap(collectives, "i")(x)
  np.testing.assert_allclose(total, np.broadcast_to(x.sum(0), x.shape))
  np.testing.assert_allclose(mean, np.broadcast_to(x.mean(0), x.shape))
  np.testing.assert_array_equal(gathered, np.broadcast_to(x.reshape(-1),
                                                          (N, N * 2)))
  np.testing.assert_array_equal(replica, np.arange(N))
  # Over two axes: the replica id counts row by row.
  ids = tfspmd.pmap(tfspmd.pmap(
      lambda v: tf.distribute.get_replica_context().replica_id_in_sync_group
      + 0 * tf.cast(v, tf.int32), "b"), "a")(np.zeros((2, 4), np.float32))
  np.testing.assert_array_equal(ids, np.arange(8).reshape(2, 4))


def test_a_merge_call_is_an_error_naming_what_the_context_offers():
  def merging(v):
    return tf.distribute.get_replica_context().merge_call(lambda s: v)

  with pytest.raises(NotImplementedError, match=(
      r"`ReplicaContext.merge_call` inside a function mapped by tfspmd: .* "
      r"offers `num_replicas_in_sync`, `all_reduce`")):
    tfspmd.pmap(merging)(np.ones(N, np.float32))


def test_compute_average_loss_in_a_loop_of_steps():
  # Its checks of the global batch size hold from the shapes: nothing to
  # carry out of the loop over the steps.
  def step(total, per_example):
    tf.debugging.assert_positive(tf.shape(per_example)[0])
    return total + tf.nn.compute_average_loss(per_example), total

  losses = np.arange(N * 3 * 4, dtype=np.float32).reshape(N, 3, 4)
  total, seen = tfspmd.pmap(step, steps=3)(np.zeros(N, np.float32), losses)
  per_step = losses.sum(2) / (4 * N)
  np.testing.assert_allclose(total, per_step.sum(1), rtol=1e-6)
  np.testing.assert_allclose(seen, np.cumsum(per_step, 1) - per_step,
                             rtol=1e-6, atol=1e-7)
