"""Adapters from existing TensorFlow code to tfspmd's pmap.

- `tfspmd.adapters.data_parallel(model)`: a Keras model whose own `fit`,
  `evaluate` and `predict` run data-parallel over the devices.
- `tfspmd.adapters.tf_data`: a `tf.data.Dataset` of global batches, as
  per-device batches placed on the devices.
- `tfspmd.adapters.keras_training`: data-parallel training of an unchanged
  Keras 3 model through pmap.
- `tfspmd.adapters.checkpoint`: pmap training state saved and restored with
  `tf.train.Checkpoint`.
"""


def data_parallel(model, *, num_devices=None, axis_name="data"):
  """Makes `model.fit`, `evaluate` and `predict` run data-parallel.

  See `tfspmd.adapters.keras_data_parallel.data_parallel`; Keras is imported
  at the first call, not with `tfspmd.adapters`.

  Example:
    >>> import keras
    >>> from tfspmd.adapters import data_parallel
    >>> model = data_parallel(keras.Sequential([keras.layers.Dense(1)]))
    >>> model.fit.__self__.axis_name
    'data'
  """
  from . import keras_data_parallel  # pylint: disable=g-import-not-at-top
  return keras_data_parallel.data_parallel(
      model, num_devices=num_devices, axis_name=axis_name)
