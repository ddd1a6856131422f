"""Data-parallel training through pmap equals training on one device.

Each device takes a slice of the global batch, computes its loss and
gradients with a GradientTape, and `pmean`s the gradients; the reference is
the same model trained with plain TensorFlow on the whole batch. Both start
from the same weights and must agree to 1e-5 after every step.
"""

import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from tfspmd import lax

DEVICES, PER_DEVICE, FEATURES, HIDDEN, CLASSES = 8, 4, 5, 16, 3


def init_params(seed=0):
  rng = np.random.default_rng(seed)
  return [rng.standard_normal((FEATURES, HIDDEN)).astype(np.float32) * 0.3,
          np.zeros(HIDDEN, np.float32),
          rng.standard_normal((HIDDEN, CLASSES)).astype(np.float32) * 0.3,
          np.zeros(CLASSES, np.float32)]


def mlp_loss(params, x, y):
  w1, b1, w2, b2 = params
  logits = tf.nn.tanh(x @ w1 + b1) @ w2 + b2
  return tf.reduce_mean(
      tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


def sgd_step(params, x, y, average):
  with tf.GradientTape() as tape:
    tape.watch(params)
    loss = mlp_loss(params, x, y)
  grads = average(tape.gradient(loss, params))
  return [p - 0.5 * g for p, g in zip(params, grads)], average(loss)


def batches(steps, seed=1):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((steps, DEVICES * PER_DEVICE, FEATURES)).astype(np.float32)
  y = rng.integers(0, CLASSES, (steps, DEVICES * PER_DEVICE)).astype(np.int32)
  return x, y


@tf.function
def reference_step(params, x, y):
  return sgd_step(params, x, y, lambda v: v)


def per_device(v):
  return v.reshape((DEVICES, PER_DEVICE) + v.shape[1:])


def test_mlp_step_by_step_equals_one_device_training():
  steps = 10
  xs, ys = batches(steps)
  step = tfspmd.pmap(lambda p, x, y: sgd_step(p, x, y, lambda v: lax.pmean(v, "batch")),
                     "batch", in_axes=(None, 0, 0), out_axes=None)
  params = reference = [tf.constant(p) for p in init_params()]
  for t in range(steps):
    params, loss = step(params, per_device(xs[t]), per_device(ys[t]))
    reference, reference_loss = reference_step(reference, xs[t], ys[t])
    np.testing.assert_allclose(loss, reference_loss, rtol=1e-5, atol=1e-6)
    for got, want in zip(params, reference):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert float(loss) < float(mlp_loss(init_params(), xs[0], ys[0]))


@pytest.mark.parametrize("steps_per_call", [1, 5])
def test_mlp_with_steps_per_call_equals_one_device_training(steps_per_call):
  steps = 10
  xs, ys = batches(steps, seed=2)
  train = tfspmd.pmap(
      lambda p, x, y: sgd_step(p, x, y, lambda v: lax.pmean(v, "batch")),
      "batch", in_axes=(None, 0, 0), out_axes=(None, 0), steps=steps_per_call)
  params = [tf.constant(p) for p in init_params(seed=3)]
  reference = params
  for start in range(0, steps, steps_per_call):
    chunk = slice(start, start + steps_per_call)
    # [step, global batch, ...] -> [device, step, per-device batch, ...]
    x = np.stack([per_device(v) for v in xs[chunk]], axis=1)
    y = np.stack([per_device(v) for v in ys[chunk]], axis=1)
    params, losses = train(params, x, y)
    for t in range(start, start + steps_per_call):
      reference, reference_loss = reference_step(reference, xs[t], ys[t])
      np.testing.assert_allclose(np.asarray(losses)[0, t - start],
                                 reference_loss, rtol=1e-5, atol=1e-6)
  for got, want in zip(params, reference):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
