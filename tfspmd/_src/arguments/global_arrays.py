"""Global arrays built block by block, as JAX's `jax.make_array_from_*`.

Each makes a `ShardedArray` laid out as a `NamedSharding` says from what
this process has: a callback giving the block of each index, one array per
device, or this process's part of the data. Every block goes straight to
its device (`dtensor.pack`); no process holds the whole array, so with
several processes (`tfspmd.distributed`) each passes only its own.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
import math
from typing import Any

import numpy as np
import tensorflow as tf

from tfspmd._src.arguments import arguments
from tfspmd._src.executors import dtensor_values
from tfspmd._src.runtime import device_meshes
from tfspmd._src.runtime import placement as placement_lib
from tfspmd._src.runtime.named_sharding import NamedSharding
from tfspmd._src.runtime.named_sharding import placement_of
from tfspmd._src.runtime.sharded_array import ShardedArray


def _checked_sharding(sharding, function):
  if not isinstance(sharding, NamedSharding):
    raise TypeError(
        f"{function}: `sharding` must be a tfspmd.NamedSharding(mesh, spec), "
        f"got {type(sharding).__name__}; for one device, use "
        f"tfspmd.device_put(x, device).")
  return sharding


def _wrapped(components, placement, shape, dtype):
  value = dtensor_values.pack(components, placement.layout)
  return ShardedArray(value, placement, placement.local_shape(shape), dtype)


def _block_shape(placement, shape):
  return tuple(extent // count
               for extent, count in zip(shape, placement.counts()))


def make_array_from_callback(
    shape: Sequence[int], sharding: NamedSharding,
    data_callback: Callable[[tuple[slice, ...]], Any]) -> ShardedArray:
  """The array of `shape` laid out by `sharding`, each block from a callback.

  Args:
    shape: The global array's shape.
    sharding: How it lies on the devices.
    data_callback: Called once per device of this process with the NumPy
      index of its block (a tuple of slices of the global array; `slice(None)`
      along a dimension the block holds whole); returns that block (a NumPy
      array, a tensor or a Python number).

  Returns:
    A `ShardedArray` (this process's part of it, with several processes).

  Raises:
    TypeError: If `sharding` is not a `NamedSharding` or `shape` not ints.
    ValueError: If a block the callback returns has another shape, or the
      blocks differ in dtype.

  Example:
    >>> import numpy as np, tfspmd
    >>> from tfspmd import NamedSharding, P
    >>> mesh = tfspmd.make_mesh((4, 2), ('x', 'y'))
    >>> data = np.arange(32.).reshape(8, 4)
    >>> x = tfspmd.make_array_from_callback(
    ...     data.shape, NamedSharding(mesh, P('x', 'y')), lambda i: data[i])
    >>> x.addressable_shards[1].index
    (slice(0, 2, None), slice(2, 4, None))
    >>> np.array_equal(np.asarray(x), data)
    True
  """
  function = "make_array_from_callback"
  shape = device_meshes.checked_shape(shape, "shape", function, 0)
  sharding = _checked_sharding(sharding, function)
  placement = placement_of(sharding, shape, f"{function}: the array")
  expected = _block_shape(placement, shape)
  components, dtype = [], None
  for device, index in placement.local_blocks:
    block = placement_lib.block_slices(index, shape, placement.counts())
    value = arguments.to_array_leaf(data_callback(block),
                                    f"data_callback({block})")
    if isinstance(value, ShardedArray):
      value = value.numpy()
    if tuple(value.shape) != expected:
      raise ValueError(
          f"{function}: data_callback returned an array of shape "
          f"{tuple(value.shape)} for the index {block}, whose block has "
          f"shape {expected}.")
    value_dtype = tf.as_dtype(value.dtype)
    if dtype not in (None, value_dtype):
      raise ValueError(
          f"{function}: data_callback returned {value_dtype.name} for the "
          f"index {block}, {dtype.name} for an earlier one; every block "
          f"must have one dtype.")
    dtype = value_dtype
    with tf.device(device.name):
      components.append(tf.identity(value))
  return _wrapped(components, placement, shape, dtype)


def make_array_from_single_device_arrays(
    shape: Sequence[int], sharding: NamedSharding,
    arrays: Sequence[tf.Tensor]) -> ShardedArray:
  """The array of `shape` laid out by `sharding`, from each device's block.

  Args:
    shape: The global array's shape.
    sharding: How it lies on the devices.
    arrays: One `tf.Tensor` per device of this process that the sharding
      uses, on that device, holding the device's block (as a `Shard`'s
      `data` does), in any order.

  Returns:
    A `ShardedArray` whose blocks are `arrays`, with no copy between devices.

  Raises:
    TypeError: If an array is not a tensor on one of the devices.
    ValueError: If a device has no array or two, or a block another shape
      or dtype.

  Example:
    >>> import numpy as np, tensorflow as tf, tfspmd
    >>> from tfspmd import NamedSharding, P
    >>> x = tfspmd.device_put(np.arange(8.), NamedSharding(
    ...     tfspmd.make_mesh((8,), ('i',)), P('i')))
    >>> blocks = []
    >>> for shard in x.addressable_shards:
    ...   with tf.device(shard.data.device):  # each block stays on its device
    ...     blocks.append(shard.data * 10)
    >>> y = tfspmd.make_array_from_single_device_arrays(x.shape, x.sharding,
    ...                                                 blocks)
    >>> print(y)
    [ 0. 10. 20. 30. 40. 50. 60. 70.]
  """
  function = "make_array_from_single_device_arrays"
  shape = device_meshes.checked_shape(shape, "shape", function, 0)
  sharding = _checked_sharding(sharding, function)
  placement = placement_of(sharding, shape, f"{function}: the array")
  expected = _block_shape(placement, shape)
  by_device = {}
  for k, array in enumerate(arrays):
    if not isinstance(array, tf.Tensor) or not getattr(array, "device", ""):
      raise TypeError(
          f"{function}: arrays[{k}] must be a tf.Tensor on one device (a "
          f"Shard's `data`, or made under `with tf.device(...)`), got "
          f"{type(array).__name__}.")
    name = array.device
    if name in by_device:
      raise ValueError(f"{function}: two arrays lie on {name}; give one "
                       f"per device.")
    by_device[name] = (k, array)
  components, dtype, used = [], None, set()
  for device, _ in placement.local_blocks:
    if device.name not in by_device:
      raise ValueError(
          f"{function}: no array lies on {device.name}, which the sharding "
          f"uses; give one per device of this process that it uses "
          f"({len(placement.local_blocks)}).")
    k, array = by_device[device.name]
    used.add(device.name)
    if tuple(array.shape) != expected:
      raise ValueError(
          f"{function}: arrays[{k}] has shape {tuple(array.shape)}, but the "
          f"block of {device.name} has shape {expected}.")
    if dtype not in (None, array.dtype):
      raise ValueError(f"{function}: arrays[{k}] is {array.dtype.name}, an "
                       f"earlier one {dtype.name}; give one dtype.")
    dtype = array.dtype
    components.append(array)
  unused = sorted(set(by_device) - used)
  if unused:
    raise ValueError(f"{function}: arrays lie on {unused}, which the "
                     f"sharding does not use.")
  return _wrapped(components, placement, shape, dtype)


def make_array_from_process_local_data(
    sharding: NamedSharding, local_data: Any,
    global_shape: Sequence[int] | None = None) -> ShardedArray:
  """The global array of which `local_data` is this process's part.

  With one process the part is the whole array. With several, each process
  passes the blocks its devices hold: along a dimension the sharding splits
  over mesh axes, the positions of its devices, in order; along any other,
  the whole extent.

  Args:
    sharding: How the global array lies on the devices.
    local_data: This process's part (a NumPy array, tensor or number).
    global_shape: The global shape; by default each split dimension is the
      part's extent times the number of processes' parts along it.

  Returns:
    A `ShardedArray` (this process's part of the global array, as pmap's
    results are).

  Raises:
    ValueError: If the part's shape does not fit `global_shape`, or this
      process's devices do not form a block of the mesh.

  Example:
    >>> import numpy as np, tfspmd
    >>> from tfspmd import NamedSharding, P
    >>> mesh = tfspmd.make_mesh((8,), ('i',))
    >>> x = tfspmd.make_array_from_process_local_data(
    ...     NamedSharding(mesh, P('i')), np.arange(16.))
    >>> x.sharding.spec, x.shape
    (PartitionSpec('i'), TensorShape([16]))
  """
  function = "make_array_from_process_local_data"
  sharding = _checked_sharding(sharding, function)
  value = arguments.to_array_leaf(local_data, "local_data")
  if isinstance(value, ShardedArray):
    value = value.numpy()
  local = np.asarray(value)
  if not placement_lib.process_block(sharding.mesh.devices).is_block:
    raise ValueError(
        f"{function}: this process's devices are not a block of the mesh "
        f"{sharding.mesh}, so its part of an array is no array; make the "
        f"mesh over tfspmd.devices() in process order "
        f"(tfspmd.make_mesh(shape, names)).")
  # The counts of blocks depend on the spec and mesh alone: any shape they
  # divide gives them.
  probe = placement_of(sharding, _probe_shape(sharding, local.ndim),
                       f"{function}: local_data")
  if global_shape is None:
    global_shape = tuple(
        extent * count // local_count for extent, count, local_count in zip(
            local.shape, probe.counts(), probe.local_counts()))
  global_shape = device_meshes.checked_shape(global_shape, "global_shape",
                                              function, 0)
  placement = placement_of(sharding, global_shape, f"{function}: the array")
  if tuple(placement.local_shape(global_shape)) != local.shape:
    raise ValueError(
        f"{function}: local_data has shape {local.shape}, but this "
        f"process's part of an array of shape {global_shape} laid out by "
        f"{sharding} has shape {tuple(placement.local_shape(global_shape))}.")
  packed = placement_lib.pack_host_array(local, placement)
  return ShardedArray(packed, placement, local.shape, packed.dtype)


def _probe_shape(sharding, rank):
  """A shape of `rank` that `sharding` splits evenly: each dimension's count."""
  spec, mesh = sharding.spec, sharding.mesh
  return tuple(math.prod(mesh.shape[name] for name in spec.axes_of(d))
               for d in range(rank))
