"""Host values exchanged between processes: JAX's `multihost_utils`.

Each process's values are its part of a global array split over a mesh of
the processes (`make_array_from_process_local_data`); an `all_gather` over
that mesh's process axis gives every process all of them. So gathering and
broadcasting are collectives between the devices, as in JAX, with no
channel of their own; with one process they are the identity (a leading
axis of 1 for `process_allgather`).
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any

import numpy as np

from tfspmd._src.arguments import global_arrays
from tfspmd._src.arguments import transfers
from tfspmd._src.collectives import gather
from tfspmd._src.programs import shard_map as shard_map_lib
from tfspmd._src.runtime import devices as devices_lib
from tfspmd._src.runtime.named_mesh import Mesh
from tfspmd._src.runtime.named_mesh import PartitionSpec
from tfspmd._src.runtime.named_sharding import NamedSharding
from tfspmd._src.runtime.sharded_array import ShardedArray
from tfspmd._src.trees import tree

_PROCESSES = "processes"
# The smallest buffer exchanged, in 4-byte words.
_MIN_WORDS = 256


@functools.lru_cache(maxsize=4)
def _process_mesh(devices):
  """A mesh of `devices` whose first axis runs over the processes."""
  count = devices_lib.process_count()
  return Mesh(np.array(devices, dtype=object).reshape(count, -1),
              (_PROCESSES, "devices"))


def _gather_processes(block):
  return gather.all_gather(block, _PROCESSES, tiled=True)


def _all_processes(values):
  """`values` (this process's NumPy arrays) of every process, each stacked.

  They cross as one buffer of their bytes, padded to a power of two of
  words: one collective for them all, traced for few sizes.
  """
  raw = b"".join(np.ascontiguousarray(value).tobytes() for value in values)
  words = max(_MIN_WORDS, 1 << max(0, -(-len(raw) // 4) - 1).bit_length())
  buffer = np.zeros(words, np.int32)
  buffer.view(np.uint8)[:len(raw)] = np.frombuffer(raw, np.uint8)
  mesh = _process_mesh(devices_lib.devices())
  stacked = global_arrays.make_array_from_process_local_data(
      NamedSharding(mesh, PartitionSpec(_PROCESSES)), buffer[None])
  gathered = np.asarray(shard_map_lib.shard_map(
      _gather_processes, mesh=mesh, in_specs=PartitionSpec(_PROCESSES),
      out_specs=PartitionSpec())(stacked))
  results, offset = [], 0
  every = gathered.view(np.uint8).reshape(len(gathered), -1)
  for value in values:
    size = value.nbytes
    results.append(np.stack([
        np.frombuffer(row[offset:offset + size].tobytes(),
                      value.dtype).reshape(value.shape) for row in every]))
    offset += size
  return results


def _spans_processes(leaf):
  return isinstance(leaf, ShardedArray) and len(
      {device.process_index for device in leaf.placement.devices}) > 1


def _host_value(leaf, path, function):
  value = transfers.device_get(leaf)
  array = np.asarray(value)
  if array.dtype.kind not in "biufc":
    raise TypeError(f"{function}: {path} is {type(leaf).__name__} of dtype "
                    f"{array.dtype}; give arrays of numbers or bools.")
  return array


def process_allgather(in_tree: Any, tiled: bool = False) -> Any:
  """Every process's values of `in_tree`, on every process, as NumPy arrays.

  Args:
    in_tree: A pytree of this process's arrays (NumPy, tensors, Python
      numbers, `ShardedArray`s on this process's devices), the same
      structure, shapes and dtypes in every process. A `ShardedArray` on
      the devices of several processes is a global array already: it gives
      its whole value.
    tiled: If False, each leaf gets a new leading axis of one entry per
      process, in process order; if True, the processes' values are
      concatenated along their first axis.

  Returns:
    `in_tree` with NumPy arrays. With one process, `x[None]` (`x` when
    tiled).

  Raises:
    ValueError: If `tiled` and a leaf is a scalar.

  Example:
    >>> import numpy as np
    >>> from tfspmd.experimental import multihost_utils
    >>> multihost_utils.process_allgather(np.arange(3))
    array([[0, 1, 2]])
  """
  function = "process_allgather"
  if not isinstance(tiled, bool):
    raise TypeError(f"{function}: `tiled` must be a bool, got {tiled!r}.")
  leaves, treedef = tree.flatten(in_tree)
  paths = tree.leaf_paths(in_tree, "in_tree")
  results, local = [None] * len(leaves), {}
  for position, (leaf, path) in enumerate(zip(leaves, paths)):
    if _spans_processes(leaf):
      results[position] = np.asarray(transfers.device_put(
          leaf, NamedSharding(leaf.sharding.mesh, PartitionSpec())))
      continue
    value = _host_value(leaf, path, function)
    if tiled and value.ndim == 0:
      raise ValueError(
          f"{function}: {path} is a scalar, which tiled=True cannot "
          f"concatenate along its first axis; pass tiled=False to stack "
          f"the processes' values.")
    local[position] = value
  for position, gathered in zip(local, _all_processes(list(local.values()))):
    results[position] = (gathered.reshape((-1,) + gathered.shape[2:])
                         if tiled else gathered)
  return treedef.unflatten(results)


def broadcast_one_to_all(in_tree: Any, is_source: bool | None = None) -> Any:
  """The source process's values of `in_tree`, on every process.

  Args:
    in_tree: A pytree of arrays, the same structure, shapes and dtypes in
      every process.
    is_source: Whether this process is the source (default: process 0).
      Where several processes are, their values are summed (any for bools),
      as JAX's psum of the sources' values gives.

  Returns:
    `in_tree` with NumPy arrays of the sources' values.

  Example:
    >>> import numpy as np
    >>> from tfspmd.experimental import multihost_utils
    >>> multihost_utils.broadcast_one_to_all({'step': np.int32(7)})
    {'step': array(7, dtype=int32)}
  """
  function = "broadcast_one_to_all"
  if is_source is None:
    is_source = devices_lib.process_index() == 0
  if not isinstance(is_source, (bool, np.bool_)):
    raise TypeError(f"{function}: `is_source` must be a bool or None, got "
                    f"{is_source!r}.")
  leaves, treedef = tree.flatten(in_tree)
  paths = tree.leaf_paths(in_tree, "in_tree")
  values = [_host_value(leaf, path, function)
            for leaf, path in zip(leaves, paths)]
  flags, *gathered = _all_processes([np.bool_(is_source)] + values)
  if not flags.any():
    raise ValueError(f"{function}: no process has is_source=True; one "
                     f"process must be the source.")
  return treedef.unflatten([
      np.asarray(every[flags].any(axis=0) if every.dtype == bool else
                 every[flags].sum(axis=0, dtype=every.dtype))
      for every in gathered])


def sync_global_devices(name: str) -> None:
  """Waits until every process called it with `name`: a barrier.

  Raises:
    ValueError: If the processes gave different names (they reached
      different barriers).

  Example:
    >>> from tfspmd.experimental import multihost_utils
    >>> multihost_utils.sync_global_devices('checkpoint saved')
  """
  if not isinstance(name, str):
    raise TypeError(f"sync_global_devices: `name` must be a str, got "
                    f"{name!r}.")
  digest = np.frombuffer(hashlib.sha256(name.encode()).digest()[:8],
                         dtype=np.int64)
  every = process_allgather(digest)
  if not (every == every[0]).all():
    differing = [k for k in range(len(every))
                 if not (every[k] == digest).all()]
    raise ValueError(
        f"sync_global_devices({name!r}): processes {differing} reached a "
        f"barrier of another name; every process must call the barriers in "
        f"one order.")


def _each_leaf_placed(inputs, global_mesh, pspecs, function, place):
  """`place(leaf, sharding)` for each leaf of `inputs`, by its spec.

  Args:
    inputs: A pytree of arrays.
    global_mesh: The `Mesh` the shardings lie on.
    pspecs: A `PartitionSpec` (or None: whole on each device) per leaf, or
      a tree prefix of them.
    function: The caller's name, for a message.
    place: Makes a leaf's array for its `NamedSharding`.
  """
  if not isinstance(global_mesh, Mesh):
    raise TypeError(f"{function}: `global_mesh` must be a tfspmd.Mesh, got "
                    f"{type(global_mesh).__name__}.")
  leaves, treedef = tree.flatten(inputs)
  specs = tree.broadcast_prefix(
      pspecs, inputs, spec_name="pspecs", root="inputs",
      is_spec_leaf=lambda spec: spec is None or isinstance(
          spec, PartitionSpec))
  return treedef.unflatten([
      place(leaf, NamedSharding(global_mesh, spec or PartitionSpec()))
      for leaf, spec in zip(leaves, specs)])


def host_local_array_to_global_array(local_inputs: Any, global_mesh: Mesh,
                                     pspecs: Any) -> Any:
  """Each process's parts of `local_inputs` as global arrays on the mesh.

  Args:
    local_inputs: A pytree of this process's parts (see
      `make_array_from_process_local_data`).
    global_mesh: The mesh over every process's devices.
    pspecs: A `PartitionSpec` per leaf, or a tree prefix of them.

  Returns:
    A pytree of `ShardedArray`s, each the global array of the parts.

  Example:
    >>> import numpy as np, tfspmd
    >>> from tfspmd.experimental import multihost_utils
    >>> mesh = tfspmd.make_mesh((8,), ('i',))
    >>> x = multihost_utils.host_local_array_to_global_array(
    ...     np.arange(8.), mesh, tfspmd.P('i'))
    >>> x.sharding.spec
    PartitionSpec('i')
  """
  return _each_leaf_placed(
      local_inputs, global_mesh, pspecs, "host_local_array_to_global_array",
      lambda leaf, sharding: global_arrays.make_array_from_process_local_data(
          sharding, leaf))


def global_array_to_host_local_array(global_inputs: Any, global_mesh: Mesh,
                                     pspecs: Any) -> Any:
  """Each global array of `global_inputs` as this process's part of it.

  A `ShardedArray`'s shape, NumPy value and shards are this process's part
  already (`tfspmd.ShardedArray`); each leaf is laid out as its spec says.

  Example:
    >>> import numpy as np, tfspmd
    >>> from tfspmd.experimental import multihost_utils
    >>> mesh = tfspmd.make_mesh((8,), ('i',))
    >>> x = multihost_utils.global_array_to_host_local_array(
    ...     np.arange(8.), mesh, tfspmd.P('i'))
    >>> x.shape
    TensorShape([8])
  """
  return _each_leaf_placed(global_inputs, global_mesh, pspecs,
                           "global_array_to_host_local_array",
                           transfers.device_put)
