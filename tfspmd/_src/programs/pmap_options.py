"""What a pmap was asked to do, checked once when the pmap is made.

`PmapOptions` holds a pmap's arguments after checking, and answers the
questions every call path asks of them: which devices a call's mesh is made
of, and which share of the mapped axis this process holds.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
import dataclasses
from typing import Any

from tfspmd._src.arguments import arguments
from tfspmd._src.arguments import mapped_args
from tfspmd._src.arguments import out_axes as out_axes_lib
from tfspmd._src.programs import steps as steps_lib
from tfspmd._src.runtime import axis_env
from tfspmd._src.runtime import devices as devices_lib


@dataclasses.dataclass(frozen=True)
class PmapOptions:
  """A pmap's checked arguments.

  Attributes:
    fun: The per-device function.
    axis_name: The name of the mapped axis.
    args: The `mapped_args.MappedArguments` that binds a call's arguments.
    out_axes: The user's out_axes.
    steps: Steps per call (`pmap(steps=K)`), or None.
    devices: The `Device`s given with `devices=`, or None.
    backend: The backend asked for, or None.
    donate_argnums: Positions of donated arguments.
    debug: Whether the pmap runs in debug mode.
    jit_compile: Whether the host executor compiles the program with XLA.
    level: For the pmap of a shard_map's mesh axis, its `ShardMapLevel`;
      None for a plain pmap.
  """
  fun: Callable[..., Any]
  axis_name: Hashable
  args: mapped_args.MappedArguments
  out_axes: Any
  steps: int | None
  devices: tuple[devices_lib.Device, ...] | None
  backend: str | None
  donate_argnums: tuple[int, ...]
  debug: bool
  level: ShardMapLevel | None
  jit_compile: bool = True

  @property
  def mesh_dim(self):
    """The mesh dimension a shard_map gives this axis, or None (by depth)."""
    return None if self.level is None else self.level.mesh_dim

  def varying_output_error(self, path, axis_name):
    """The error for an out_axes=None output `path` that varies.

    None where the output takes the first device's value instead (a
    shard_map with `check_vma=False`).
    """
    if self.level is None:
      return out_axes_lib.varying_output_error(path, axis_name)
    if not self.level.check_invariant:
      return None
    return ValueError(
        f"shard_map: {path} varies along the mesh axis {axis_name!r}, which "
        f"its out spec does not name, so the devices along it would return "
        f"different values for one block. Name {axis_name!r} in the out "
        f"spec, or make the output the same along it (psum or pmean over "
        f"{axis_name!r}, for example).")

  def process_share(self):
    """`(local, total)`: this process maps over `local / total` of the axis.

    A shard_map passes the global arrays (`shard_map_processes`): all of it.
    """
    if self.level is not None:
      return 1, 1
    if self.devices is None:
      return 1, devices_lib.process_count()
    me = devices_lib.process_index()
    return (sum(1 for d in self.devices if d.process_index == me),
            len(self.devices))

  def mesh_devices(self, size):
    """The devices the call's mesh is made of: the given ones, or from all.

    Without `devices=`, each process maps over its first devices
    (`mesh.mesh_key` picks them), as many in every process.
    """
    if self.level is not None and self.level.devices is not None:
      return self.level.devices
    if self.devices is not None:
      local = [d for d in self.devices
               if d.process_index == devices_lib.process_index()]
      if size != len(local):
        raise ValueError(
            f"pmap was given {len(self.devices)} devices ({len(local)} in "
            f"this process), but the mapped axis has size {size}; with "
            f"devices=, the mapped size must equal the number of local "
            f"devices given.")
      return self.devices
    available = devices_lib.local_devices(backend=self.backend)
    if size > len(available):
      raise ValueError(
          f"compiling computation that requires {size} replicas, but only "
          f"{len(available)} devices are available (num_replicas={size}). "
          f"Map over fewer elements, or make more devices: "
          f"{devices_lib.NUM_CPU_DEVICES_ENV} or tfspmd.set_num_cpu_devices "
          f"for CPU.")
    return devices_lib.devices(self.backend)


@dataclasses.dataclass(frozen=True)
class ShardMapLevel:
  """What a shard_map asks of the pmap of one of its mesh axes.

  Attributes:
    mesh_dim: The DTensor mesh dimension of the axis (`Mesh.dim_names`),
      instead of one named by nesting depth, so the program runs on the
      `Mesh`'s own DTensor mesh.
    devices: For the outermost axis, the devices of the whole mesh; None
      for the others.
    check_invariant: Whether an output with out_axes=None that varies along
      the axis is an error (`check_vma=True`); if not, it takes the value of
      the axis's first device.
    function_name: The shard_map's function, as messages name it.
  """
  mesh_dim: str
  devices: Sequence[devices_lib.Device] | None
  check_invariant: bool
  function_name: str = ""


def checked_options(fun, *, axis_name, in_axes=0, out_axes=0,
                    static_broadcasted_argnums=(), devices=None, backend=None,
                    axis_size=None, donate_argnums=(), steps=None, debug=False,
                    level=None, jit_compile=True):
  """`PmapOptions` from `pmap`'s arguments, or the error naming the bad one.

  `level` is given by shard_map only, for the pmap of one of its mesh axes.
  """
  if not callable(fun):
    raise TypeError(f"pmap: `fun` must be callable, got {fun!r}.")
  if not isinstance(debug, bool):
    raise TypeError(
        f"pmap: `debug` must be True or False, got {type(debug).__name__} "
        f"{debug!r}.")
  if not isinstance(jit_compile, bool):
    raise TypeError(
        f"pmap: `jit_compile` must be True or False, got "
        f"{type(jit_compile).__name__} {jit_compile!r}.")
  arguments.check_axis_spec_tree(out_axes, "out_axes")
  static_argnums = _argnums(static_broadcasted_argnums,
                            "static_broadcasted_argnums")
  donated = _argnums(donate_argnums, "donate_argnums")
  overlap = set(static_argnums) & set(donated)
  if overlap:
    raise ValueError(
        f"pmap: arguments {sorted(overlap)} are both static "
        f"(static_broadcasted_argnums) and donated (donate_argnums); a "
        f"static argument has no buffer to donate.")
  args = mapped_args.MappedArguments("pmap", in_axes, static_argnums,
                                     axis_size)
  return PmapOptions(
      fun=fun,
      axis_name=axis_env.checked_axis_name(axis_name, fun, "pmap"),
      args=args,
      out_axes=out_axes,
      steps=steps_lib.check_steps(steps),
      devices=_checked_devices(devices, backend),
      backend=backend,
      donate_argnums=donated,
      debug=debug,
      level=level,
      jit_compile=jit_compile)


def _argnums(value, name):
  if value is None:
    return ()
  if isinstance(value, int) and not isinstance(value, bool):
    return (value,)
  try:
    nums = tuple(value)
  except TypeError:
    raise TypeError(
        f"{name} must be an int or a collection of ints, got {value!r}."
    ) from None
  for num in nums:
    if isinstance(num, bool) or not isinstance(num, int):
      raise TypeError(
          f"{name} must be an int or a collection of ints, got {value!r}.")
  return nums


def _checked_devices(devices, backend):
  if devices is None:
    return None
  try:
    devices = tuple(devices)
  except TypeError:
    raise TypeError(
        f"pmap: `devices` must be a sequence of tfspmd.Device (from "
        f"tfspmd.devices()), got {type(devices).__name__} {devices!r}."
    ) from None
  if not devices:
    raise ValueError("pmap: `devices` is empty; give at least one device or "
                     "leave it None to use the first local devices.")
  for device in devices:
    if not isinstance(device, devices_lib.Device):
      raise TypeError(
          f"pmap: `devices` must hold tfspmd.Device objects (from "
          f"tfspmd.devices()), got {type(device).__name__} {device!r}.")
  if len(set(devices)) != len(devices):
    twice = next(d for d in devices if devices.count(d) > 1)
    raise ValueError(
        f"pmap: `devices` lists {twice!r} twice; give each device once: "
        f"{list(devices)}.")
  platforms = {d.platform for d in devices}
  if len(platforms) > 1:
    raise ValueError(
        f"pmap: `devices` mixes platforms {sorted(platforms)}; all devices of "
        f"a pmap must be of one kind.")
  if backend is not None and devices_lib.resolve_backend(backend) not in platforms:
    raise ValueError(
        f"pmap: backend={backend!r} disagrees with the platform of `devices` "
        f"({platforms.pop()}).")
  return devices
