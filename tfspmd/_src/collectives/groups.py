"""axis_index_groups: a collective within groups of an axis's positions.

The positions of the named axes (their linear index, the first name major)
are split into groups of one size, and the collective runs in each group on
its own, as if the group were the whole axis: member k of a group is the
k-th index listed in it, as in JAX. The lowering rearranges the stacked
value into [group size, groups, ...] by a gather with constant indices, runs
the collective's own step with the groups as one more leading batch dim,
and gathers each position's result back. No fast path applies (the step
sees an axis that is no mesh dimension), so DTensor may gather the whole
stacked value to every device.
"""

from __future__ import annotations

import dataclasses
import operator

import numpy as np
import tensorflow as tf

from tfspmd._src.collectives import checks
from tfspmd._src.core import stacking
from tfspmd._src.runtime import axis_env


@dataclasses.dataclass(frozen=True)
class Groups:
  """A partition of the linear index over the named axes into equal groups.

  Attributes:
    members: One tuple of indices per group, in the order listed.
  """
  members: tuple

  @property
  def size(self) -> int:
    """The number of positions in each group."""
    return len(self.members[0])

  def within(self, step):
    """`step` (see `marker.over_axes`), run in each group on its own.

    The step returned acts on the value stacked over all the positions.
    """
    order = np.array([i for group in self.members for i in group], np.int32)
    inverse = np.argsort(order).astype(np.int32)
    group_of = (inverse // self.size).astype(np.int32)
    rank = (inverse % self.size).astype(np.int32)
    count, size = len(self.members), self.size

    def grouped_step(tensor, stacked, frame, batch_dims):
      inner = axis_env.Frame(frame.name, size, None)
      if not stacked:
        # Every group holds the same value, so every group's result is the
        # one step's result; a varying one is picked by each member's rank.
        result, out_stacked = step(tensor, False, inner, batch_dims)
        return (tf.gather(result, rank) if out_stacked else result,
                out_stacked)
      shape = stacking.sizes(tensor)
      arranged = tf.reshape(tf.gather(tensor, order),
                            [count, size] + shape[1:])
      result, out_stacked = step(stacking.move_axis(arranged, 1, 0), True,
                                 inner, batch_dims + 1)
      if not out_stacked:
        # [groups, ...]: one result per group, for each of its members.
        return tf.gather(result, group_of), True
      by_group = stacking.move_axis(result, 0, 1)
      merged = tf.reshape(by_group,
                          [count * size] + stacking.sizes(by_group)[2:])
      return tf.gather(merged, inverse), True

    return grouped_step


def resolve(axis_index_groups, targets, function):
  """Checks `axis_index_groups` for the named `targets`.

  Args:
    axis_index_groups: The user's argument: None, or a sequence of sequences
      of ints that partition the linear index over `targets` into groups of
      one size.
    targets: The named `Frame`s.
    function: The collective's name, for error messages.

  Returns:
    A `Groups`, or None for None.

  Raises:
    TypeError: If it is not a sequence of sequences of ints.
    ValueError: If it is not a partition of the axis into equal groups.
  """
  if axis_index_groups is None:
    return None
  members = _as_members(axis_index_groups, function)
  size = checks.total_size(targets)
  names = tuple(t.name for t in targets)
  axes = (f"axis {names[0]!r} of size {size}" if len(names) == 1 else
          f"axes {names!r} of size {size} (their linear index, the first "
          f"name major)")
  flat = [i for group in members for i in group]
  outside = [i for i in flat if not 0 <= i < size]
  if outside:
    raise ValueError(
        f"{function}: axis_index_groups has index {outside[0]}, out of range "
        f"for the {axes}; indices must be in [0, {size}).")
  if sorted(flat) != list(range(size)):
    raise ValueError(
        f"{function}: axis_index_groups must cover all indices exactly once: "
        f"every index of the {axes} in exactly one group, but got "
        f"{[list(g) for g in members]}.")
  sizes = sorted({len(group) for group in members})
  if len(sizes) > 1:
    raise ValueError(
        f"{function}: axis_index_groups must all be the same size, but got "
        f"groups of sizes {sizes} ({[list(g) for g in members]}); split the "
        f"axis into groups of one size (JAX refuses others on TPU, and its "
        f"pmean divides by the first group's size).")
  return Groups(members)


def size(targets, groups):
  """The number of positions a collective over `targets` reduces over."""
  return checks.total_size(targets) if groups is None else groups.size


def within(step, groups):
  """`step`, or with `groups`, `step` run in each group on its own."""
  return step if groups is None else groups.within(step)


def _as_members(axis_index_groups, function):
  """The groups as a tuple of tuples of Python ints, or a TypeError."""
  wrong = TypeError(
      f"{function}: axis_index_groups must be a list of lists of ints (the "
      f"axis indices of each group, such as [[0, 1], [2, 3]]), got "
      f"{axis_index_groups!r}.")
  if isinstance(axis_index_groups, (str, bytes)):
    raise wrong
  try:
    groups = [list(group) for group in axis_index_groups]
  except TypeError:
    raise wrong from None
  if not groups or not all(groups):
    raise ValueError(
        f"{function}: axis_index_groups must hold at least one group, each of "
        f"at least one index, got {axis_index_groups!r}.")
  members = []
  for group in groups:
    if any(isinstance(i, (bool, np.bool_, str, bytes)) for i in group):
      raise wrong
    try:
      members.append(tuple(operator.index(i) for i in group))
    except TypeError:
      raise wrong from None
  return tuple(members)
