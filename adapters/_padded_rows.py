"""Padding rows that count nowhere in a `KerasTrainer` step.

With `remainder='pad'` a global batch that does not divide by the devices is
padded, and each device's batch carries `rows`, a float mask of shape
`(batch,)`: 1 for a row of the dataset, 0 for a padding row (None when the
batches are not padded). A step cannot drop the padding rows (shapes are
static on the devices), so these functions weigh them out instead: of the
loss and the gradients, and of the non-trainable values the devices
average. (The compiled metrics weigh them out through
`_keras_internal.compute_metrics_of_rows`, BatchNormalization's batch
statistics through `_keras_internal.batch_norm_moments`.)
"""

import tensorflow as tf

from tfspmd import lax


def sample_weights_for_loss(sample_weight, rows, axis_name):
  """The sample weights that give padded batches the loss of unpadded ones.

  Keras' default reduction divides the weighted sum by the number of rows,
  padding included, on each device; scaling each real row's weight by
  (rows with padding) / (real rows) over all devices makes the mean of
  the devices' losses the loss of the real rows. The regularization
  losses, added unweighted, are left as they are.

  Args:
    sample_weight: This device's sample weights (a structure), or None.
    rows: This device's row mask, or None for an unpadded batch.
    axis_name: The pmap axis the batch is split over.

  Returns:
    The weights to give the compiled loss: `sample_weight` itself when
    `rows` is None.
  """
  if rows is None:
    return sample_weight
  padded = lax.psum(tf.cast(tf.shape(rows)[0], tf.float32), axis_name)
  real = lax.psum(tf.reduce_sum(rows), axis_name)
  scaled = rows * (padded / real)
  if sample_weight is None:
    return scaled

  def weighted(weight):
    if not weight.dtype.is_floating:
      weight = tf.cast(weight, tf.float32)
    shape = [-1] + [1] * (weight.shape.rank - 1)
    return weight * tf.reshape(tf.cast(scaled, weight.dtype), shape)

  return tf.nest.map_structure(weighted, sample_weight)


def averaged_non_trainable(old_values, new_values, rows, axis_name,
                           replicated=frozenset()):
  """The non-trainable floats a step updated, averaged over the devices.

  Each device's value weighs as many of its rows as are real, so a device
  holding only padding rows counts for nothing.

  Args:
    old_values: The non-trainable values the step started from.
    new_values: This device's values after the step, in the same order.
    rows: This device's row mask, or None (then a plain mean).
    axis_name: The pmap axis to average over.
    replicated: The positions of values that are the same on every device
      already (BatchNormalization's moving statistics): left as they are.

  Returns:
    `new_values`, each float the step changed averaged over the devices.
  """
  if rows is None:
    average = lambda value: lax.pmean(value, axis_name)
  else:
    count = tf.reduce_sum(rows)
    total = lax.psum(count, axis_name)
    average = lambda value: lax.psum(
        value * tf.cast(count, value.dtype), axis_name) / tf.cast(
            total, value.dtype)
  return [new if new is old or k in replicated or not new.dtype.is_floating
          else average(new)
          for k, (old, new) in enumerate(zip(old_values, new_values))]
