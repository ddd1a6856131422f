"""Moving a value's split from one axis to another: DTensor's all-to-all.

On a 1-D mesh, relaying out a tensor split along one axis so that it is split
along another is a `CollectiveAllToAllV2` in which each device sends
(n-1)/n of its block, the least any exchange can. all_to_all, ppermute,
psum_scatter and all_gather are all built from it where it is right: on a
1-D mesh (DTensor's all-to-all relayout moves the wrong blocks on meshes of
several dimensions, TF 2.21), on devices in ascending id order (its
all-to-all puts the blocks in device id order whatever the mesh's order),
for the dtypes its all-to-all takes, and for the pmap axis itself (a vmap
axis is not split over any device).

DTensor's CPU and GPU lowering of that all-to-all (TF 2.21) is right only
where one of the two axes is the first, or where the tensor's rank is one
more than twice the smaller axis: between two later axes it transposes the
leading axes to the back and back again with a permutation that undoes the
first only at that rank, so a rank-4 tensor split along axis 3 and relaid
out along axis 1 comes back scrambled, with no error. The relayouts here
therefore act on at most three axes: those before the new split merged, the
split axis, those after it merged.
"""

import math

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfspmd._src.core import stacking
from tfspmd._src.executors import dtensor_settings
from tfspmd._src.runtime import axis_env

_ALL_TO_ALL_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64,
                      tf.int32, tf.int64)


class Resplitter:
  """Relayouts of values stacked over one pmap axis, on its 1-D mesh."""

  def __init__(self, state):
    self._state = state
    axis = state.mesh_axes[0]
    self.size, self._dim = axis.size, axis.dim

  def split_along(self, tensor, axis):
    """`tensor` relaid out split along `axis` over the mesh, whole elsewhere."""
    shape = stacking.sizes(tensor)
    if axis == 0 or len(shape) <= 3:
      return self._relayout(tensor, axis)
    merged = [math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:])]
    return tf.reshape(self._relayout(tf.reshape(tensor, merged), 1), shape)

  def _relayout(self, tensor, axis):
    spec = [dtensor.UNSHARDED] * tensor.shape.rank
    spec[axis] = self._dim
    return dtensor.relayout(tensor, self._state.layout(spec))

  def move_split(self, tensor, source, destination):
    """`tensor`, split along `source`, relaid out split along `destination`.

    DTensor's layout propagation carries a relayout's layout back into the
    producers of its input: a value made on every device (a `tf.zeros`
    with rows scattered into it) would take the split along `destination`
    and pass it on to its own inputs, where that axis may be too short to
    split ("does not evenly divide the length of that axis"). Relaying the
    value out split along `source` first keeps the producers as they are.
    """
    return self.split_along(self.split_along(tensor, source), destination)


def for_frame(frame, dtype):
  """A `Resplitter` for values of `dtype` stacked over `frame`, or None.

  None where the all-to-all relayout is not right (see the module
  docstring) or the program does not lay out its values: the caller then
  lowers the collective another way.
  """
  state = axis_env.trace_state()
  if (state is None or not state.lays_out or len(state.mesh_axes) != 1 or
      dtype not in _ALL_TO_ALL_DTYPES or frame.mesh_dim is None or
      frame.mesh_dim != state.mesh_axes[0].dim or
      not dtensor_settings.in_id_order(state.mesh_key().devices)):
    return None
  return Resplitter(state)
