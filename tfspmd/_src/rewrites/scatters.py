"""Scatters at indices that differ between devices, as each device's own op.

pfor maps a `tf.tensor_scatter_nd_*` with per-device indices only by
scattering into the stacked tensor at indices that name the position too,
or not at all, and the per-position route copies the op once per device
on inputs gathered onto every device: under DTensor each such scatter is
a collective, and a loop that draws pixels one by one (the Lorenz colab's
Wu lines) spends its time in them. Where the tensor is small, each
position's scatter is instead a comparison of its linear indices with
every element's and a reduction over the updates: ops on each device's
own rows, which DTensor keeps local (for numeric values; others keep
the op's own route).

As in XLA and JAX (and tfspmd's programs run under XLA), an index outside
the tensor drops its update; a negative coordinate too, rather than reach
another element through the linear index.
"""

import tensorflow as tf

from tfspmd._src.core import static_values
from tfspmd._src.core import tf_internal
from tfspmd._src.rewrites import per_position
from tfspmd._src.runtime import axis_env

_do_not_convert = tf.autograph.experimental.do_not_convert

SCATTER_TYPES = ("ScatterNd", "TensorScatterAdd", "TensorScatterSub",
                 "TensorScatterUpdate", "TensorScatterMax", "TensorScatterMin")

# The most elements, per position, of the comparison of every update with
# every element of the tensor; past it, the op's own route.
_COMPARISON_LIMIT = 1 << 20


@_do_not_convert
def convert(op_inputs):
  """The converter of the scatter ops (`converters`)."""
  operation = op_inputs.op
  if operation.type == "ScatterNd":
    indices_at, updates_at = 0, 1
  else:
    indices_at, updates_at = 1, 2
  indices = op_inputs.input(indices_at)
  dtype = op_inputs.input(updates_at).tensor.dtype
  if (not indices.stacked or axis_env.split_leading_dims() > 1 or
      not (dtype.is_floating or dtype.is_integer or dtype.is_complex) or
      not indices.tensor.shape.is_fully_defined()):
    return _own_route_dropping_outside(op_inputs, indices_at)
  base = _base(op_inputs)
  if base is None or not base.shape.is_fully_defined():
    return _own_route_dropping_outside(op_inputs, indices_at)
  size = op_inputs.loop_size
  indices = indices.tensor
  dims = base.shape.as_list()[1:]
  depth = indices.shape[-1]
  count = indices.shape[1:-1].num_elements()
  targets = _product(dims[:depth])
  row = _product(dims[depth:])
  if not count:
    # No updates: the tensor as it is (the op's own route crashes, TF 2.21).
    return [tf_internal.wrap_converted(base, True)]
  if count * targets * row > _COMPARISON_LIMIT:
    return _own_route_dropping_outside(op_inputs, indices_at)
  updates = tf.reshape(op_inputs.stacked_input(updates_at),
                       [size, count, 1, row])
  hits = _hits(tf.reshape(indices, [size, count, depth]), dims[:depth])
  flat = tf.reshape(base, [size, targets, row])
  result = _COMBINE[operation.type](flat, hits, updates)
  return [tf_internal.wrap_converted(tf.reshape(result, base.shape), True)]


def _own_route_dropping_outside(op_inputs, indices_at):
  """The op's own route, an index outside the tensor dropping its update.

  The op's kernel refuses such an index when the program runs, where XLA
  and JAX drop its update (and the comparison route above does): each one
  is sent to an extra row past the tensor's last indexed axis, cut off
  after. That axis is the user's own: in a pmap nested in another, the
  outer one converts the inner one's scatter, whose leading indexed axes
  are the inner mapped axes, split over their mesh dimensions, where an
  extra row would leave a size the mesh dimension does not divide. Where
  the tensor's shape is not known while tracing, the route as it is.
  """
  shape = _scattered_shape(op_inputs)
  depth = op_inputs.input(indices_at).tensor.shape[-1]
  if (shape is None or not depth or
      not shape[:depth].is_fully_defined()):
    return per_position.default_or_per_position(op_inputs)
  dims = shape.as_list()[:depth]
  last = depth - 1
  indices, stacked = op_inputs.input(indices_at)
  extra_row = tf.constant([0] * last + [dims[last]], indices.dtype)
  values = list(op_inputs.inputs())
  values[indices_at] = tf_internal.ConvertedValue(
      tf.where(_inside(indices, dims)[..., None], indices, extra_row), stacked)
  if op_inputs.op.type == "ScatterNd":
    padded_shape = shape.as_list()
    padded_shape[last] += 1
    values[2] = tf_internal.ConvertedValue(
        tf.constant(padded_shape, op_inputs.input(2).tensor.dtype), False)
  else:
    padding = [[0, 0]] * (shape.rank + 1)
    padding[last + 1] = [0, 1]
    values[0] = tf_internal.ConvertedValue(
        tf.pad(op_inputs.stacked_input(0), padding), True)
  padded = per_position.default_or_per_position(
      tf_internal.with_inputs(op_inputs, values))
  result, result_stacked = tf_internal.converted_outputs(padded)[0]
  kept = [slice(None)] * last + [slice(0, dims[last])]
  if result_stacked:
    kept.insert(0, slice(None))
  return [tf_internal.wrap_converted(result[tuple(kept)], result_stacked)]


def _scattered_shape(op_inputs):
  """One position's shape of the tensor scattered into, or None if not static.

  ScatterNd's is its shape input's value, known only if that is a constant.
  """
  if op_inputs.op.type != "ScatterNd":
    tensor, stacked = op_inputs.input(0)
    return tensor.shape[1:] if stacked else tensor.shape
  shape = op_inputs.input(2)
  known = static_values.value(shape.tensor)
  if shape.stacked or known is None:
    return None
  return tf.TensorShape([int(d) for d in known])


def _base(op_inputs):
  """The stacked tensor scattered into, or None if its shape is not static."""
  if op_inputs.op.type != "ScatterNd":
    return op_inputs.stacked_input(0)
  shape = _scattered_shape(op_inputs)
  if shape is None:
    return None
  return tf.zeros([op_inputs.loop_size] + shape.as_list(),
                  op_inputs.inputs()[1].tensor.dtype)


def _product(dims):
  total = 1
  for d in dims:
    total *= d
  return total


def _hits(indices, dims):
  """[n, count, targets, 1]: whether update k of position p lands on t."""
  strides = [_product(dims[axis + 1:]) for axis in range(len(dims))]
  linear = tf.reduce_sum(indices * tf.constant(strides, indices.dtype),
                         axis=-1)
  linear = tf.where(_inside(indices, dims), linear, -tf.ones_like(linear))
  every = tf.range(_product(dims), dtype=indices.dtype)
  return tf.equal(linear[:, :, None], every)[..., None]


def _inside(indices, dims):
  """Whether each index (the last axis of `indices`) lies inside `dims`."""
  return tf.reduce_all(
      tf.logical_and(indices >= 0, indices < tf.constant(dims, indices.dtype)),
      axis=-1)


def _landed(hits, updates, empty):
  """[n, count, targets, row]: each update where it lands, `empty` elsewhere."""
  return tf.where(hits, updates, tf.constant(empty, updates.dtype))


def _add(flat, hits, updates):
  return flat + tf.reduce_sum(_landed(hits, updates, 0), axis=1)


def _sub(flat, hits, updates):
  return flat - tf.reduce_sum(_landed(hits, updates, 0), axis=1)


def _extreme(reduce, combine, empty_of):
  def combined(flat, hits, updates):
    empty = empty_of(updates.dtype)
    extreme = reduce(_landed(hits, updates, empty), axis=1)
    return tf.where(tf.reduce_any(hits, axis=1), combine(flat, extreme), flat)
  return combined


def _lowest(dtype):
  return float("-inf") if dtype.is_floating else dtype.min


def _highest(dtype):
  return float("inf") if dtype.is_floating else dtype.max


def _update(flat, hits, updates):
  # Of several updates to one element, the last one given, as on one device.
  count = hits.shape[1]
  order = tf.reshape(tf.range(1, count + 1), [1, count, 1, 1])
  last = tf.reduce_max(tf.where(hits, order, 0), axis=1)[..., 0]
  chosen = tf.gather(updates[:, :, 0, :], tf.maximum(last - 1, 0),
                     batch_dims=1)
  return tf.where(last[..., None] > 0, chosen, flat)


_COMBINE = {
    "ScatterNd": _add,
    "TensorScatterAdd": _add,
    "TensorScatterSub": _sub,
    "TensorScatterUpdate": _update,
    "TensorScatterMax": _extreme(tf.reduce_max, tf.maximum, _lowest),
    "TensorScatterMin": _extreme(tf.reduce_min, tf.minimum, _highest),
}
