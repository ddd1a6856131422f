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
import json
from typing import Any

import numpy as np
import tensorflow as tf

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


def _exchanged(raw):
  """`raw` (bytes, as long in every process) of every process, in order.

  They cross padded to a power of two of words, so that the collective is
  traced for few sizes.
  """
  words = max(_MIN_WORDS, 1 << max(0, -(-len(raw) // 4) - 1).bit_length())
  buffer = np.zeros(words, np.int32)
  buffer.view(np.uint8)[:len(raw)] = np.frombuffer(raw, np.uint8)
  mesh = _process_mesh(devices_lib.devices())
  stacked = global_arrays.make_array_from_process_local_data(
      NamedSharding(mesh, PartitionSpec(_PROCESSES)), buffer[None])
  gathered = np.asarray(shard_map_lib.shard_map(
      _gather_processes, mesh=mesh, in_specs=PartitionSpec(_PROCESSES),
      out_specs=PartitionSpec())(stacked))
  return [row[:len(raw)].tobytes()
          for row in gathered.view(np.uint8).reshape(len(gathered), -1)]


def _all_processes(values):
  """`values` (this process's NumPy arrays) of every process, each stacked.

  They cross as one buffer of their bytes: one collective for them all.
  The processes have checked that they pass the same shapes and dtypes
  (`_check_same_leaves`), so every buffer is as long.
  """
  every = _exchanged(b"".join(np.ascontiguousarray(value).tobytes()
                              for value in values))
  results, offset = [], 0
  for value in values:
    size = value.nbytes
    results.append(np.stack([
        np.frombuffer(row[offset:offset + size], value.dtype).reshape(
            value.shape) for row in every]))
    offset += size
  return results


def _host_arrays(leaves):
  """Each leaf as a NumPy array, None for an array over several processes."""
  return [None if _spans_processes(leaf) else
          np.asarray(transfers.device_get(leaf)) for leaf in leaves]


def _describe(leaf, array):
  """`[shape, dtype]` of a leaf as exchanged, for the processes to compare.

  A `ShardedArray` over several processes' devices (`array` None) is
  described by its dtype alone: its shape is this process's part.
  """
  if array is None:
    return [None, f"{leaf.dtype.name} (an array over several processes)"]
  return [list(array.shape), str(array.dtype)]


def _check_same_leaves(function, treedef, leaves, arrays, paths):
  """Raises in every process if the processes pass other trees or leaves.

  Their values cross as raw bytes, so a leaf of another shape or dtype in
  one process would reach the others cut, padded or reinterpreted. Each
  process first exchanges a digest of its tree and its leaves' shapes and
  dtypes (one small collective); only where they differ do the
  descriptions themselves cross, for the message.
  """
  if devices_lib.process_count() == 1:
    return
  mine = {"tree": str(treedef),
          "leaves": [[path, *_describe(leaf, array)]
                     for leaf, array, path in zip(leaves, arrays, paths)]}
  text = json.dumps(mine).encode()
  digest = np.frombuffer(hashlib.sha256(text).digest()[:8], np.int64)
  heads = [np.frombuffer(row, np.int64) for row in _exchanged(
      np.array([digest[0], len(text)], np.int64).tobytes())]
  if all(head[0] == digest[0] for head in heads):
    return
  longest = max(int(head[1]) for head in heads)
  theirs = [json.loads(row[:int(head[1])]) for row, head in zip(
      _exchanged(text.ljust(longest)), heads)]
  me = devices_lib.process_index()
  other = next(k for k, description in enumerate(theirs)
               if description != mine)
  advice = (f"every process must pass {function} the same tree structure, "
            f"and leaves of the same shapes and dtypes")
  if theirs[other]["tree"] != mine["tree"] or len(
      theirs[other]["leaves"]) != len(mine["leaves"]):
    raise ValueError(
        f"{function}: process {other} passes a tree of structure "
        f"{theirs[other]['tree']}, where process {me} passes "
        f"{mine['tree']}; {advice}.")
  for (path, shape, dtype), (_, their_shape, their_dtype) in zip(
      mine["leaves"], theirs[other]["leaves"]):
    if (shape, dtype) != (their_shape, their_dtype):
      raise ValueError(
          f"{function}: process {other} passes {path} of shape "
          f"{_shape(their_shape)} and dtype {their_dtype}, where process "
          f"{me} passes shape {_shape(shape)} and dtype {dtype}; {advice} "
          f"(pad to one shape, cast to one dtype).")


def _shape(shape):
  return "(its part)" if shape is None else str(tuple(shape))


def _spans_processes(leaf):
  return isinstance(leaf, ShardedArray) and len(
      {device.process_index for device in leaf.placement.devices}) > 1


def _is_numeric(dtype):
  """Whether `dtype` is of numbers or bools (bfloat16 and ml_dtypes' too)."""
  if dtype.kind in "biufc":
    return True
  try:
    return tf.as_dtype(dtype).is_numeric
  except TypeError:
    return False


def _checked(array, leaf, path, function):
  """`array`, the host value of `leaf`, if of numbers or bools."""
  if not _is_numeric(array.dtype):
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
    ValueError: If `tiled` and a leaf is a scalar, or, in every process, if
      the processes pass other tree structures, shapes or dtypes (the
      message names the process and the leaf).

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
  arrays = _host_arrays(leaves)
  _check_same_leaves(function, treedef, leaves, arrays, paths)
  results, local = [None] * len(leaves), {}
  for position, (leaf, array, path) in enumerate(zip(leaves, arrays, paths)):
    if array is None:
      results[position] = np.asarray(transfers.device_put(
          leaf, NamedSharding(leaf.sharding.mesh, PartitionSpec())))
      continue
    value = _checked(array, leaf, path, function)
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

  Raises:
    ValueError: In every process, if the processes pass other tree
      structures, shapes or dtypes (the message names the process and the
      leaf), or if no process is the source.

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
  arrays = [np.asarray(transfers.device_get(leaf)) for leaf in leaves]
  _check_same_leaves(function, treedef, leaves, arrays, paths)
  values = [_checked(array, leaf, path, function)
            for array, leaf, path in zip(arrays, leaves, paths)]
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
