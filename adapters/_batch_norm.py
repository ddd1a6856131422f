"""BatchNormalization's moving statistics of the global batch in a step.

In a `KerasTrainer` step each device normalizes its rows by their own batch
moments, as each replica of a `tf.distribute` strategy does. The moving
mean and variance, though, are those `model.fit` computes on one device:
the mean and the variance of the real rows of the whole global batch. The
moments of the devices' rows (count `n_d`, mean `m_d` and variance `v_d`
over a device's real rows) pool into those of the global batch exactly:

    N = sum(n_d),  M = sum(n_d * m_d) / N,
    V = sum(n_d * (v_d + (m_d - M)**2)) / N,

the devices' variances about their own means plus the spread of those
means about the global one. A device with no real rows weighs nothing, and
one with a single row (variance 0) adds that row's distance from `M`.
"""

import tensorflow as tf

from tfspmd import lax

from . import _keras_internal


def recorded_moments(model, rows, axis_name):
  """A context in which `model`'s BatchNormalizations record their moments.

  Padding rows (`rows` 0) are left out of the moments. A layer made with
  `synchronized=True` normalizes by the moments of the global batch,
  pooled over `axis_name` (its gradient flows through the pooling), as
  under a `tf.distribute` strategy; the others by their device's rows.

  Args:
    model: The Keras model the step runs.
    rows: This device's row mask, or None for an unpadded batch.
    axis_name: The pmap axis the batch is split over.

  Returns:
    A context manager yielding the list of `(layer, count, mean, variance)`
    records that `moving_statistics_of_global_batch` takes.
  """
  return _keras_internal.batch_norm_moments(
      model, rows, lambda *moments: pooled_moments(*moments, axis_name))


def pooled_moments(count, mean, variance, axis_name):
  """`(count, mean, variance)` of the global batch, from each device's."""
  total = lax.psum(count, axis_name)
  global_mean = tf.math.divide_no_nan(lax.psum(count * mean, axis_name),
                                      total)
  global_variance = tf.math.divide_no_nan(
      lax.psum(count * (variance + tf.square(mean - global_mean)), axis_name),
      total)
  return total, global_mean, global_variance


def moving_statistics_of_global_batch(model, old_values, new_values, records,
                                      axis_name):
  """The BatchNormalizations' moving statistics, updated by the global batch.

  Args:
    model: The Keras model the step runs.
    old_values: The values of `model.non_trainable_variables` the step
      started from.
    new_values: This device's values of them after its forward pass.
    records: The moments the BatchNormalizations recorded in the forward
      pass (`recorded_moments`), in the order of their calls.
    axis_name: The pmap axis the batch is split over.

  Returns:
    `(values, positions)`: `new_values` with each recorded layer's moving
    mean and variance updated, as the layer updates them, by the moments of
    the global batch instead of this device's; and the positions of those
    values, the same on every device.
  """
  positions = {id(variable): k
               for k, variable in enumerate(model.non_trainable_variables)}
  values = list(new_values)
  updated = set()
  for layer, count, mean, variance in records:
    if layer.renorm:
      # Batch renormalization corrects the moments by the moving ones as it
      # updates them; its devices' moving values are averaged instead.
      continue
    _, global_mean, global_variance = pooled_moments(count, mean, variance,
                                                     axis_name)
    for variable, batch_value in ((layer.moving_mean, global_mean),
                                  (layer.moving_variance, global_variance)):
      k = positions[id(variable)]
      # A layer called twice in the step updates its statistics twice.
      moving = tf.cast(values[k] if k in updated else old_values[k],
                       batch_value.dtype)
      values[k] = tf.cast(
          moving * layer.momentum + batch_value * (1.0 - layer.momentum),
          old_values[k].dtype)
      updated.add(k)
  return values, frozenset(updated)
