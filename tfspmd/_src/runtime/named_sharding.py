"""Shardings, as `jax.sharding`: where an array lies on the devices.

A `NamedSharding` pairs a `Mesh` with a `PartitionSpec`; given an array's
rank it is one `Placement`, the form the rest of tfspmd works with. A
`SingleDeviceSharding` names one device.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tfspmd._src.runtime import devices as devices_lib
from tfspmd._src.runtime import mesh as mesh_lib
from tfspmd._src.runtime import named_mesh
from tfspmd._src.runtime import placement as placement_lib
from tfspmd._src.runtime.named_mesh import Mesh
from tfspmd._src.runtime.named_mesh import PartitionSpec


class NamedSharding:
  """An array split over a `Mesh` as a `PartitionSpec` says.

  Args:
    mesh: The `tfspmd.Mesh` whose devices hold the array.
    spec: A `tfspmd.PartitionSpec`: for each array dimension, None, a mesh
      axis name, or a tuple of names.

  Raises:
    TypeError: If `mesh` is not a `tfspmd.Mesh` or `spec` not a
      `PartitionSpec`.
    ValueError: If `spec` names an axis the mesh lacks, or one axis twice.

  Example:
    >>> import tfspmd
    >>> from tfspmd.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = tfspmd.make_mesh((4, 2), ('x', 'y'))
    >>> s = NamedSharding(mesh, P('x'))
    >>> s
    NamedSharding(mesh=Mesh({'x': 4, 'y': 2}), spec=PartitionSpec('x'))
    >>> s == NamedSharding(mesh, P('x')), s.num_devices
    (True, 8)
  """

  def __init__(self, mesh: Mesh, spec: PartitionSpec) -> None:
    if not isinstance(mesh, Mesh):
      raise TypeError(
          f"NamedSharding: `mesh` must be a tfspmd.Mesh "
          f"(tfspmd.make_mesh(...)), got {type(mesh).__name__}.")
    if not isinstance(spec, PartitionSpec):
      raise TypeError(
          f"NamedSharding: `spec` must be a tfspmd.PartitionSpec "
          f"(tfspmd.P(...)), got {type(spec).__name__} {spec!r}.")
    named_mesh.check_spec_axes(spec, mesh, f"NamedSharding: `spec` {spec}")
    self._mesh = mesh
    self._spec = spec

  @property
  def mesh(self) -> Mesh:
    return self._mesh

  @property
  def spec(self) -> PartitionSpec:
    return self._spec

  @property
  def device_set(self) -> set[devices_lib.Device]:
    """The devices of the mesh, as a set."""
    return set(self._mesh.devices.flat)

  @property
  def num_devices(self) -> int:
    return self._mesh.size

  def devices_indices_map(
      self, global_shape: tuple[int, ...]) -> dict[devices_lib.Device,
                                                   tuple[slice, ...]]:
    """Each device's block of an array of `global_shape`, as NumPy indices.

    Args:
      global_shape: The whole array's shape.

    Returns:
      `{device: index}` over every device of the mesh, in mesh order: a
      slice per dimension (`slice(None)` where the spec leaves it whole).

    Raises:
      ValueError: If the spec has more entries than `global_shape` or
        splits a dimension its number of blocks does not divide.

    Example:
      >>> import tfspmd
      >>> from tfspmd.sharding import NamedSharding, PartitionSpec as P
      >>> s = NamedSharding(tfspmd.make_mesh((4, 2), ('x', 'y')), P('y'))
      >>> s.devices_indices_map((4, 3))[tfspmd.devices()[3]]
      (slice(2, 4, None), slice(None, None, None))
    """
    shape = tuple(global_shape)
    placement_of(self, shape, "an array")
    names = self._mesh.axis_names
    indices = {}
    for position in np.ndindex(self._mesh.devices.shape):
      at = dict(zip(names, position))
      index = []
      for dimension, size in enumerate(shape):
        axes = self._spec.axes_of(dimension)
        if not axes:
          index.append(slice(None))
          continue
        block = 0
        for name in axes:
          block = block * self._mesh.shape[name] + at[name]
        length = size // math.prod(self._mesh.shape[name] for name in axes)
        index.append(slice(block * length, (block + 1) * length))
      indices[self._mesh.devices[position]] = tuple(index)
    return indices

  def addressable_devices_indices_map(
      self, global_shape: tuple[int, ...]) -> dict[devices_lib.Device,
                                                   tuple[slice, ...]]:
    """`devices_indices_map`, for this process's devices only.

    Example:
      >>> import tfspmd
      >>> from tfspmd.sharding import NamedSharding, PartitionSpec as P
      >>> s = NamedSharding(tfspmd.make_mesh((8,), ('x',)), P('x'))
      >>> s.addressable_devices_indices_map((16,))[tfspmd.devices()[1]]
      (slice(2, 4, None),)
    """
    here = devices_lib.process_index()
    return {device: index for device, index in
            self.devices_indices_map(global_shape).items()
            if device.process_index == here}

  def is_equivalent_to(self, other: Any, ndim: int) -> bool:
    """True if `other` lays an array of rank `ndim` out the same way.

    `P('x')` and `P('x', None)` differ as specs but not as layouts.
    """
    if not isinstance(other, NamedSharding) or other.mesh != self._mesh:
      return False
    return (_padded(self._spec, ndim) == _padded(other.spec, ndim))

  def __eq__(self, other: object) -> bool:
    return (isinstance(other, NamedSharding) and self._mesh == other.mesh and
            self._spec == other.spec)

  def __hash__(self) -> int:
    return hash((self._mesh, self._spec))

  def __repr__(self) -> str:
    return f"NamedSharding(mesh={self._mesh!r}, spec={self._spec!r})"


class SingleDeviceSharding:
  """An array whole on one device.

  Args:
    device: A `tfspmd.Device`.

  Example:
    >>> import tfspmd
    >>> from tfspmd.sharding import SingleDeviceSharding
    >>> SingleDeviceSharding(tfspmd.devices()[1])
    SingleDeviceSharding(device=Device(platform='cpu', id=1))
  """

  def __init__(self, device: devices_lib.Device) -> None:
    if not isinstance(device, devices_lib.Device):
      raise TypeError(
          f"SingleDeviceSharding: `device` must be a tfspmd.Device (from "
          f"tfspmd.devices()), got {type(device).__name__}.")
    self._device = device

  @property
  def device_set(self) -> set[devices_lib.Device]:
    return {self._device}

  @property
  def num_devices(self) -> int:
    return 1

  def __eq__(self, other: object) -> bool:
    return (isinstance(other, SingleDeviceSharding) and
            self._device == other._device)  # pylint: disable=protected-access

  def __hash__(self) -> int:
    return hash(self._device)

  def __repr__(self) -> str:
    return f"SingleDeviceSharding(device={self._device!r})"


def _padded(spec, ndim):
  return tuple(spec) + (None,) * (ndim - len(spec))


def placement_of(sharding, shape, what):
  """The `Placement` of an array of `shape` laid out by `sharding`.

  A spec that splits no dimension over several mesh axes gives a placement
  on the mesh's own DTensor mesh. One that does (`P(('a', 'b'))`) gives a
  placement on a DTensor mesh of the same devices with one dimension per
  group of axes the spec names, then one per axis it leaves out
  (`merged_mesh_key`), so that each device holds the block JAX gives it.

  Raises:
    ValueError: Naming `what`, if the spec is longer than the array's rank
      or a split dimension is not divisible by its number of blocks.
  """
  spec, mesh = sharding.spec, sharding.mesh
  if len(spec) > len(shape):
    raise ValueError(
        f"{what} of shape {tuple(shape)} has rank {len(shape)}, but "
        f"{sharding} splits {len(spec)} dimensions; give a spec of at most "
        f"{len(shape)} entries.")
  groups = [spec.axes_of(dimension) for dimension in range(len(shape))]
  for dimension, (size, axes) in enumerate(zip(shape, groups)):
    count = math.prod(mesh.shape[name] for name in axes)
    if size % count:
      raise ValueError(
          f"{what} of shape {tuple(shape)}: {sharding} splits dimension "
          f"{dimension} {count} ways, which does not evenly divide its size "
          f"{size}.")
  if all(len(axes) < 2 for axes in groups):
    dim_of = dict(zip(mesh.axis_names, mesh.dim_names))
    return placement_lib.Placement(mesh.mesh_key, tuple(
        dim_of[axes[0]] if axes else None for axes in groups))
  mesh_key, merged = merged_mesh_key(mesh, [axes for axes in groups if axes])
  dim_of = dict(zip(merged.axes, mesh_key.dim_names))
  return placement_lib.Placement(mesh_key, tuple(
      dim_of[axes] if axes else None for axes in groups), merged)


def merged_mesh_key(mesh, groups):
  """The DTensor mesh of `mesh`'s devices whose dimensions merge `groups`.

  Args:
    mesh: The `Mesh`.
    groups: Tuples of axis names, each axis in one at most.

  Returns:
    `(mesh_key, merged)`: the `mesh_lib.MeshKey` of a mesh with one
    dimension per group, in order, then one per axis of `mesh` no group
    holds, in mesh order; and its `placement_lib.MergedAxes`. A group's
    dimension orders its devices as the grid of its axes does, the first
    major: its position k is the device JAX gives block k of a dimension
    split over those axes.
  """
  named = {name for axes in groups for name in axes}
  groups = tuple(tuple(axes) for axes in groups) + tuple(
      (name,) for name in mesh.axis_names if name not in named)
  position = {name: k for k, name in enumerate(mesh.axis_names)}
  order = [position[name] for axes in groups for name in axes]
  sizes = tuple(math.prod(mesh.shape[name] for name in axes)
                for axes in groups)
  devices = mesh.devices.transpose(order).reshape(sizes)
  dim_of = dict(zip(mesh.axis_names, mesh.dim_names))
  names = tuple(".".join(dim_of[name] for name in axes) for axes in groups)
  if len(set(names)) < len(names):
    names = tuple(mesh_lib.mesh_dim_name(k) for k in range(len(groups)))
  return (mesh_lib.MeshKey(names, sizes, tuple(devices.flat)),
          placement_lib.MergedAxes(mesh, groups))


def sharding_of(placement):
  """The `NamedSharding` of `placement`.

  On a mesh that merges a `Mesh`'s axes, that `Mesh` with a spec naming
  the axes each dimension is split over; otherwise a Mesh named as the
  DTensor mesh. Trailing whole dimensions are left out of the spec, as
  `P('x')` writes what `P('x', None)` does.
  """
  dim_names, sizes, devices = placement.mesh_key
  if placement.merged is None:
    mesh = Mesh(np.array(devices, dtype=object).reshape(sizes), dim_names)
    spec = list(placement.spec)
  else:
    mesh = placement.merged.mesh
    axes_of = dict(zip(dim_names, placement.merged.axes))
    spec = [None if dim is None else
            axes_of[dim][0] if len(axes_of[dim]) == 1 else axes_of[dim]
            for dim in placement.spec]
  while spec and spec[-1] is None:
    spec.pop()
  return NamedSharding(mesh, PartitionSpec(*spec))
