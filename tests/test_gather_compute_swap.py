"""Gather, compute, swap back: retrieval over a database split across devices.

The pattern of a retrieval layer: every device gathers all queries, scores
them against its own shard of the database, keeps its local top-k, and an
all_to_all (or pswapaxes) sends each query's candidates back to the device
that owns the query, which merges them. The reference is NumPy's top-k over
the whole database.
"""

import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from tfspmd import lax

N, QUERIES, ROWS, DIM, K = 8, 3, 5, 16, 4


def retrieval_inputs(seed=0):
  rng = np.random.default_rng(seed)
  queries = rng.standard_normal((N, QUERIES, DIM)).astype(np.float32)
  database = rng.standard_normal((N, ROWS, DIM)).astype(np.float32)
  return queries, database


def numpy_top_k(queries, database):
  scores = queries.reshape(-1, DIM) @ database.reshape(-1, DIM).T
  order = np.argsort(-scores, axis=1, kind="stable")[:, :K]
  values = np.take_along_axis(scores, order, axis=1)
  return values.reshape(N, QUERIES, K), order.reshape(N, QUERIES, K)


def retrieve(swap):
  def per_device(queries, database):
    every_query = lax.all_gather(queries, "i")               # [N, Q, D]
    scores = tf.einsum("nqd,rd->nqr", every_query, database)  # [N, Q, R]
    values, rows = tf.math.top_k(scores, K)                   # [N, Q, K]
    ids = rows + lax.axis_index("i") * ROWS
    values, ids = swap(values), swap(ids)                     # [N shards, Q, K]
    merged_values = tf.reshape(tf.transpose(values, [1, 0, 2]), [QUERIES, -1])
    merged_ids = tf.reshape(tf.transpose(ids, [1, 0, 2]), [QUERIES, -1])
    best, where = tf.math.top_k(merged_values, K)
    return best, tf.gather(merged_ids, where, batch_dims=1)
  return tfspmd.pmap(per_device, "i")


SWAPS = {
    "all_to_all": lambda v: lax.all_to_all(v, "i", 0, 0),
    "pswapaxes": lambda v: lax.pswapaxes(v, "i", 0),
}


@pytest.mark.parametrize("swap", sorted(SWAPS))
def test_top_k_retrieval_over_a_split_database(swap):
  queries, database = retrieval_inputs()
  values, ids = retrieve(SWAPS[swap])(queries, database)
  expected_values, expected_ids = numpy_top_k(queries, database)
  np.testing.assert_allclose(values, expected_values, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(ids, expected_ids)


def test_pswapaxes_of_a_sum_with_an_all_gather():
  x = np.random.default_rng(1).standard_normal((N, N, 3)).astype(np.float32)
  t = np.random.default_rng(2).standard_normal((N, 3)).astype(np.float32)
  out = np.asarray(tfspmd.pmap(
      lambda v, w: lax.pswapaxes(v + lax.all_gather(w, "i"), "i", 0), "i")(x, t))
  summed = x + t[None]                       # device i holds summed[i]
  np.testing.assert_allclose(out, np.swapaxes(summed, 0, 1), rtol=1e-6)


def test_argsort_after_gather_matmul_swap():
  queries, database = retrieval_inputs(3)

  def ranks(q, d):
    scores = tf.einsum("nqd,rd->nqr", lax.all_gather(q, "i"), d)
    return tf.argsort(lax.pswapaxes(scores, "i", 0), axis=-1)

  out = np.asarray(tfspmd.pmap(ranks, "i")(queries, database))
  # Device i: scores of its own queries against every shard j.
  scores = np.einsum("iqd,jrd->ijqr", queries, database)
  np.testing.assert_array_equal(out, np.argsort(scores, axis=-1, kind="stable"))


def test_gradient_through_gather_compute_swap():
  queries, database = retrieval_inputs(4)

  def grad(q, d):
    with tf.GradientTape() as tape:
      tape.watch(q)
      scores = tf.einsum("nqd,rd->nqr", lax.all_gather(q, "i"), d)
      loss = tf.reduce_sum(lax.pswapaxes(scores, "i", 0) ** 2)
    return tape.gradient(loss, q)

  out = np.asarray(tfspmd.pmap(grad, "i")(queries, database))
  # sum over devices of every loss = sum_{i,j,q,r} (q_i . d_j)^2; its
  # gradient w.r.t. device i's queries: 2 sum_{j,r} (q_i . d_jr) d_jr.
  everything = database.reshape(-1, DIM)
  expected = 2 * np.einsum("iqr,rd->iqd",
                           np.einsum("iqd,rd->iqr", queries, everything),
                           everything)
  np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
