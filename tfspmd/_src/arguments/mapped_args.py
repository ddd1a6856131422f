"""The arguments of a call to a mapped function (pmap or vmap).

Splits off static arguments, resolves in_axes over the leaves, finds the
mapped size, and rebuilds the per-position arguments inside the trace. The
messages name the transformation ("pmap", "vmap") and the pytree path of
the argument at fault.
"""

import functools

from tfspmd._src.arguments import arguments
from tfspmd._src.core import function_keys
from tfspmd._src.core import lru
from tfspmd._src.trees import tree


class MappedArguments:
  """How one mapped function binds its call's arguments.

  Args:
    transform: "pmap" or "vmap", for messages.
    in_axes: The in_axes spec (an int, None, or a tree prefix).
    static_argnums: Positions of static arguments (already checked).
    axis_size: The axis size given by the user, or None.
  """

  def __init__(self, transform, in_axes, static_argnums, axis_size):
    if isinstance(in_axes, list):
      in_axes = tuple(in_axes)
    arguments.check_axis_spec_tree(in_axes, "in_axes")
    if axis_size is not None and (isinstance(axis_size, bool) or
                                  not isinstance(axis_size, int) or
                                  axis_size < 1):
      raise ValueError(
          f"{transform}: `axis_size` must be a positive int or None, got "
          f"{axis_size!r}.")
    self.transform = transform
    self.in_axes = in_axes
    self.static_argnums = static_argnums
    self.axis_size = axis_size
    self._leaf_axes = lru.LRUCache(lru.TRACE_CACHE_SIZE)

  def bind(self, args, kwargs):
    """Splits one call's arguments into a `BoundCall` (checks them too)."""
    return BoundCall(self, args, kwargs)

  def static_positions(self, count):
    if not self.static_argnums:
      return frozenset()
    positions = set()
    for num in self.static_argnums:
      position = num + count if num < 0 else num
      if not 0 <= position < count:
        raise ValueError(
            f"{self.transform}ped function has static_broadcasted_argnums="
            f"{self.static_argnums}, but was called with only {count} "
            f"positional argument(s). Pass every static argument "
            f"positionally.")
      positions.add(position)
    return frozenset(positions)

  def statics(self, args, static_positions):
    found = []
    for position in sorted(static_positions):
      value = args[position]
      try:
        hash(value)
      except TypeError as e:
        raise ValueError(
            f"static argument args[{position}] of the {self.transform}ped "
            f"function is not hashable: {type(value).__name__} {value!r} "
            f"({e}). Static arguments must be hashable (a tuple instead of a "
            f"list, for example) because each value gets its own trace."
        ) from None
      found.append((position, value))
    return tuple(found)

  def leaf_in_axes(self, treedef, args, static_positions, dynamic):
    """The in axis of each leaf (keyword arguments: 0), cached per tree."""
    cache_key = (treedef, len(args), static_positions)
    cached = self._leaf_axes.get(cache_key)
    if cached is not None:
      return cached
    in_axes = self.in_axes
    if isinstance(in_axes, tuple):
      if len(in_axes) != len(args):
        raise ValueError(
            f"{self.transform} in_axes has {len(in_axes)} entries, but the "
            f"function was called with {len(args)} positional argument(s); "
            f"give one entry per positional argument (static ones included), "
            f"or a single int or None for all of them. in_axes={in_axes!r}.")
      in_axes = tuple(a for i, a in enumerate(in_axes)
                      if i not in static_positions)
    specs = tree.broadcast_prefix(in_axes, dynamic, spec_name="in_axes",
                                  root="args",
                                  is_spec_leaf=arguments.is_axis_spec)
    specs += [0] * (treedef.num_leaves - len(specs))
    self._leaf_axes.put(cache_key, specs)
    return specs

  def axes_and_size(self, in_axes, shapes, paths, part=False):
    """Each leaf's mapped axis (non-negative, or None) and the mapped size.

    Args:
      in_axes: Each leaf's axis as the call gives it (negative from the end).
      shapes: Each leaf's shape.
      paths: Each leaf's pytree path, for messages.
      part: Whether the leaves may hold this process's part of the mapped
        axis (a nested pmap's, with several processes), whose global size
        `axis_size` is then: the mapped size need only divide it.

    Raises:
      ValueError: If an axis is out of range, the mapped leaves disagree on
        the size, or there is no size to take.
    """
    axes = [None if axis is None else arguments.normalize_axis(
        axis, len(shape), spec_name="in_axes", path=path)
            for axis, shape, path in zip(in_axes, shapes, paths)]
    return axes, self._mapped_size(axes, shapes, paths, part)

  def _mapped_size(self, axes, shapes, paths, part):
    """The size of the mapped axis, checked across the mapped leaves."""
    sizes = [(path, shape, axis, shape[axis])
             for path, shape, axis in zip(paths, shapes, axes)
             if axis is not None]
    distinct = {size for *_, size in sizes}
    if len(distinct) > 1:
      lines = "\n".join(
          f"  {path} of shape {tuple(shape)} mapped along axis {axis} has "
          f"size {size}" for path, shape, axis, size in sizes)
      raise ValueError(
          f"{self.transform} got inconsistent sizes for array axes to be "
          f"mapped:\n{lines}")
    if not distinct:
      if self.axis_size is None:
        raise ValueError(
            f"{self.transform} has no mapped argument to take the axis size "
            f"from (every in_axes is None, or there are no array arguments); "
            f"pass axis_size= to {self.transform}.")
      return self.axis_size
    size = distinct.pop()
    if part and size and self.axis_size is not None:
      if self.axis_size % size:
        raise ValueError(
            f"{self.transform} was given axis_size={self.axis_size}, but its "
            f"mapped arguments have size {size} along the mapped axis. With "
            f"several processes a nested pmap's axis_size is the global size "
            f"of its axis, and each process passes the positions of it that "
            f"its devices hold: a divisor of axis_size (docs/multiprocess.md)."
        )
    elif self.axis_size is not None and self.axis_size != size:
      raise ValueError(
          f"{self.transform} was given axis_size={self.axis_size}, but its "
          f"mapped arguments have size {size} along the mapped axis.")
    if size == 0:
      path, shape, axis, _ = sizes[0]
      raise ValueError(
          f"{self.transform} maps axis {axis} of {path}, of shape "
          f"{tuple(shape)}, which has size 0; a {self.transform} needs at "
          f"least one position along the mapped axis (size >= 1).")
    return size


class BoundCall:
  """One call's arguments: static ones split off, the rest flattened.

  Attributes:
    args: The positional arguments as given.
    kwargs: The keyword arguments as given.
    static_positions: Positions in `args` of static arguments.
    statics: `(position, value)` of each static argument.
    static_key: The statics as a cache key: `(position, typed value)`, so
      `1`, `1.0` and `True` (equal, with one hash) trace apart, as in JAX
      (`function_keys.static_value_key`).
    dynamic: The positional arguments that are not static.
    leaves: The leaves of `(dynamic, kwargs)`.
    treedef: Their tree structure.
    in_axes: The in axis of each leaf.
  """

  def __init__(self, binding, args, kwargs):
    self.args = args
    self.kwargs = kwargs
    self.static_positions = binding.static_positions(len(args))
    self.statics = binding.statics(args, self.static_positions)
    self.static_key = tuple(
        (position, function_keys.static_value_key(value))
        for position, value in self.statics)
    self.dynamic = tuple(args) if not self.statics else tuple(
        a for i, a in enumerate(args) if i not in self.static_positions)
    self.leaves, self.treedef = tree.flatten((self.dynamic, kwargs))
    self.in_axes = binding.leaf_in_axes(self.treedef, args,
                                        self.static_positions, self.dynamic)

  @functools.cached_property
  def paths(self):
    """The pytree path of each leaf, for messages (made on first use)."""
    found = []
    for i, arg in enumerate(self.args):
      if i not in self.static_positions:
        found += tree.leaf_paths(arg, f"args[{i}]")
    for key in sorted(self.kwargs):
      found += tree.leaf_paths(self.kwargs[key], f"kwargs[{key!r}]")
    return found

  def rebuilder(self):
    """`rebuild(per_position_leaves) -> (args, kwargs)` for this call."""
    treedef, statics = self.treedef, self.statics

    def rebuild(per_position):
      dynamic_values, kw = treedef.unflatten(per_position)
      full = list(dynamic_values)
      for position, value in statics:
        full.insert(position, value)
      return tuple(full), kw

    return rebuild
