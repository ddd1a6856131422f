"""Batched matmuls whose batch axes broadcast, against NumPy.

TensorFlow's oneDNN kernel of a batched matmul (TF 2.21, CPU) corrupts
memory for a left operand [B, 1, M, K] by a broadcast right operand, and
DTensor's per-device shapes of a matmul by weights gathered over one axis
of a (4, 2) mesh are such: with 5 or more rows per device the process
aborted or gave wrong values. tfspmd writes those matmuls as einsums.
"""

import os
import sys

import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from tfspmd import P
from tfspmd import lax

from child_process import run_python
from numpy_reference import data


def gathered_weights_product(rows):
  """x @ all_gather(w, 'batch') on a (4, 2) mesh, checked against NumPy.

  Each device multiplies its [rows / 4, 8] block of x by the [8, 16] block
  of w its 'feats' position selects; DTensor splits that contraction over
  the 'batch' devices.
  """
  mesh = tfspmd.Mesh(np.array(tfspmd.devices()).reshape(4, 2),
                     ("batch", "feats"))
  w, x = data(16, 16), data(rows, 16, seed=1)
  product = tfspmd.shard_map(
      lambda w, x: x @ lax.all_gather(w, "batch", tiled=True), mesh=mesh,
      in_specs=(P(("feats", "batch")), P("batch", "feats")),
      out_specs=P("batch", "feats"))
  want = np.concatenate([x[:, :8] @ w[:8], x[:, 8:] @ w[8:]], axis=1)
  for _ in range(3):
    np.testing.assert_allclose(product(w, x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [16, 32, 40])
def test_matmul_by_weights_gathered_over_one_axis_of_a_4_by_2_mesh(rows):
  # In a process of its own: the corruption this checks for aborts.
  run_python(
      f"import test_broadcast_matmul as t; t.gathered_weights_product({rows})",
      timeout=300, cwd=os.path.dirname(os.path.abspath(__file__)),
      PYTHONPATH=os.pathsep.join(sys.path))


@pytest.mark.parametrize("left, right", [
    ((3, 5, 2), (2, 4)),
    ((3, 5, 2), (1, 2, 4)),
    ((1, 5, 2), (3, 2, 4)),
    ((2, 1, 5, 2), (3, 2, 4)),
])
def test_batched_matmul_by_weights_the_same_on_every_device(left, right):
  x, w = data(4, *left), data(*right, seed=1)
  got = tfspmd.pmap(lambda x: tf.matmul(x, w), "i")(x)
  np.testing.assert_allclose(got, np.matmul(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("adjoint_a, adjoint_b", [
    (False, True), (True, False), (True, True)])
def test_batched_adjoint_matmul_of_complex_values(adjoint_a, adjoint_b):
  def complex_data(*shape, seed):
    return (data(*shape, seed=seed) + 1j * data(*shape, seed=seed + 1)
            ).astype(np.complex64)

  x = complex_data(4, 3, *((2, 5) if adjoint_a else (5, 2)), seed=0)
  w = complex_data(*((4, 2) if adjoint_b else (2, 4)), seed=2)
  got = tfspmd.pmap(lambda x: tf.matmul(
      x, w, adjoint_a=adjoint_a, adjoint_b=adjoint_b), "i")(x)
  left = np.conj(np.swapaxes(x, -1, -2)) if adjoint_a else x
  right = np.conj(w.T) if adjoint_b else w
  np.testing.assert_allclose(got, left @ right, rtol=1e-5, atol=1e-5)


def test_batched_matmul_of_integers_by_shared_weights():
  x = np.arange(4 * 3 * 5 * 2, dtype=np.int32).reshape(4, 3, 5, 2)
  w = np.arange(8, dtype=np.int32).reshape(2, 4)
  got = tfspmd.pmap(lambda x: tf.matmul(x, w), "i")(x)
  np.testing.assert_array_equal(got, x @ w)


def test_matmul_by_weights_mapped_over_the_inner_axis_only():
  x, w = data(4, 2, 6, 3), data(2, 3, 5, seed=1)
  inner = tfspmd.pmap(tf.matmul, "j")
  got = tfspmd.pmap(lambda x: inner(x, w), "i")(x)
  np.testing.assert_allclose(got, x @ w, rtol=1e-5, atol=1e-5)


def test_gradient_of_a_batched_matmul_by_shared_weights():
  x, w = data(4, 3, 5, 2), data(2, 4, seed=1)

  def grad(x):
    weights = tf.constant(w)
    with tf.GradientTape() as tape:
      tape.watch(weights)
      loss = tf.reduce_sum(tf.matmul(x, weights) ** 2)
    return tape.gradient(loss, weights)

  got = tfspmd.pmap(grad, "i")(x)
  want = np.einsum("dbmk,dbmn->dkn", x, 2 * (x @ w))
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
