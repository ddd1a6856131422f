"""`lax.with_sharding_constraint`: lay a value out as a sharding says.

Inside a `tfspmd.jit` function the value is a DTensor of the function's
mesh, and the constraint is DTensor's relayout to the layout the spec
gives (JAX's constraint steers its sharding propagation the same way: the
value lies as asked there). Outside, on arrays, it is `device_put`.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tfspmd._src.arguments import transfers
from tfspmd._src.programs import jit as jit_lib
from tfspmd._src.runtime import axis_env
from tfspmd._src.runtime.named_mesh import PartitionSpec
from tfspmd._src.runtime.named_sharding import NamedSharding
from tfspmd._src.trees import tree


def _is_sharding_leaf(value):
  """Ends the walk of `shardings`: a sharding, or anything not a container."""
  return isinstance(value, (NamedSharding, PartitionSpec)) or (
      tree.flatten(value)[0] == [value])


def with_sharding_constraint(x: Any, shardings: Any) -> Any:
  """Lays each leaf of `x` out as `shardings` says, as `jax.lax`'s.

  Args:
    x: A pytree of arrays.
    shardings: A `NamedSharding` or `PartitionSpec` per leaf, or a tree
      prefix of them. A bare `PartitionSpec` is over the mesh of the
      `tfspmd.jit` function being traced (outside one, the mesh
      `tfspmd.set_mesh` set).

  Returns:
    `x`, each leaf laid out as asked: inside a `tfspmd.jit` function on its
    mesh, the value it returns keeps that layout (but for a float32, int32
    or int64 result of under 20 elements, which the function returns whole
    on each device; give `out_shardings` to place it); outside, a
    `ShardedArray` (as `device_put` gives).

  Raises:
    TypeError: If a sharding is neither a `NamedSharding` nor a
      `PartitionSpec`, or a `PartitionSpec` has no mesh to be over.
    ValueError: Inside a pmap or shard_map (whose values are per device)
      or a `tf.function` that is not a `tfspmd.jit` function, for a
      `NamedSharding` of another mesh than the jitted function's, or a spec
      that splits one dimension over several mesh axes inside one.

  Example:
    >>> import numpy as np, tensorflow as tf, tfspmd
    >>> from tfspmd import P, lax
    >>> mesh = tfspmd.make_mesh((4, 2), ('x', 'y'))
    >>> @tfspmd.jit
    ... def double(v):
    ...   return lax.with_sharding_constraint(v * 2, P('x', 'y'))
    >>> with tfspmd.set_mesh(mesh):
    ...   out = double(np.ones((8, 4), np.float32))
    >>> out.sharding.spec
    PartitionSpec('x', 'y')
  """
  if axis_env.trace_state() is not None or axis_env.frames():
    raise ValueError(
        "with_sharding_constraint: called inside a pmap or shard_map, whose "
        "values are each device's own; constrain the value outside the "
        "mapped function (in the tfspmd.jit function around it).")
  mesh = jit_lib.tracing_mesh()
  if mesh is None and tf.inside_function():
    raise ValueError(
        "with_sharding_constraint: called in a tf.function that is not a "
        "tfspmd.jit function, whose values lie on no mesh; decorate the "
        "function with tfspmd.jit, or constrain arrays outside it.")
  targets = tree.broadcast_prefix(
      shardings, x, spec_name="shardings", root="x",
      is_spec_leaf=_is_sharding_leaf)
  leaves, treedef = tree.flatten(x)
  paths = tree.leaf_paths(x, "x")
  if mesh is None:
    return transfers.device_put(x, treedef.unflatten(targets))
  return treedef.unflatten([
      transfers.laid_out_in_jit(leaf, target, mesh, path,
                                "with_sharding_constraint")
      for leaf, target, path in zip(leaves, targets, paths)])
