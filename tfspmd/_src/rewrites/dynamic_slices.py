"""Slices at offsets that differ between devices, as `lax.dynamic_slice`.

pfor maps `tf.slice` and a strided slice only where the offsets are the
same on every position. Where they differ (computed from `axis_index`, a
loop counter or the data) but the size is static, each position's slice is
a gather of `begin + range(size)` along each axis, one row of offsets per
position (`batch_dims=1`), which DTensor computes on each device's own
rows. As in XLA and JAX, an offset is clamped so the slice stays inside
the array (a slice that would run past the end starts earlier).
"""

import tensorflow as tf

from tfspmd._src.core import stacking
from tfspmd._src.core import tf_internal
from tfspmd._src.rewrites import per_position

_do_not_convert = tf.autograph.experimental.do_not_convert


def _offsets_stacked(op_inputs):
  return any(op_inputs.input(k).stacked
             for k in range(1, op_inputs.num_inputs))


@_do_not_convert
def convert_slice(op_inputs):
  """The converter of Slice (`converters`)."""
  operation = op_inputs.op
  sizes = operation.outputs[0].shape
  if not _offsets_stacked(op_inputs) or op_inputs.input(2).stacked:
    return per_position.default_or_per_position(op_inputs)
  if not sizes.is_fully_defined():
    raise ValueError(
        f"the slice {operation.name.split('/pfor/')[0]} starts at an offset "
        f"that differs between devices and has the size {sizes}, not known "
        f"when tracing. Give tf.slice a static size (no -1 past an offset "
        f"that differs between devices), as lax.dynamic_slice takes one.")
  begin = op_inputs.stacked_input(1)
  return [tf_internal.wrap_converted(
      _sliced(op_inputs, begin, sizes.as_list()), True)]


def strided_slice_applies(operation):
  """Whether the StridedSlice `operation` takes this route: no new axes."""
  return not operation.get_attr("new_axis_mask")


@_do_not_convert
def convert_strided_slice(op_inputs):
  """The converter of a StridedSlice without new axes (`converters`)."""
  operation = op_inputs.op
  if not _offsets_stacked(op_inputs) or op_inputs.input(3).stacked:
    return per_position.default_or_per_position(op_inputs)
  # The value's dims, without stacking it (`_sliced` takes it as it is).
  value = op_inputs.input(0)
  dims = value.tensor.shape.as_list()[1 if value.stacked else 0:]
  sizes = _strided_slice_sizes(operation, dims)
  if sizes is None:
    raise ValueError(
        f"the strided slice {operation.name.split('/pfor/')[0]} starts at an "
        f"offset that differs between devices, and tfspmd maps such a slice "
        f"only with steps of 1, no `...`, and a size known when tracing "
        f"(`x[i]`, `x[i, 2:5]`, `x[:, j]`). Write it as tf.slice(x, begin, "
        f"size) with a static size, as lax.dynamic_slice takes one.")
  shrink = operation.get_attr("shrink_axis_mask")
  begin_mask = operation.get_attr("begin_mask")
  begin = op_inputs.stacked_input(1)
  given = begin.shape[1]
  starts = []
  for axis, dim in enumerate(dims):
    if axis >= given or begin_mask >> axis & 1:
      starts.append(tf.zeros_like(begin[:, 0]))
    else:
      # Python's negative index counts from the end.
      start = begin[:, axis]
      starts.append(tf.where(start < 0, start + dim, start))
  sliced = _sliced(op_inputs, tf.stack(starts, axis=1), sizes)
  kept = [size for axis, size in enumerate(sizes)
          if axis >= given or not shrink >> axis & 1]
  return [tf_internal.wrap_converted(
      tf.reshape(sliced, [op_inputs.loop_size] + kept), True)]


def _strided_slice_sizes(operation, dims):
  """The static size of a strided slice along each axis, or None.

  A shrunk axis has size 1; the size of another comes from its begin and
  end where both are known (or masked) when tracing.
  """
  if (None in dims or operation.get_attr("ellipsis_mask") or
      operation.get_attr("new_axis_mask")):
    return None
  strides = _static_components(operation.inputs[3])
  if strides is None or any(s != 1 for s in strides):
    return None
  begins = _static_components(operation.inputs[1], allow_unknown=True)
  ends = _static_components(operation.inputs[2], allow_unknown=True)
  shrink = operation.get_attr("shrink_axis_mask")
  begin_mask = operation.get_attr("begin_mask")
  end_mask = operation.get_attr("end_mask")
  sizes = []
  for axis, dim in enumerate(dims):
    if axis >= len(strides):
      sizes.append(dim)
      continue
    if shrink >> axis & 1:
      sizes.append(1)
      continue
    begin = 0 if begin_mask >> axis & 1 else begins[axis]
    end = dim if end_mask >> axis & 1 else ends[axis]
    if begin is None or end is None:
      return None
    begin, end = (min(max(b + dim if b < 0 else b, 0), dim)
                  for b in (begin, end))
    sizes.append(max(end - begin, 0))
  return sizes


def _static_components(tensor, allow_unknown=False):
  """The entries of a 1-D integer tensor known when tracing (None: unknown).

  Entries of a `tf.stack` of scalars are read one by one, so `x[i, 1:4]`
  knows its second axis even though `i` is computed.
  """
  known = tf.get_static_value(tensor)
  if known is not None:
    return [int(v) for v in known.reshape(-1)]
  if not allow_unknown or tensor.op.type != "Pack":
    return None
  components = []
  for scalar in tensor.op.inputs:
    value = tf.get_static_value(scalar)
    components.append(None if value is None else int(value))
  return components


def _sliced(op_inputs, begin, sizes):
  """Each position's slice of the op's first input, `[n, *sizes]`.

  A value the same on every position (an all_gather's result, a constant)
  is sliced along its first axis by one gather of every position's rows
  from it as it lies: repeated once per position first, it would be laid
  out unlike the offsets (an all_gather's result lies split along its
  gathered axis), which DTensor's batched gather refuses ("input and
  output layout do not agree on non-axis dim 0", TF 2.21). That is the
  ring-neighbour idiom, `all_gather(x)[(axis_index(i) + 1) % n]`.
  """
  value = op_inputs.input(0)
  if value.stacked:
    return slice_rows(value.tensor, begin, sizes)
  whole = value.tensor
  dims = whole.shape.as_list()
  if not dims or sizes[0] == dims[0]:
    return slice_rows(op_inputs.stacked_input(0), begin, sizes)
  start = tf.clip_by_value(tf.cast(begin[:, 0], tf.int64), 0,
                           dims[0] - sizes[0])
  positions = start[:, None] + tf.range(sizes[0], dtype=tf.int64)[None, :]
  rows = tf.gather(whole, positions, axis=0)  # [n, size, d1, ...]
  return slice_rows(rows, tf.pad(begin[:, 1:], [[0, 0], [1, 0]]),
                    [sizes[0]] + sizes[1:])


def slice_rows(value, begin, sizes):
  """Row `p` of `value`, sliced from `begin[p]` with `sizes`, for every `p`.

  Args:
    value: A tensor of static shape `[n, d0, d1, ...]`.
    begin: An integer tensor `[n, rank]`: each row's offsets.
    sizes: The static size of the slice along each of `d0, d1, ...`.

  Returns:
    A tensor `[n, *sizes]`.
  """
  dims = value.shape.as_list()[1:]
  begin = tf.cast(begin, tf.int64)
  for axis, (dim, size) in enumerate(zip(dims, sizes)):
    if size == dim:
      continue
    start = tf.clip_by_value(begin[:, axis], 0, dim - size)
    positions = start[:, None] + tf.range(size, dtype=tf.int64)[None, :]
    value = tf.gather(value, positions, axis=axis + 1, batch_dims=1)
  return value


def batched_gather_applies(operation):
  """Whether the GatherV2 `operation` takes `convert_batched_gather`."""
  return operation.get_attr("batch_dims") != 0


@_do_not_convert
def convert_batched_gather(op_inputs):
  """The converter of a gather with batch dimensions (`converters`).

  A nested pmap's gather has the inner axes as batch dimensions. Where
  only its indices differ along the axis being vectorized, pfor moves that
  axis behind the batch ones and back by transposes, which swap dimensions
  split over different mesh dimensions: DTensor refuses them ("needs
  communication", TF 2.21). The params repeated along the axis instead
  (each device holds its own copy) make it one more batch dimension, in
  front, with no transpose.
  """
  params, indices = op_inputs.input(0), op_inputs.input(1)
  if indices.stacked and not params.stacked:
    values = op_inputs.inputs()
    values[0] = tf_internal.ConvertedValue(stacking.repeat_along_new_axis(
        params.tensor, 0, op_inputs.loop_size), True)
    op_inputs = tf_internal.with_inputs(op_inputs, values)
  return per_position.default_or_per_position(op_inputs)


@_do_not_convert
def convert_gather_nd(op_inputs):
  """The converter of GatherNd (`converters`).

  Indices that differ between devices into params that do not are one
  gather of every position's indices from the params each device holds
  whole (pfor takes only params that differ, and the per-position route
  would gather the params onto every device once per position).
  """
  params, indices = op_inputs.input(0), op_inputs.input(1)
  if indices.stacked and not params.stacked:
    return [tf_internal.wrap_converted(
        tf.gather_nd(params.tensor, indices.tensor), True)]
  return per_position.default_or_per_position(op_inputs)
