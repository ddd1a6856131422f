"""Arrays of devices for a `Mesh`: JAX's `jax.experimental.mesh_utils`.

JAX orders a TPU's devices by their place in its physical topology (its
chips' torus); TensorFlow gives tfspmd no topology, so devices go into a
mesh in the order given (`tfspmd.devices()`: by id, each process's devices
together). A hybrid mesh puts each process's devices in one block, so that
the axes of `mesh_shape` stay within a host (ICI on a TPU pod) and those of
`dcn_mesh_shape` go between hosts (the data-centre network).
"""

from __future__ import annotations

from collections.abc import Sequence
import math

import numpy as np

from tfspmd._src.runtime import devices as devices_lib


def checked_shape(shape, name, function, smallest=1):
  """`shape` as a tuple of ints of at least `smallest`, or a TypeError.

  The error names `function`'s argument `name`.
  """
  try:
    shape = tuple(shape)
  except TypeError:
    shape = None
  if shape is None or not all(
      isinstance(n, (int, np.integer)) and not isinstance(n, bool) and
      n >= smallest for n in shape):
    kind = "positive" if smallest == 1 else "non-negative"
    raise TypeError(f"{function}: `{name}` must be a sequence of {kind} "
                    f"ints, got {shape!r}.")
  return tuple(int(n) for n in shape)


def _checked_devices(devices, function):
  devices = list(devices_lib.devices() if devices is None else devices)
  if not devices or not all(isinstance(d, devices_lib.Device)
                            for d in devices):
    raise TypeError(f"{function}: `devices` must be tfspmd devices "
                    f"(tfspmd.devices()), at least one.")
  if len(set(devices)) != len(devices):
    raise ValueError(f"{function}: a device appears more than once in "
                     f"`devices`.")
  return devices


def _checked_flags(function, **flags):
  for name, value in flags.items():
    if not isinstance(value, bool):
      raise TypeError(f"{function}: `{name}` must be a bool, got {value!r}.")


def create_device_mesh(
    mesh_shape: Sequence[int],
    devices: Sequence[devices_lib.Device] | None = None, *,
    contiguous_submeshes: bool = False,
    allow_split_physical_axes: bool = False) -> np.ndarray:
  """The devices as an array of `mesh_shape`, for `tfspmd.Mesh`.

  Args:
    mesh_shape: The size of each mesh axis; their product is the number of
      devices.
    devices: The devices, in order (default: `tfspmd.devices()`).
    contiguous_submeshes: JAX's option for a TPU's physical layout: taken,
      with no effect (no topology to follow).
    allow_split_physical_axes: As `contiguous_submeshes`.

  Returns:
    A NumPy array of shape `mesh_shape` holding the devices in order.

  Raises:
    ValueError: If the mesh does not hold exactly the devices.

  Example:
    >>> import tfspmd
    >>> from tfspmd.experimental import mesh_utils
    >>> grid = mesh_utils.create_device_mesh((2, 4))
    >>> grid.shape, grid[1, 0]
    ((2, 4), Device(platform='cpu', id=4))
    >>> tfspmd.Mesh(grid, ('data', 'model'))
    Mesh({'data': 2, 'model': 4})
  """
  function = "create_device_mesh"
  mesh_shape = checked_shape(mesh_shape, "mesh_shape", function)
  devices = _checked_devices(devices, function)
  _checked_flags(function, contiguous_submeshes=contiguous_submeshes,
                 allow_split_physical_axes=allow_split_physical_axes)
  if math.prod(mesh_shape) != len(devices):
    raise ValueError(
        f"{function}: a mesh of shape {mesh_shape} holds "
        f"{math.prod(mesh_shape)} devices, but {len(devices)} were given; "
        f"the product of the axis sizes must be the number of devices.")
  grid = np.empty(len(devices), dtype=object)
  grid[:] = devices
  return grid.reshape(mesh_shape)


def create_hybrid_device_mesh(
    mesh_shape: Sequence[int], dcn_mesh_shape: Sequence[int],
    devices: Sequence[devices_lib.Device] | None = None, *,
    process_is_granule: bool = False,
    should_sort_granules_by_key: bool = True,
    allow_split_physical_axes: bool = False) -> np.ndarray:
  """A mesh of processes, each a block of `mesh_shape` of its own devices.

  Each process's devices (JAX's granule: a TPU slice, or a process) form a
  block laid out as `create_device_mesh(mesh_shape)` lays it out, and the
  blocks lie in a grid of `dcn_mesh_shape`, processes in order: the mesh's
  axis k has size `mesh_shape[k] * dcn_mesh_shape[k]`, and along it the
  blocks come first (position p * mesh_shape[k] + q is device q of block p).

  Args:
    mesh_shape: Each axis's size within a process.
    dcn_mesh_shape: Each axis's size across processes; its product is the
      number of processes holding `devices`.
    devices: The devices (default: `tfspmd.devices()`).
    process_is_granule: JAX's choice between slices and processes; tfspmd's
      granules are always processes, so it has no effect.
    should_sort_granules_by_key: Whether to order the processes by index
      (True), or by where their first device comes in `devices`.
    allow_split_physical_axes: Taken, with no effect.

  Returns:
    A NumPy array of devices of shape `mesh_shape * dcn_mesh_shape`.

  Raises:
    ValueError: If the shapes have different lengths, or do not fit the
      processes and their devices.

  Example:
    >>> from tfspmd.experimental import mesh_utils
    >>> mesh_utils.create_hybrid_device_mesh((2, 4), (1, 1)).shape
    (2, 4)
  """
  function = "create_hybrid_device_mesh"
  mesh_shape = checked_shape(mesh_shape, "mesh_shape", function)
  dcn_mesh_shape = checked_shape(dcn_mesh_shape, "dcn_mesh_shape", function)
  devices = _checked_devices(devices, function)
  _checked_flags(function, process_is_granule=process_is_granule,
                 should_sort_granules_by_key=should_sort_granules_by_key,
                 allow_split_physical_axes=allow_split_physical_axes)
  if len(mesh_shape) != len(dcn_mesh_shape):
    raise ValueError(
        f"{function}: `mesh_shape` {mesh_shape} and `dcn_mesh_shape` "
        f"{dcn_mesh_shape} must have one size per mesh axis each.")
  granules = {}
  for device in devices:
    granules.setdefault(device.process_index, []).append(device)
  order = sorted(granules) if should_sort_granules_by_key else list(granules)
  if len(order) != math.prod(dcn_mesh_shape):
    raise ValueError(
        f"{function}: `dcn_mesh_shape` {dcn_mesh_shape} lays out "
        f"{math.prod(dcn_mesh_shape)} processes, but the devices belong to "
        f"{len(order)} (processes {order}).")
  for process in order:
    if len(granules[process]) != math.prod(mesh_shape):
      raise ValueError(
          f"{function}: process {process} holds {len(granules[process])} of "
          f"the devices, but a block of `mesh_shape` {mesh_shape} holds "
          f"{math.prod(mesh_shape)}.")
  blocks = [create_device_mesh(mesh_shape, granules[process])
            for process in order]
  rank = len(mesh_shape)
  # (dcn..., mesh...) -> (dcn_0, mesh_0, dcn_1, mesh_1, ...): each axis runs
  # over the blocks first, then within a block.
  grid = np.stack(blocks).reshape(dcn_mesh_shape + mesh_shape)
  grid = grid.transpose([k for axis in range(rank) for k in (axis,
                                                              rank + axis)])
  return grid.reshape([d * m for d, m in zip(dcn_mesh_shape, mesh_shape)])
