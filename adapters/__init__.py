"""Adapters from existing TensorFlow code to tfspmd's pmap.

- `tfspmd.adapters.tf_data`: a `tf.data.Dataset` of global batches, as
  per-device batches placed on the devices.
- `tfspmd.adapters.keras_training`: data-parallel training of an unchanged
  Keras 3 model through pmap.
- `tfspmd.adapters.checkpoint`: pmap training state saved and restored with
  `tf.train.Checkpoint`.
"""
