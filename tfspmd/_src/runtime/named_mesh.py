"""Meshes of named axes and the partition specs that split arrays over them.

A `Mesh` arranges devices in an array whose axes have names, as JAX's
`jax.sharding.Mesh`; a `PartitionSpec` says, for each dimension of an
array, which mesh axes split it. The DTensor mesh a `Mesh` stands for has
one dimension per axis, named as the axis is, so DTensor code lays data out
on it with the names shard_map's specs use.
"""

from __future__ import annotations

from collections.abc import Hashable
from collections.abc import Sequence
import enum
import math
import threading
import types
from typing import Any

import numpy as np
from tensorflow.experimental import dtensor

from tfspmd._src.runtime import axis_env
from tfspmd._src.runtime import devices as devices_lib
from tfspmd._src.runtime import mesh as mesh_lib


class PartitionSpec(tuple):
  """For each array dimension: None, a mesh axis name, or a tuple of names.

  A dimension split over a tuple of axes is split over their product, the
  first name major. Dimensions past the end of the spec are not split.

  Example:
    >>> import tfspmd
    >>> P = tfspmd.PartitionSpec
    >>> P('data', None), P(('data', 'model'))
    (PartitionSpec('data', None), PartitionSpec(('data', 'model')))
  """

  def __new__(
      cls, *entries: Hashable | tuple[Hashable, ...] | list[Hashable] | None
  ) -> PartitionSpec:
    # A list of names splits a dimension as their tuple does, as in JAX.
    return super().__new__(cls, tuple(
        tuple(entry) if isinstance(entry, list) else entry
        for entry in entries))

  def __repr__(self) -> str:
    return f"PartitionSpec{tuple.__repr__(self)}" if len(self) != 1 else (
        f"PartitionSpec({self[0]!r})")

  def axes_of(self, dimension: int) -> tuple[Hashable, ...]:
    """The mesh axis names splitting `dimension`, major first."""
    if dimension >= len(self):
      return ()
    entry = self[dimension]
    if entry is None:
      return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


class AxisType(enum.Enum):
  """JAX's kinds of mesh axis, which a `Mesh` records.

  In JAX they say whether `jax.jit` places arrays along the axis itself
  (`Auto`), keeps the placement in each array's type (`Explicit`) or leaves
  it to the program (`Manual`). tfspmd places arrays only by `device_put`,
  pmap and shard_map, which treat every kind alike.

  Example:
    >>> import tfspmd
    >>> from tfspmd.sharding import AxisType
    >>> mesh = tfspmd.make_mesh((4, 2), ('x', 'y'),
    ...                         (AxisType.Auto, AxisType.Auto))
    >>> mesh.axis_types
    (Auto, Auto)
  """

  Auto = enum.auto()
  Explicit = enum.auto()
  Manual = enum.auto()

  def __repr__(self) -> str:
    return self.name


def _as_axis_names(axis_names):
  """A tuple of names: one name (such as 'x') stands for a tuple of it."""
  if isinstance(axis_names, (str, bytes)) or not isinstance(
      axis_names, (tuple, list)):
    return (axis_names,)
  return tuple(axis_names)


def _checked_axis_types(axis_types, axis_names, default, caller):
  if axis_types is None:
    return (default,) * len(axis_names)
  if isinstance(axis_types, AxisType):
    axis_types = (axis_types,)
  try:
    axis_types = tuple(axis_types)
  except TypeError:
    axis_types = (axis_types,)  # not a sequence: the check below names it
  if (len(axis_types) != len(axis_names) or
      not all(isinstance(t, AxisType) for t in axis_types)):
    raise ValueError(
        f"{caller}: `axis_types` must hold one tfspmd.sharding.AxisType per "
        f"axis name {axis_names}, got {axis_types!r}.")
  return axis_types


# The mesh of this thread's context (`tfspmd.set_mesh`, `with mesh:`): per
# thread, as JAX's is, so threads running programs over different meshes do
# not see each other's.
_context = threading.local()


def context_mesh() -> Mesh | None:
  """The mesh set for this thread's context, or None."""
  return getattr(_context, "mesh", None)


def set_context_mesh(mesh: Mesh | None) -> None:
  _context.mesh = mesh


class Mesh:
  """Devices in an array whose axes have names.

  In a `with` block, the mesh is the context's mesh, as `tfspmd.set_mesh`
  sets it, until the block ends (JAX's older `with mesh:` form).

  Args:
    devices: A NumPy array (or nested list) of `tfspmd.Device`s, one axis
      per name.
    axis_names: A name for each axis of `devices`.
    axis_types: An `AxisType` per axis (by default `AxisType.Auto`, as in
      JAX); recorded in `axis_types`, with the same behaviour for each.

  Example:
    >>> import numpy as np, tfspmd
    >>> mesh = tfspmd.Mesh(np.array(tfspmd.devices()).reshape(2, 4),
    ...                    ('data', 'model'))
    >>> mesh.shape, mesh.size
    ({'data': 2, 'model': 4}, 8)
    >>> double = tfspmd.shard_map(lambda b: b * 2, in_specs=tfspmd.P('data'),
    ...                           out_specs=tfspmd.P('data'))
    >>> with mesh:
    ...   print(np.asarray(double(np.arange(4.))))
    [0. 2. 4. 6.]
  """

  def __init__(self, devices: Any,
               axis_names: Hashable | Sequence[Hashable],
               axis_types: AxisType | Sequence[AxisType] | None = None) -> None:
    devices = np.array(devices, dtype=object)
    axis_names = _as_axis_names(axis_names)
    if devices.ndim != len(axis_names):
      raise ValueError(
          f"Mesh: `devices` has {devices.ndim} axes (shape {devices.shape}) "
          f"but {len(axis_names)} axis names were given: {axis_names}.")
    for name in axis_names:
      if name is None:
        raise TypeError(f"Mesh: axis names must not be None, got {axis_names}.")
      axis_env.checked_axis_name(name, None, "Mesh")
    if len(set(axis_names)) != len(axis_names):
      raise ValueError(f"Mesh: axis names repeat: {axis_names}.")
    flat = list(devices.flat)
    if not flat or not all(isinstance(d, devices_lib.Device) for d in flat):
      raise TypeError(
          "Mesh: `devices` must be an array of tfspmd devices (from "
          "tfspmd.devices()), at least one.")
    if len(set(flat)) != len(flat):
      raise ValueError("Mesh: a device appears more than once in `devices`.")
    self._devices = devices
    self._axis_names = axis_names
    self._axis_types = _checked_axis_types(axis_types, axis_names,
                                           AxisType.Auto, "Mesh")

  @property
  def axis_names(self) -> tuple[Hashable, ...]:
    return self._axis_names

  @property
  def axis_types(self) -> tuple[AxisType, ...]:
    return self._axis_types

  @property
  def shape(self) -> dict[Hashable, int]:
    """A dict from axis name to size, in axis order."""
    return dict(zip(self._axis_names, self._devices.shape))

  @property
  def size(self) -> int:
    return self._devices.size

  @property
  def devices(self) -> np.ndarray:
    return self._devices

  @property
  def local_devices(self) -> list[devices_lib.Device]:
    """This process's devices of the mesh, in mesh order.

    Example:
      >>> import tfspmd
      >>> tfspmd.make_mesh((4, 2), ('x', 'y')).local_devices[:2]
      [Device(platform='cpu', id=0), Device(platform='cpu', id=1)]
    """
    here = devices_lib.process_index()
    return [device for device in self._devices.flat
            if device.process_index == here]

  @property
  def dim_names(self) -> tuple[Hashable, ...]:
    """The DTensor mesh dimension of each axis, in axis order.

    The axis names, when DTensor takes each of them (`dtensor_mesh`);
    otherwise `axis_0`, `axis_1`, ... by position, for every axis.
    """
    if any(mesh_lib.dim_name_problem(name) for name in self._axis_names):
      return tuple(mesh_lib.mesh_dim_name(k)
                   for k in range(self._devices.ndim))
    return self._axis_names

  @property
  def mesh_key(self) -> mesh_lib.MeshKey:
    """The dim names, sizes and devices: the arguments of `mesh_for_axes`."""
    return mesh_lib.MeshKey(self.dim_names, tuple(self._devices.shape),
                            tuple(self._devices.flat))

  @property
  def dtensor_mesh(self) -> dtensor.Mesh:
    """The `tf.experimental.dtensor.Mesh` of the same devices and shape.

    Its dimensions have the mesh's axis names, so
    `dtensor.Layout(['data', dtensor.UNSHARDED], mesh.dtensor_mesh)` splits
    a value as `P('data', None)` does, and shard_map's programs run on this
    very mesh: DTensors laid out on it go in and come out with no copy.

    Raises:
      ValueError: If an axis name cannot name a DTensor mesh dimension: a
        name that is not a str, is 'unsharded', 'any' or 'match', or holds a
        character other than letters, digits, '_', '-' and '.'. shard_map
        still runs over such a mesh, on a DTensor mesh whose dimensions are
        named `axis_0`, `axis_1`, ... (its results' `dtensor_value` lie
        there).
    """
    for name in self._axis_names:
      problem = mesh_lib.dim_name_problem(name)
      if problem is not None:
        raise ValueError(
            f"Mesh.dtensor_mesh: the axis name {name!r} cannot name a DTensor "
            f"mesh dimension: {problem}. Name the mesh's axes with such "
            f"strings (tfspmd.make_mesh(shape, ('data', 'model'))) to lay "
            f"out DTensors on it.")
    return mesh_lib.mesh_for_axes(*self.mesh_key)

  def __enter__(self) -> Mesh:
    entered = _context.__dict__.setdefault("entered", [])
    entered.append(context_mesh())
    _context.mesh = self
    return self

  def __exit__(self, exc_type: type[BaseException] | None,
               exc_value: BaseException | None,
               traceback: types.TracebackType | None) -> None:
    _context.mesh = _context.entered.pop()

  def __eq__(self, other: object) -> bool:
    return (isinstance(other, Mesh) and self._axis_names == other._axis_names
            and self.mesh_key == other.mesh_key)

  def __hash__(self) -> int:
    return hash((self._axis_names, self.mesh_key))

  def __repr__(self) -> str:
    axes = ", ".join(f"{name!r}: {size}" for name, size in self.shape.items())
    return f"Mesh({{{axes}}})"


def check_spec_axes(spec: PartitionSpec, mesh: Mesh, named: str) -> None:
  """Raises unless each axis `spec` names is one of `mesh`'s, named once.

  Args:
    spec: The partition spec.
    mesh: The mesh it splits values over.
    named: What the messages call the spec ("shard_map: in spec P('x') for
      args[0]").
  """
  seen = set()
  for dimension in range(len(spec)):
    for name in spec.axes_of(dimension):
      if name not in mesh.shape:
        raise ValueError(
            f"{named} names the axis {name!r}, which is not an axis of the "
            f"mesh (axes: {mesh.axis_names}).")
      if name in seen:
        raise ValueError(
            f"{named} names the mesh axis {name!r} twice; each mesh axis may "
            f"split one dimension.")
      seen.add(name)


def make_mesh(axis_shapes: Sequence[int],
              axis_names: Hashable | Sequence[Hashable],
              axis_types: AxisType | Sequence[AxisType] | None = None, *,
              devices: Sequence[devices_lib.Device] | None = None) -> Mesh:
  """A `Mesh` of the given shape over the first devices (or `devices`).

  `axis_types` are recorded in the mesh (by default `AxisType.Explicit`,
  as `jax.make_mesh` gives), with the same behaviour for each.

  Example:
    >>> import tfspmd
    >>> tfspmd.make_mesh((2, 4), ('data', 'model'))
    Mesh({'data': 2, 'model': 4})
  """
  try:
    axis_shapes = tuple(int(s) for s in axis_shapes)
  except TypeError:
    raise TypeError(
        f"make_mesh: `axis_shapes` must be a sequence of ints, got "
        f"{axis_shapes!r}.") from None
  if any(s < 1 for s in axis_shapes):
    raise ValueError(
        f"make_mesh: every axis size must be at least 1, got {axis_shapes}.")
  count = math.prod(axis_shapes)
  available = list(devices_lib.devices() if devices is None else devices)
  if devices is not None and len(available) != count:
    raise ValueError(
        f"make_mesh: a mesh of shape {axis_shapes} needs {count} devices, "
        f"{len(available)} were given.")
  if len(available) < count:
    more = (
        f"On CPU, split it into {count} logical devices before TensorFlow "
        f"starts: set {devices_lib.NUM_CPU_DEVICES_ENV}={count} in the "
        f"environment, or call tfspmd.set_num_cpu_devices({count}) before "
        f"any TensorFlow op runs."
        if all(d.platform == "cpu" for d in available) else
        "Use a smaller mesh, or run on a machine (or several processes, "
        "`tfspmd.distributed.initialize`) with more devices.")
    raise ValueError(
        f"make_mesh: a mesh of shape {axis_shapes} needs {count} devices, "
        f"only {len(available)} are available. {more}")
  axis_types = _checked_axis_types(axis_types, _as_axis_names(axis_names),
                                   AxisType.Explicit, "make_mesh")
  return Mesh(np.array(available[:count], dtype=object).reshape(axis_shapes),
              axis_names, axis_types)
