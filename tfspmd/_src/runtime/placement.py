"""Host data <-> DTensors on a mesh: layouts, packing, and assembling.

A value's placement says which of its axes is split over which mesh
dimension; every other axis is whole on each device. Mapped inputs are
placed by `dtensor.pack` of per-device slices, never by copying the whole
array to every device.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple
from typing import TYPE_CHECKING

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfspmd._src.core import tf_internal
from tfspmd._src.executors import dtensor_device
from tfspmd._src.executors import dtensor_values
from tfspmd._src.executors import run_errors
from tfspmd._src.runtime import devices as devices_lib
from tfspmd._src.runtime import mesh as mesh_lib

if TYPE_CHECKING:
  from tfspmd._src.runtime import named_mesh


class MergedAxes(NamedTuple):
  """A DTensor mesh whose dimensions stand for groups of a `Mesh`'s axes.

  A DTensor layout splits a tensor axis over one mesh dimension; an axis a
  spec splits over several mesh axes (`P(('a', 'b'))`) is split over one
  dimension of a mesh of the same devices in which those axes are one,
  the first major, as JAX splits it.

  Attributes:
    mesh: The user's `Mesh`.
    axes: For each dimension of the DTensor mesh, the tuple of the `Mesh`'s
      axis names it stands for.
  """
  mesh: named_mesh.Mesh
  axes: tuple


@dataclasses.dataclass(frozen=True)
class Placement:
  """How a tensor lies on a mesh.

  Attributes:
    mesh_key: The `mesh.MeshKey` (dim names, sizes, devices) of the mesh.
    spec: One entry per tensor axis: the mesh dimension it is split over, or
      None where every device holds the whole axis.
    merged: The `MergedAxes` of a mesh whose dimensions merge the axes of a
      user's `Mesh`; None for any other mesh.
  """
  mesh_key: mesh_lib.MeshKey
  spec: tuple
  merged: MergedAxes | None = None

  @functools.cached_property
  def mesh(self):
    return mesh_lib.mesh_for_axes(*self.mesh_key)

  @functools.cached_property
  def layout(self):
    return mesh_lib.layout_on(self.mesh_key, self.spec)

  @property
  def devices(self):
    return self.mesh_key.devices

  @functools.cached_property
  def local_blocks(self):
    """For each local device, in mesh order: `(device, index)` of its block.

    `index` is a tuple with one entry per tensor axis: the block number along
    a split axis, None along a whole one.
    """
    dim_names, sizes, devices = self.mesh_key
    position_of = {name: k for k, name in enumerate(dim_names)}
    blocks = []
    for position in self.mesh.local_device_ids():
      coordinate = np.unravel_index(position, sizes)
      index = tuple(None if dim is None else int(coordinate[position_of[dim]])
                    for dim in self.spec)
      blocks.append((devices[position], index))
    return tuple(blocks)

  @functools.cached_property
  def block_map(self):
    """Which block each local device holds, whatever the mesh's dim names."""
    return (tuple((device, index) for device, index in self.local_blocks),
            self.counts())

  def counts(self):
    """The number of blocks along each tensor axis."""
    dim_names, sizes, _ = self.mesh_key
    size_of = dict(zip(dim_names, sizes))
    return tuple(1 if dim is None else size_of[dim] for dim in self.spec)

  @functools.cached_property
  def _local_ranks(self):
    """Per mesh dim: {coordinate: its rank among this process's coordinates}."""
    dim_names, sizes, _ = self.mesh_key
    coordinates = [np.unravel_index(position, sizes)
                   for position in self.mesh.local_device_ids()]
    ranks = {}
    for k, name in enumerate(dim_names):
      held = sorted({int(c[k]) for c in coordinates})
      ranks[name] = {c: rank for rank, c in enumerate(held)}
    return ranks

  @functools.cached_property
  def local_view(self):
    """`local_blocks` with block numbers within this process's part.

    With several processes, each holds a part of the array (the blocks of
    its devices) and sees it as an array of its own, as in JAX's pmap; in
    one process the part is the whole array.
    """
    ranks = self._local_ranks
    return tuple(
        (device, tuple(None if dim is None else ranks[dim][block]
                       for dim, block in zip(self.spec, index)))
        for device, index in self.local_blocks)

  def local_counts(self):
    """The number of blocks of this process's part along each tensor axis."""
    return tuple(1 if dim is None else len(self._local_ranks[dim])
                 for dim in self.spec)

  def local_shape(self, global_shape):
    """The shape of this process's part of an array of `global_shape`.

    An axis of unknown extent (None) stays unknown.
    """
    return tuple(
        None if extent is None else extent // count * local
        for extent, count, local in zip(global_shape, self.counts(),
                                        self.local_counts()))


@dataclasses.dataclass(frozen=True)
class ProcessBlock:
  """Where this process's devices lie in a grid of devices.

  With several processes, a process passes and gets back its part of an
  array split over the grid: the blocks of the positions its devices hold.
  That part is an array only if the devices hold every combination of
  their positions along the grid's axes (`is_block`).

  Attributes:
    process: This process's index.
    held: The grid positions (index tuples) of its devices, in grid order.
    positions: Per grid axis, the sorted positions its devices hold.
  """
  process: int
  held: tuple
  positions: tuple

  @property
  def extents(self):
    """Per grid axis, how many positions this process holds."""
    return tuple(len(p) for p in self.positions)

  @property
  def is_block(self):
    return len(self.held) == math.prod(self.extents)


@functools.lru_cache(maxsize=4096)
def placement_for(mesh_key, spec):
  """Interned `Placement`s, so equal placements compare by identity."""
  return Placement(mesh_key, spec)


def process_block(grid):
  """The `ProcessBlock` of this process in `grid`, an array of `Device`s."""
  me = devices_lib.process_index()
  held = tuple(index for index, device in np.ndenumerate(grid)
               if device.process_index == me)
  positions = tuple(tuple(sorted({index[k] for index in held}))
                    for k in range(grid.ndim))
  return ProcessBlock(me, held, positions)


def block_slices(index, shape, counts):
  """NumPy index of the block `index` of an array of `shape` split `counts` ways."""
  slices = []
  for block, extent, count in zip(index, shape, counts):
    if block is None:
      slices.append(slice(None))
    else:
      step = extent // count
      slices.append(slice(block * step, (block + 1) * step))
  return tuple(slices)


def host_blocks(placement, shape):
  """The NumPy index of each local device's block, in mesh order.

  None stands for the whole array (a replicated one's every block), which
  `pack_host_array` passes as it is instead of a view per device.

  Args:
    placement: The `Placement` of the array.
    shape: The shape of this process's part of the array.
  """
  counts = placement.local_counts()
  return tuple(None if all(block is None for block in index) else
               block_slices(index, shape, counts)
               for _, index in placement.local_view)


def pack_host_array(array, placement, blocks=None):
  """Places the NumPy `array`, this process's part, each device getting its block.

  Args:
    array: This process's part of the array.
    placement: Where it goes.
    blocks: `host_blocks(placement, array.shape)`, where the caller keeps
      them (a program's inputs have the shapes it was traced for).
  """
  if blocks is None:
    blocks = host_blocks(placement, array.shape)
  return dtensor_values.pack([array if block is None else array[block]
                              for block in blocks], placement.layout)


def pack_global_array(array, placement):
  """Places this process's blocks of the whole NumPy `array`."""
  counts = placement.counts()
  components = [array[block_slices(index, array.shape, counts)]
                for _, index in placement.local_blocks]
  return dtensor_values.pack(components, placement.layout)


def renamed(placement, mesh_key):
  """`placement` on `mesh_key`, the same devices and shape under other names.

  A shard_map's mesh dimensions have the mesh's axis names and a pmap's are
  named by depth: over the same devices, a block lies on the device at the
  same position of either mesh.
  """
  rename = dict(zip(placement.mesh_key.dim_names, mesh_key.dim_names))
  return Placement(mesh_key, tuple(None if dim is None else rename[dim]
                                   for dim in placement.spec))


def renamed_layout(layout, mesh):
  """`layout` on `mesh`, or None unless the meshes differ only in dim names."""
  source = layout.mesh
  if (source.shape() != mesh.shape() or
      source.local_devices() != mesh.local_devices() or
      not np.array_equal(source.global_device_ids(), mesh.global_device_ids())):
    return None
  rename = dict(zip(source.dim_names, mesh.dim_names))
  return dtensor.Layout([rename.get(spec, spec)
                         for spec in layout.sharding_specs], mesh)


def components(value):
  """`dtensor.unpack(value)`, the per-device tensors, once they are computed.

  Other Python threads run during the wait where they can
  (`dtensor_device.components`). A program whose ops cannot fail on their
  shapes is not waited for at its call; should it fail anyway, reading its
  result raises tfspmd's error naming the op, not TensorFlow's.
  """
  try:
    return dtensor_device.components([value])[0]
  except tf.errors.OpError as e:
    raise run_errors.failed_program(e) from None


def repack(value, placement):
  """Moves a DTensor's per-device components onto `placement`'s layout.

  Only valid when each local device of `placement` already holds exactly the
  block it needs (the same split over the same devices, under another mesh).
  """
  return dtensor_values.repack(value, placement.layout)


def moved_blocks(value, source, target, shape):
  """The DTensor `value` on `source`, reshaped to `shape` on `target`.

  Each device's block is reshaped where it is and packed onto `target`'s
  mesh: no data moves between devices. Only valid when each device holds,
  under `source`, the elements of the block it holds under `target` (a
  shard_map's expanded result and the same array on a mesh that merges
  mesh axes).
  """
  block_shape = [extent // count
                 for extent, count in zip(shape, target.counts())]
  by_device = dict(zip(source.mesh.local_devices(), components(value)))
  blocks = [tf.reshape(by_device[device], block_shape)
            for device in target.mesh.local_devices()]
  return dtensor_values.pack(blocks, target.layout)


def assemble(value, placement, local_shape, dtype):
  """Gathers a DTensor's local blocks into one NumPy array of `local_shape`.

  That is the whole array in one process, this process's part in several.
  An array whole on every device is read from its first device's copy,
  sharing that copy's memory (the caller makes the array read-only).
  """
  blocks = components(value)
  if not any(dim is not None for dim in placement.spec):
    return np.asarray(tf_internal.host_view(blocks[0]))
  out = np.empty(local_shape, dtype=dtype)
  counts = placement.local_counts()
  seen = set()
  for (_, index), component in zip(placement.local_view, blocks):
    if index in seen:
      continue
    seen.add(index)
    out[block_slices(index, local_shape, counts)] = component.numpy()
  return out


def whole_on_host(value):
  """The DTensor `value`'s whole array (this process's part), as one tensor.

  A value split over the devices is gathered onto each of them first.
  """
  return components(dtensor_values.replicated_on(value))[0]


def replicated(tensor, mesh):
  """An eager tensor copied whole to every device of `mesh`, as a DTensor."""
  return dtensor_values.copy_to_mesh(
      tensor, dtensor.Layout.replicated(mesh, tensor.shape.rank))


def relayout(value, placement):
  """The DTensor `value` on `placement`, on the devices where it can be.

  On the same mesh, or on a mesh of the same devices under other dimension
  names or another shape, DTensor moves the blocks between the devices;
  between meshes of other devices the array goes through the host.
  """
  moved, layout = dtensor_values.entered(_relayout_on_devices, value, placement)
  if moved is not None:
    return moved
  whole = components(dtensor_values.relayout(
      value, dtensor.Layout.replicated(layout.mesh, layout.rank)))
  if _same_devices(layout.mesh, placement.mesh):
    # Another shape of mesh over the same devices (a 2 x 4 shard_map's and
    # an 8-device pmap's): every device already holds the whole array.
    by_device = dict(zip(layout.mesh.local_devices(), whole))
    value = dtensor_values.pack(
        [by_device[device] for device in placement.mesh.local_devices()],
        dtensor.Layout.replicated(placement.mesh, layout.rank))
    return dtensor_values.relayout(value, placement.layout)
  return pack_global_array(whole[0].numpy(), placement)


def _relayout_on_devices(value, placement):
  """`(value on placement, its layout before)`, or `(None, its layout)`.

  None where DTensor cannot move it between the two meshes in one step.

  Called into DTensor's device (`dtensor_values.entered`).
  """
  layout = dtensor.fetch_layout(value)
  if layout.mesh != placement.mesh:
    renamed = renamed_layout(layout, placement.mesh)
    if renamed is not None:
      # A shard_map's mesh and a pmap's over the same devices: each device
      # keeps its blocks.
      value, layout = dtensor.pack(dtensor.unpack(value), renamed), renamed
  if layout == placement.layout:
    return value, layout
  if layout.mesh == placement.mesh and mesh_lib.layout_on(
      placement.mesh_key, layout.sharding_specs) == placement.layout:
    # Split over size-1 mesh dimensions only where `placement` is whole:
    # every device holds its block already.
    return dtensor.pack(dtensor.unpack(value), placement.layout), layout
  if layout.mesh == placement.mesh:
    return dtensor.relayout(value, placement.layout), layout
  return None, layout


def _same_devices(mesh, other):
  """Whether two DTensor meshes span the same devices, in any order."""
  return (mesh.size == other.size and
          sorted(mesh.local_devices()) == sorted(other.local_devices()))
