"""Argument checks shared by every collective, so each message is right."""

import tensorflow as tf

from tfspmd._src import tree


def leafwise(function, x):
  """Applies `function` to each leaf of the pytree `x`, as a tensor."""
  leaves, treedef = tree.flatten(x)
  return treedef.unflatten([function(tf.convert_to_tensor(leaf))
                            for leaf in leaves])


def normalize_axis(axis, rank, *, argument, function):
  """Resolves a possibly negative axis of a per-device value of `rank`."""
  if isinstance(axis, bool) or not isinstance(axis, int):
    raise TypeError(
        f"{function}: `{argument}` must be an int, got {type(axis).__name__} "
        f"{axis!r}.")
  if not -rank <= axis < rank:
    raise ValueError(
        f"{function}: `{argument}`={axis} is out of range for a per-device "
        f"value of rank {rank}; it must be in [{-rank}, {rank}).")
  return axis % rank


def total_size(frames):
  """The size of the linear axis over `frames`."""
  size = 1
  for frame in frames:
    size *= frame.size
  return size


def check_divisible(extent, size, *, argument, function, tiled):
  if tiled:
    if extent % size:
      raise ValueError(
          f"{function}: with tiled=True the dimension `{argument}` "
          f"(size {extent}) must divide evenly by the axis size {size}.")
  elif extent != size:
    raise ValueError(
        f"{function}: the dimension `{argument}` has size {extent}, but must "
        f"equal the axis size {size} (or pass tiled=True to split it in "
        f"{size} blocks).")
