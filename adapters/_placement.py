"""Host data onto a pmap's devices as `tfspmd.ShardedArray`s, and back.

tfspmd has no public placement API yet (JAX's `device_put_sharded` and
`device_put_replicated`); this is the one module of `adapters` that reaches
into `tfspmd._src`, so that a change there touches one place. The placements
made here are the ones pmap makes for a mapped size of `len(devices)` over the
first local devices, so pmap takes the arrays with no copy.
"""

import numpy as np

import tfspmd
from tfspmd._src.runtime import mesh as mesh_lib  # pylint: disable=protected-access
from tfspmd._src.runtime import placement as placement_lib  # pylint: disable=protected-access


def data_devices(count=None):
  """The devices a pmap over `count` mapped positions runs on in this process."""
  local = tfspmd.local_devices()
  if count is None:
    return local
  if not 1 <= count <= len(local):
    raise ValueError(
        f"`num_devices` must be between 1 and the {len(local)} local devices, "
        f"got {count}.")
  return local[:count]


def placement(devices, rank, split):
  """The placement pmap gives a rank-`rank` value over `devices`.

  Args:
    devices: The local devices of the mapped axis, in order.
    rank: The rank of the whole value (the mapped axis included if split).
    split: True for an axis 0 split over the devices, False for a value
      replicated on every device.
  """
  dim = mesh_lib.mesh_dim_name(0)
  spec = [None] * rank
  if split:
    spec[0] = dim
  mesh_key = mesh_lib.MeshKey((dim,), (len(devices),), tuple(devices))
  return placement_lib.placement_for(mesh_key, tuple(spec))


def place(whole, devices, split):
  """The tensor `whole` on `devices`, as a `ShardedArray`.

  Args:
    whole: The whole value. Split: its axis 0 has one entry per device
      (or a multiple of that), device i getting the i-th share. Replicated:
      every device holds all of it.
    devices: The devices, in order.
    split: Whether axis 0 is split over the devices (True) or every device
      holds the whole value.
  """
  where = placement(devices, whole.shape.rank, split)
  return tfspmd.ShardedArray.from_whole(whole, where)


def is_replicated(array):
  """True if every device holds the whole of `array`."""
  return all(dim is None for dim in array.placement.spec)


def block_counts(array):
  """How many blocks `array` is cut into along each axis (1: whole).

  Of this process's part, the array `np.asarray(array)` shows.
  """
  return array.placement.local_counts()


def device_count(array):
  """The number of this process's devices that hold a block of `array`."""
  return len(array.placement.local_view)


def distinct_blocks(array):
  """Each block of `array` once, in row-major order of the block grid.

  A block that several devices hold (an axis not split over some mesh
  dimension) is taken from the first of them, on that device: nothing is
  gathered.
  """
  # The shards come in device order, the blocks in the mesh's: a spec that
  # splits an axis over several mesh axes in another order than the mesh's
  # (P(('b', 'a')) on an ('a', 'b') mesh) orders the devices otherwise.
  data_on = {shard.device: shard.data for shard in array.addressable_shards}
  holder = {}
  for device, index in array.placement.local_view:
    block = tuple(0 if number is None else number for number in index)
    holder.setdefault(block, data_on[device])
  return [holder[block] for block in np.ndindex(*block_counts(array))]


def place_like(array, like):
  """The NumPy `array` split over the devices as `like` is, as `like`'s type.

  `array` has `like`'s shape (this process's part of it): each device gets
  its block of it, whatever split the values came from.
  """
  value = placement_lib.pack_host_array(array, like.placement)
  return tfspmd.ShardedArray(value, like.placement, like.shape, like.dtype)
