"""pmap training state saved and restored with `tf.train.Checkpoint`.

A state is a pytree (tuples, lists, dicts, namedtuples) whose leaves are
`tfspmd.ShardedArray`s, tensors or NumPy arrays. In the checkpoint:
  - a replicated `ShardedArray` (parameters, optimizer state: the same on
    every device) is stored once, as one variable;
  - a split `ShardedArray` (per-device state) is stored per device, one
    variable per device holding that device's block, read from the device
    itself with no gathering;
  - any other leaf is stored as one variable.
Restoring needs a state of the same structure to fill (`like`), usually the
state a fresh run built; the values come back bit for bit, placed as the
leaves of `like` are. Other trackables (a step counter, a `tf.data`
iterator) can be saved beside the state in the same checkpoint.
"""

import numpy as np
import tensorflow as tf

import tfspmd
from adapters import _placement


def save(path, state, **trackables):
  """Writes `state` (and any `trackables`) to the checkpoint `path`.

  Args:
    path: The checkpoint prefix, e.g. '/tmp/run/ckpt-3'.
    state: The pytree of the training state.
    **trackables: More objects for `tf.train.Checkpoint` to save beside it
      (`tf.Variable`s, Keras models, `tf.data` iterators, ...).

  Returns:
    The checkpoint prefix written.

  Example:
    >>> import os, tempfile, numpy as np, tfspmd
    >>> from adapters import checkpoint
    >>> state = tfspmd.pmap(lambda x: x * 2)(np.arange(8.))
    >>> path = checkpoint.save(os.path.join(tempfile.mkdtemp(), 'ckpt'), state)
    >>> print(checkpoint.restore(path, like=state))
    [ 0.  2.  4.  6.  8. 10. 12. 14.]
  """
  leaves = [_saved_leaf(leaf) for leaf in tf.nest.flatten(state)]
  _checkpoint(leaves, trackables).write(path)
  return path


def restore(path, like, **trackables):
  """Reads a state saved by `save` into the structure and placement of `like`.

  Args:
    path: The checkpoint prefix `save` returned.
    like: A state with the structure, shapes, dtypes and placements wanted
      (the values are not read).
    **trackables: The objects saved beside the state, to restore in place.

  Returns:
    The restored state: `ShardedArray` leaves where `like` has them, placed
    the same way; NumPy arrays elsewhere.

  Raises:
    ValueError: If the checkpoint does not hold a state like `like`.

  Example:
    >>> import os, tempfile, numpy as np, tensorflow as tf, tfspmd
    >>> from adapters import checkpoint
    >>> step = tfspmd.pmap(lambda w, x: w + tfspmd.lax.psum(x, 'i'), 'i',
    ...                    in_axes=(None, 0), out_axes=None)
    >>> w = step(np.zeros(2, np.float32), np.ones((8, 2), np.float32))
    >>> epoch = tf.Variable(1)
    >>> path = checkpoint.save(os.path.join(tempfile.mkdtemp(), 'ckpt'),
    ...                        {'w': w}, epoch=epoch)
    >>> _ = epoch.assign(0)
    >>> restored = checkpoint.restore(path, like={'w': w}, epoch=epoch)
    >>> print(restored['w'], int(epoch))
    [8. 8.] 1
  """
  like_leaves = tf.nest.flatten(like)
  targets = [_target_leaf(leaf) for leaf in like_leaves]
  status = _checkpoint(targets, trackables).read(path)
  try:
    status.assert_existing_objects_matched()
  except AssertionError as e:
    raise ValueError(
        f"checkpoint.restore: {path} does not hold a state like `like` "
        f"({len(like_leaves)} leaves, with the same per-device splits) and "
        f"the trackables {sorted(trackables)}: {e}") from None
  values = [_restored_leaf(target, leaf)
            for target, leaf in zip(targets, like_leaves)]
  return tf.nest.pack_sequence_as(like, values)


def _checkpoint(leaves, trackables):
  return tf.train.Checkpoint(state=leaves, **trackables)


def _saved_leaf(leaf):
  """The variable(s) holding one leaf: one, or one per device for a split leaf."""
  if isinstance(leaf, tfspmd.ShardedArray):
    blocks = _placement.unpack(leaf)
    if _placement.is_replicated(leaf):
      return _variable_on(blocks[0])
    return [_variable_on(block) for block in blocks]
  return tf.Variable(np.asarray(leaf), trainable=False)


def _variable_on(tensor):
  with tf.device(tensor.device):
    return tf.Variable(tensor, trainable=False)


def _target_leaf(leaf):
  """Variables shaped like `leaf`'s saved form, for the checkpoint to fill."""
  if isinstance(leaf, tfspmd.ShardedArray):
    blocks = [tf.zeros(block.shape, block.dtype)
              for block in _placement.unpack(leaf)]
    if _placement.is_replicated(leaf):
      return tf.Variable(blocks[0], trainable=False)
    return [tf.Variable(block, trainable=False) for block in blocks]
  array = np.asarray(leaf)
  return tf.Variable(np.zeros(array.shape, array.dtype), trainable=False)


def _restored_leaf(target, like):
  if not isinstance(like, tfspmd.ShardedArray):
    return target.numpy()
  if _placement.is_replicated(like):
    components = [target.read_value()] * len(like.addressable_shards)
  else:
    components = [v.read_value() for v in target]
  return _placement.pack_like(components, like)
