"""Arithmetic on ShardedArrays, on the devices, keeping how they are split.

A jax.Array supports every operator and runs it where the array lives; so
does a `ShardedArray`. Where the host executor runs the array's mesh, the
array is one host tensor: an elementwise operator runs on it there and the
result keeps the array's split. Elsewhere, and for a result of another
shape, the operator runs the TensorFlow op on the DTensors (DTensor runs it
on every device's blocks), and the result is a `ShardedArray` laid out as
DTensor's SPMD expansion left it. Operands that
are not on the devices (NumPy arrays, Python numbers, tf.Tensors) are copied
to every device of the array's mesh first. A Python number takes the array's
dtype where it fits, as TensorFlow does; everything else keeps its own, and
dtypes follow TensorFlow: no promotion (`int32 array + 1.5` or a float32
array plus a float64 NumPy array is an error: cast first).
"""

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfspmd._src.core.config import config
from tfspmd._src.executors import dtensor_values
from tfspmd._src.runtime import placement as placement_lib


def _operand(value, like):
  """`value` as a DTensor on the mesh of the ShardedArray `like`."""
  if isinstance(value, type(like)):
    mesh_key = like.placement.mesh_key
    if value.placement.mesh_key == mesh_key:
      return value.dtensor_value
    if value.placement.mesh_key[1:] == mesh_key[1:]:
      # Other dimension names only (a shard_map's result and a pmap's):
      # each device keeps its blocks, now on `like`'s mesh.
      return placement_lib.repack(
          value.dtensor_value, placement_lib.renamed(value.placement, mesh_key))
    if set(value.placement.devices) == set(like.placement.devices):
      # A mesh of another shape over the same devices: moved on the
      # devices, split as `like` where the shapes agree.
      spec = (like.placement.spec if value.shape == like.shape
              else (None,) * value.shape.rank)
      return placement_lib.relayout(
          value.dtensor_value, placement_lib.Placement(mesh_key, spec))
    raise ValueError(
        f"ShardedArray arithmetic needs both arrays on the same devices; "
        f"one lies on {_describe(like.placement.devices)}, the other on "
        f"{_describe(value.placement.devices)}. Fetch one with np.asarray "
        f"first.")
  if isinstance(value, tf.Tensor) and dtensor.is_dtensor(value):
    return value
  if (isinstance(value, (bool, int, float, complex)) and
      not isinstance(value, np.generic)):  # np.float64 is a float too
    # A Python number takes the array's dtype where it fits, as in
    # `tensor + 1`. Only a Python number: a dtype hint would truncate a NumPy
    # array of floats to an integer array's dtype without a word.
    tensor = tf.convert_to_tensor(value, dtype_hint=like.dtype)
  elif isinstance(value, (np.ndarray, np.generic)):
    tensor = tf.convert_to_tensor(config.narrowed(np.asarray(value)))
  else:
    tensor = tf.convert_to_tensor(value)
  return placement_lib.replicated(tensor, like.placement.mesh)


def _describe(devices):
  """`devices` for a message: their count, platform and ids."""
  platforms = sorted({device.platform for device in devices})
  return (f"{len(devices)} {'/'.join(platforms)} devices "
          f"{[device.id for device in devices]}")


def accepts(value, like):
  """Whether `value` can be the other operand of an operator of `like`."""
  return isinstance(value, (type(like), tf.Tensor, np.ndarray, np.generic,
                            bool, int, float, complex))


def wrap(value, like):
  """The DTensor `value` as a ShardedArray on the mesh of `like`."""
  split = tuple(None if dim == dtensor.UNSHARDED else dim
                for dim in dtensor.fetch_layout(value).sharding_specs)
  placement = placement_lib.Placement(like.placement.mesh_key, split,
                                      like.placement.merged)
  return type(like)(value, placement,
                    placement.local_shape(tuple(value.shape)), value.dtype)


def binary(op, left, right, like):
  """`op` of the two operands (one of them `like`), on the devices."""
  on_host_executor = like._on_host_executor()  # pylint: disable=protected-access
  if op is not matmul and on_host_executor:
    on_host = _elementwise_on_host(op, left, right, like)
    if on_host is not None:
      return on_host
  left, right = _operand(left, like), _operand(right, like)
  _check_dtypes(left, right)
  # An op on DTensors is a call into DTensor's device.
  return dtensor_values.entered(lambda: wrap(op(left, right), like))


def _check_dtypes(left, right):
  if left.dtype != right.dtype:
    # Checked before the op: DTensor's eager ops crash the process on it
    # (TF 2.21), and TensorFlow's own message names neither array.
    raise TypeError(
        f"ShardedArray arithmetic between {left.dtype.name} and "
        f"{right.dtype.name}: TensorFlow does not promote dtypes; cast one "
        f"first (x.astype(tf.{right.dtype.name}), or tf.cast).")


def _host_operand(value, like):
  """`value` as a host tensor beside the host-held `like`, or None."""
  if isinstance(value, type(like)):
    if set(value.placement.devices) != set(like.placement.devices):
      return None
    return value._whole_tensor()  # pylint: disable=protected-access
  if isinstance(value, tf.Tensor):
    return None if dtensor.is_dtensor(value) else value
  if (isinstance(value, (bool, int, float, complex)) and
      not isinstance(value, np.generic)):
    return tf.convert_to_tensor(value, dtype_hint=like.dtype)
  return tf.convert_to_tensor(config.narrowed(np.asarray(value)))


def _elementwise_on_host(op, left, right, like):
  """The elementwise `op` on the host executor's whole tensors, or None.

  Where the host executor runs the array's mesh, the array is one host
  tensor: the op runs on it, and a result of `like`'s shape keeps `like`'s
  placement. None where DTensor's route decides (a result of another
  shape, whose split DTensor's expansion chooses, or a DTensor operand).
  """
  a, b = _host_operand(left, like), _host_operand(right, like)
  if a is None or b is None:
    return None
  if tf.broadcast_static_shape(a.shape, b.shape) != like.shape:
    return None
  _check_dtypes(a, b)
  with tf.device(like.placement.devices[0].name):
    out = op(a, b)
  return type(like).on_host(out, like.placement, like.shape, out.dtype)


def elementwise(op, value):
  """The elementwise `op` of one ShardedArray, split as it is."""
  if value._on_host_executor():  # pylint: disable=protected-access
    with tf.device(value.placement.devices[0].name):
      out = op(value._whole_tensor())  # pylint: disable=protected-access
    return type(value).on_host(out, value.placement, value.shape, out.dtype)
  return unary(op, value)


def unary(op, value):
  return dtensor_values.entered(lambda: wrap(op(value.dtensor_value), value))


def matmul(left, right):
  """NumPy's matmul: a 1-D operand is a row (left) or a column (right)."""
  if left.shape.rank == 1 and right.shape.rank == 1:
    return tf.reduce_sum(left * right)
  if left.shape.rank == 1:
    return tf.squeeze(tf.matmul(tf.expand_dims(left, 0), right), -2)
  if right.shape.rank == 1:
    return tf.squeeze(tf.matmul(left, tf.expand_dims(right, -1)), -1)
  return tf.matmul(left, right)
