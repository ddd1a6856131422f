"""Moving arrays to and from the devices, as JAX's `device_put` and friends.

Every function takes a pytree and works leaf by leaf. A `NamedSharding`
places a leaf as a `ShardedArray` whose blocks are packed onto the mesh's
devices (`dtensor.pack`), or, for a `ShardedArray` already on the devices,
moved there by DTensor; a `Device` places a leaf whole on that device as a
`tf.Tensor`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfspmd._src.arguments import arguments
from tfspmd._src.core import multiprocess_hooks
from tfspmd._src.core import trace_context
from tfspmd._src.executors import dtensor_device
from tfspmd._src.executors import dtensor_values
from tfspmd._src.runtime import devices as devices_lib
from tfspmd._src.runtime import mesh as mesh_lib
from tfspmd._src.runtime import named_mesh
from tfspmd._src.runtime import placement as placement_lib
from tfspmd._src.runtime.named_sharding import NamedSharding
from tfspmd._src.runtime.named_sharding import SingleDeviceSharding
from tfspmd._src.runtime.named_sharding import placement_of
from tfspmd._src.runtime.sharded_array import ShardedArray
from tfspmd._src.trees import tree

_TARGETS = (NamedSharding, SingleDeviceSharding, devices_lib.Device,
            named_mesh.PartitionSpec)


def _is_target(value):
  return value is None or isinstance(value, _TARGETS)


def _is_target_leaf(value):
  """Ends the walk of `device`'s tree: a target, or anything not a container."""
  return _is_target(value) or tree.flatten(value)[0] == [value]


def device_put(x: Any, device: Any = None, *, src: None = None,
               donate: bool = False, may_alias: bool | None = None) -> Any:
  """Places every leaf of `x` as `device` says, like `jax.device_put`.

  Inside a `tfspmd.jit` function, as in JAX, it lays a value out on the
  function's mesh as a `NamedSharding` or `PartitionSpec` says (a sharding
  constraint, `lax.with_sharding_constraint`).

  Args:
    x: A pytree of arrays (`ShardedArray`, `tf.Tensor`, NumPy arrays, Python
      numbers).
    device: Where to put each leaf, or a tree prefix of `x` holding such
      targets: a `NamedSharding` gives a `ShardedArray` split over its mesh
      as its spec says (a `ShardedArray` already on the devices moves there
      on the devices); a bare `PartitionSpec` is a `NamedSharding` over the
      mesh `tfspmd.set_mesh` set, as in JAX; a `tfspmd.Device` or
      `SingleDeviceSharding` gives a `tf.Tensor` whole on that device; None
      leaves `ShardedArray`s and tensors where they are and puts host
      values on the first device.
    src: Must be None: each `ShardedArray` knows where it lies.
    donate: If True, a `ShardedArray` leaf that was moved is deleted, its
      buffers freed, as a donated input.
    may_alias: If False, a leaf already placed as asked is copied instead
      of returned as it is.

  Returns:
    `x` with each leaf placed.

  Raises:
    TypeError: If `device` holds something other than a sharding, a
      PartitionSpec, a device or None, or a PartitionSpec with no mesh
      set.
    ValueError: If `src` is not None, or an array does not fit its
      sharding (rank below the spec's length, or a dimension that does not
      split evenly), or, for a value of a function being traced, outside a
      `tfspmd.jit` function or toward a device.

  Example:
    >>> import numpy as np, tfspmd
    >>> from tfspmd.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = tfspmd.make_mesh((4, 2), ('x', 'y'))
    >>> y = tfspmd.device_put(np.arange(8.), NamedSharding(mesh, P('x')))
    >>> y.sharding
    NamedSharding(mesh=Mesh({'x': 4, 'y': 2}), spec=PartitionSpec('x'))
    >>> y.addressable_shards[2].data.numpy()
    array([2., 3.])
    >>> tfspmd.device_put(np.ones(2), tfspmd.devices()[3]).device
    '/job:localhost/replica:0/task:0/device:CPU:3'
  """
  if src is not None:
    raise ValueError(
        f"device_put: `src` must be None: tfspmd reads where each "
        f"ShardedArray lies from the array itself; got {src!r}.")
  targets = tree.broadcast_prefix(
      device, x, spec_name="device", root="x", is_spec_leaf=_is_target_leaf)
  leaves, treedef = tree.flatten(x)
  paths = tree.leaf_paths(x, "x")
  placed = []
  for leaf, target, path in zip(leaves, targets, paths):
    if not _is_target(target):
      raise TypeError(
          f"device_put: the `device` for {path} must be a NamedSharding, a "
          f"PartitionSpec, a SingleDeviceSharding, a tfspmd.Device or None, "
          f"got {type(target).__name__} {target!r}.")
    if tf.is_symbolic_tensor(leaf) or (
        tf.inside_function() and
        trace_context.this_thread.jit_mesh is not None):
      placed.append(_put_traced(leaf, target, path))
      continue
    result = _put(leaf, target, path)
    if result is leaf and may_alias is False:
      result = _copy(leaf)
    if donate and result is not leaf and isinstance(leaf, ShardedArray):
      leaf.delete()
    placed.append(result)
  return treedef.unflatten(placed)


def _put_traced(leaf, target, path):
  """`leaf`, a value of a function being traced, placed as `target` says.

  In a `tfspmd.jit` function every value lies on the function's mesh, and
  placing one is a sharding constraint, as in JAX; in a pmap, a shard_map
  or another `tf.function` values lie on no mesh.
  """
  context = trace_context.this_thread
  mesh = context.jit_mesh
  if mesh is None or context.frames or context.trace is not None:
    raise ValueError(
        f"device_put: {path} is a value of a function being traced (a "
        f"pmap's, a shard_map's or a tf.function's), which lies on no "
        f"devices of its own; call device_put on the arrays outside the "
        f"function. Inside a tfspmd.jit function (outside the shard_maps "
        f"in it), device_put(x, sharding) lays a value out, as "
        f"lax.with_sharding_constraint does.")
  if target is None:
    return leaf
  if not isinstance(target, (NamedSharding, named_mesh.PartitionSpec)):
    raise ValueError(
        f"device_put: inside a tfspmd.jit function every value lies on the "
        f"function's mesh {mesh}, but {path} was sent to {target}; give a "
        f"NamedSharding or a PartitionSpec over that mesh (a sharding "
        f"constraint), or device_put the function's result onto the device "
        f"outside it.")
  return laid_out_in_jit(leaf, target, mesh, path, "device_put")


def laid_out_in_jit(leaf, target, mesh, path, function):
  """`leaf`, a value of the `tfspmd.jit` function on `mesh`, laid out.

  Args:
    leaf: A value of the function being traced.
    target: A `NamedSharding` over `mesh`, or a `PartitionSpec` (over it).
    mesh: The mesh of the jitted function.
    path: The leaf's path, for messages.
    function: The caller's name, for messages.

  Returns:
    The DTensor relayout of `leaf` to `target`'s layout.
  """
  if isinstance(target, named_mesh.PartitionSpec):
    target = NamedSharding(mesh, target)
  if not isinstance(target, NamedSharding):
    raise TypeError(
        f"{function}: the sharding for {path} must be a NamedSharding or a "
        f"PartitionSpec, got {type(target).__name__} {target!r}.")
  if target.mesh != mesh:
    raise ValueError(
        f"{function}: the sharding for {path} is over {target.mesh}, but "
        f"the jitted function runs on {mesh}.")
  tensor = tf.convert_to_tensor(leaf)
  placement = placement_of(target, tensor.shape.as_list(), path)
  if placement.merged is not None:
    raise ValueError(
        f"{function}: {target.spec} splits one dimension of {path} over "
        f"several mesh axes, which a jitted function's value cannot lie as; "
        f"lay it out over one axis per dimension inside, and give the jit "
        f"out_shardings={target.spec} for its result.")
  return dtensor.relayout(tensor, placement.layout)


def _put(leaf, target, path):
  if isinstance(target, named_mesh.PartitionSpec):
    mesh = named_mesh.context_mesh()
    if mesh is None:
      raise TypeError(
          f"device_put: the `device` for {path} is the PartitionSpec "
          f"{target}, which needs a mesh: set one first "
          f"(`tfspmd.set_mesh(mesh)` or `with mesh:`), or give "
          f"NamedSharding(mesh, {target}).")
    target = NamedSharding(mesh, target)
  if isinstance(target, NamedSharding):
    return _put_sharded(leaf, target, path)
  if isinstance(target, SingleDeviceSharding):
    (target,) = target.device_set
  if target is None:
    if isinstance(leaf, (ShardedArray, tf.Tensor)):
      return leaf
    target = devices_lib.devices()[0]
  return _put_on_device(leaf, target, path)


def _put_sharded(leaf, sharding, path):
  value = arguments.to_array_leaf(leaf, path)
  if isinstance(value, ShardedArray):
    whole = value._held_on_host()  # pylint: disable=protected-access
    if whole is not None:
      # One host tensor: another split is another placement of it, on the
      # host executor, or its blocks packed onto DTensor's devices.
      placement = placement_of(sharding, value.shape, path)
      if value.placement == placement:
        return value
      return ShardedArray.from_whole(whole, placement)
    global_value = value.dtensor_value
    placement = placement_of(sharding, global_value.shape, path)
    if value.placement == placement:
      return value
    with multiprocess_hooks.peer_failures():
      moved = placement_lib.relayout(global_value, placement)
  else:
    placement = placement_of(sharding, value.shape, path)
    if devices_lib.process_count() == 1:
      # The whole array is this process's part: held as its executor holds
      # arrays (one host tensor on the host executor).
      return ShardedArray.from_whole(value, placement)
    if isinstance(value, tf.Tensor):
      value = value.numpy()
    moved = placement_lib.pack_global_array(value, placement)
  return ShardedArray(moved, placement, placement.local_shape(moved.shape),
                      moved.dtype)


def _put_on_device(leaf, device, path):
  """`leaf` whole on `device`, as a tf.Tensor."""
  value = arguments.to_array_leaf(leaf, path)
  if isinstance(value, ShardedArray):
    if device in value.devices():
      # Gathered on the devices; the block of `device` is then the whole.
      whole = value._whole_on_devices()  # pylint: disable=protected-access
      position = value.placement.mesh.local_devices().index(device.name)
      value = placement_lib.components(whole)[position]
    else:
      value = value.numpy()
  with tf.device(device.name):
    return tf.identity(value)


def _copy(leaf):
  if isinstance(leaf, ShardedArray):
    return leaf.__copy__()
  with tf.device(leaf.device):
    return tf.identity(leaf)


def _stacked_placement(count, rank, devices):
  """How a pmap over `devices` takes an argument mapped along axis 0."""
  dim = mesh_lib.mesh_dim_name(0)
  return placement_lib.Placement(((dim,), (count,), tuple(devices)),
                                 (dim,) + (None,) * rank)


def _check_devices(devices, function):
  devices = list(devices)
  if not devices or not all(isinstance(d, devices_lib.Device)
                            for d in devices):
    raise TypeError(
        f"{function}: `devices` must be a non-empty sequence of tfspmd "
        f"devices (tfspmd.local_devices()), got {devices!r}.")
  if len(set(devices)) != len(devices):
    raise ValueError(f"{function}: a device appears more than once in "
                     f"`devices`: {devices}.")
  return devices


def device_put_sharded(shards: Sequence[Any],
                       devices: Sequence[devices_lib.Device]) -> Any:
  """Stacks `shards`, one per device, into `ShardedArray`s, like JAX did.

  The result is split along a new leading axis as a pmap over `devices`
  takes a mapped argument, so that pmap uses it with no copy.

  Args:
    shards: A sequence of pytrees of one structure, with arrays of one shape
      and dtype at each position; shard k goes to `devices[k]`.
    devices: The devices, as many as `shards`.

  Returns:
    A pytree of the shards' structure whose leaves are `ShardedArray`s of
    shape `(len(devices), *shard_shape)`.

  Raises:
    ValueError: If `shards` and `devices` differ in length, or the shards in
      structure, shape or dtype.

  Example:
    >>> import numpy as np, tfspmd
    >>> devices = tfspmd.local_devices()[:2]
    >>> x = tfspmd.device_put_sharded([np.zeros(3), np.ones(3)], devices)
    >>> x.shape, x.addressable_shards[1].device
    (TensorShape([2, 3]), Device(platform='cpu', id=1))
  """
  devices = _check_devices(devices, "device_put_sharded")
  shards = list(shards)
  if len(shards) != len(devices):
    raise ValueError(
        f"device_put_sharded: `shards` has {len(shards)} entries but "
        f"`devices` {len(devices)}; give one shard per device.")
  flat = [tree.flatten(shard) for shard in shards]
  treedef = flat[0][1]
  for k, (_, other) in enumerate(flat[1:], 1):
    if other != treedef:
      raise ValueError(
          f"device_put_sharded: shards[{k}] has the structure "
          f"{tree.describe(other)}, shards[0] {tree.describe(treedef)}; "
          f"every shard must have the same structure.")
  paths = tree.leaf_paths(shards[0], "shards[k]")
  stacked = [
      _pack_stack([arguments.to_array_leaf(leaves[position], path)
                   for leaves, _ in flat], devices, path)
      for position, path in enumerate(paths)]
  return treedef.unflatten(stacked)


def _pack_stack(blocks, devices, path):
  """`blocks`, one per device, as one ShardedArray split along a new axis."""
  tensors = [tf.convert_to_tensor(block.numpy() if isinstance(
      block, ShardedArray) else block) for block in blocks]
  first = tensors[0]
  for k, tensor in enumerate(tensors[1:], 1):
    if tensor.shape != first.shape or tensor.dtype != first.dtype:
      raise ValueError(
          f"device_put_sharded: {path.replace('[k]', f'[{k}]')} has shape "
          f"{tensor.shape.as_list()} and dtype {tensor.dtype.name}, "
          f"{path.replace('[k]', '[0]')} {first.shape.as_list()} and "
          f"{first.dtype.name}; the shards must agree to be stacked.")
  placement = _stacked_placement(len(devices), first.shape.rank, devices)
  value = dtensor_values.pack([tf.expand_dims(t, 0) for t in tensors],
                              placement.layout)
  return ShardedArray(value, placement, placement.local_shape(value.shape),
                      value.dtype)


def device_put_replicated(x: Any,
                          devices: Sequence[devices_lib.Device]) -> Any:
  """`x` on each of `devices`, stacked along a new leading axis, like JAX did.

  The result is what `device_put_sharded([x] * len(devices), devices)`
  gives: what a pmap over `devices` takes with no copy.

  Example:
    >>> import numpy as np, tfspmd
    >>> x = tfspmd.device_put_replicated(np.arange(2), tfspmd.devices()[:4])
    >>> x.shape
    TensorShape([4, 2])
  """
  devices = _check_devices(devices, "device_put_replicated")
  leaves, treedef = tree.flatten(x)
  paths = tree.leaf_paths(x, "x")
  return treedef.unflatten([
      _pack_stack([arguments.to_array_leaf(leaf, path)] * len(devices),
                  devices, path)
      for leaf, path in zip(leaves, paths)])


def _fetch(leaf):
  if isinstance(leaf, ShardedArray):
    return leaf.numpy()
  if isinstance(leaf, (tf.Tensor, tf.Variable)):
    return leaf.numpy()
  return leaf


def device_get(x: Any) -> Any:
  """`x` with each `ShardedArray`, tensor and variable as a NumPy array.

  Other leaves (Python numbers, NumPy arrays, strings) come back as they
  are, as in JAX.

  Example:
    >>> import tensorflow as tf, tfspmd
    >>> out = tfspmd.pmap(lambda v: v * 2)(tf.range(4))
    >>> tfspmd.device_get({'out': out, 'step': 3})
    {'out': array([0, 2, 4, 6], dtype=int32), 'step': 3}
  """
  leaves, treedef = tree.flatten(x)
  return treedef.unflatten([_fetch(leaf) for leaf in leaves])


def block_until_ready(x: Any) -> Any:
  """Waits until every array in `x` is computed; returns `x`.

  Example:
    >>> import tensorflow as tf, tfspmd
    >>> out = tfspmd.pmap(lambda v: v + 1)(tf.range(2))
    >>> tfspmd.block_until_ready((out, 1))[0] is out
    True
  """
  leaves = tree.flatten(x)[0]
  # A ShardedArray waits for its own program; a tensor has no wait of its
  # own, so for one the wait is for every program in flight.
  if any(isinstance(leaf, (tf.Tensor, tf.Variable)) for leaf in leaves):
    dtensor_device.wait_for_programs()
  for leaf in leaves:
    if isinstance(leaf, ShardedArray):
      leaf.block_until_ready()
  return x
