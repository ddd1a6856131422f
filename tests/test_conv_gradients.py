"""Gradients of convolutions inside pmap (tfspmd's Conv2DBackpropFilter converter).

The reference is TensorFlow's own gradient computed one device slice at a
time, outside tfspmd.
"""

import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from tfspmd import lax

from numpy_reference import data


def conv_loss(kernel, x, strides, padding, dilations):
  y = tf.nn.conv2d(x, kernel, strides, padding, dilations=dilations)
  return tf.reduce_sum(tf.sin(y))


@pytest.mark.parametrize("strides, padding, dilations", [
    (1, "SAME", 1), (2, "SAME", 1), (1, "VALID", 1), (2, "VALID", 1),
    ((1, 2), [[0, 0], [1, 2], [0, 1], [0, 0]], 1)])
def test_filter_and_input_gradients_per_device(strides, padding, dilations):
  kernel, x = data(3, 3, 2, 4), data(4, 2, 7, 6, 2, seed=1)

  def grads(k, v):
    with tf.GradientTape() as tape:
      tape.watch([k, v])
      loss = conv_loss(k, v, strides, padding, dilations)
    return tape.gradient(loss, [k, v])

  got_kernel, got_x = tfspmd.pmap(grads, "i", in_axes=(None, 0))(kernel, x)
  for device in range(4):
    want_kernel, want_x = grads(tf.constant(kernel), tf.constant(x[device]))
    np.testing.assert_allclose(got_kernel[device], want_kernel, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got_x[device], want_x, rtol=1e-4, atol=1e-4)


def test_kernels_that_differ_between_devices_convolve_each_device_own():
  # pfor has no Conv2D converter for a filter that varies along the axis:
  # each device's convolution is computed on its own kernel.
  kernels, x = data(4, 3, 3, 1, 2), data(2, 5, 5, 1, seed=2)
  got = tfspmd.pmap(lambda k, v: tf.nn.conv2d(v, k, 1, "SAME"), "i",
                    in_axes=(0, None))(kernels, x)
  padded = np.pad(x, [(0, 0), (1, 1), (1, 1), (0, 0)])
  for device in range(4):
    expected = np.zeros((2, 5, 5, 2), np.float32)
    for row in range(5):
      for column in range(5):
        window = padded[:, row:row + 3, column:column + 3, :]
        expected[:, row, column] = np.einsum("bhwc,hwco->bo", window,
                                             kernels[device])
    np.testing.assert_allclose(np.asarray(got)[device], expected, rtol=1e-4,
                               atol=1e-5)


def test_data_parallel_conv_step_matches_the_global_batch_gradient():
  kernel, x = data(3, 3, 1, 2), data(4, 2, 5, 5, 1, seed=3)

  def grad(k, v):
    with tf.GradientTape() as tape:
      tape.watch(k)
      loss = conv_loss(k, v, 1, "SAME", 1) / 8.
    return lax.psum(tape.gradient(loss, k), "i")

  got = tfspmd.pmap(grad, "i", in_axes=(None, 0), out_axes=None)(kernel, x)
  k = tf.constant(kernel)
  with tf.GradientTape() as tape:
    tape.watch(k)
    loss = conv_loss(k, tf.constant(x.reshape(8, 5, 5, 1)), 1, "SAME", 1) / 8.
  np.testing.assert_allclose(got, tape.gradient(loss, k), rtol=1e-4, atol=1e-5)
