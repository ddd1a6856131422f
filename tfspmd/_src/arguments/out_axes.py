"""Where each output of a mapped function puts the mapped axis.

pmap, vmap, `pmap(steps=K)` and debug mode all read `out_axes` the same way:
a tree prefix of the output, each leaf an int (negative counts from the end
of the mapped result) or None (the output is the same on every device).
"""

from tfspmd._src.arguments import arguments
from tfspmd._src.trees import tree


def resolve(out_axes, output, per_device_ranks):
  """The position of the mapped axis in each leaf of `output`.

  Args:
    out_axes: The user's out_axes, a tree prefix of `output`.
    output: The output tree (its leaves only give the structure).
    per_device_ranks: The rank of each output leaf on one device, in
      `tree.flatten` order; None where TensorFlow does not know it.

  Returns:
    One entry per leaf: the non-negative axis of the mapped result, or None.

  Raises:
    ValueError: If `out_axes` does not fit the output, a rank is unknown, or
      an axis is out of range for the mapped result.
  """
  specs = tree.broadcast_prefix(out_axes, output, spec_name="out_axes",
                                root="output",
                                is_spec_leaf=arguments.is_axis_spec)
  paths = tree.leaf_paths(output, "output")
  return [_resolved_axis(spec, rank, path)
          for spec, rank, path in zip(specs, per_device_ranks, paths)]


def _resolved_axis(spec, per_device_rank, path):
  if per_device_rank is None:
    raise ValueError(
        f"the mapped function returned {path} of unknown rank (from an op "
        f"TensorFlow cannot infer shapes of, such as tf.py_function); a "
        f"mapped function's outputs need static shapes: give it one with "
        f"tf.ensure_shape(value, shape).")
  if spec is None:
    return None
  rank = per_device_rank + 1
  if not -rank <= spec < rank:
    raise ValueError(
        f"out_axes puts the mapped axis at {spec} of {path}, whose result has "
        f"rank {rank} (per-device rank {per_device_rank}, plus the mapped "
        f"axis): the axis must be in [{-rank}, {rank}).")
  return spec % rank


def varying_output_error(path, axis_name):
  """pmap's error for an out_axes=None output `path` that varies."""
  return ValueError(
      f"out_axes=None for {path}, but that output varies across the devices "
      f"of axis {axis_name!r}: out_axes=None returns one value, so the output "
      f"must be the same on every device (for example the result of "
      f"psum/pmean over that axis). Give it an integer out_axes to keep every "
      f"device's value.")
