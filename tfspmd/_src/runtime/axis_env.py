"""The axis environment: which named axes are bound while a program is traced.

Each pmap (and vmap) level being traced pushes a `Frame` holding its axis
name, its size and its pfor loop index. Collectives look their axis names up
here; an unbound name is a NameError at trace time, as in JAX.

A top-level pmap also opens a `TraceState` for the whole trace, where nested
pmaps register their axes (they become further mesh dimensions) and record
which inputs and outputs they split, so the top level can place those on the
mesh split the same way.
"""

import contextlib
import dataclasses
from typing import NamedTuple

import tensorflow as tf

from tfspmd._src.core import merged_dims
from tfspmd._src.core import trace_context
from tfspmd._src.runtime import mesh as mesh_lib

# This thread's traces (`trace_context`).
_context = trace_context.this_thread


@dataclasses.dataclass
class Frame:
  """One bound axis.

  Attributes:
    name: The user's axis name (any hashable), or a private object.
    size: The number of positions along the axis.
    index: The pfor loop variable of this axis (a scalar int32 tensor).
    mesh_dim: The DTensor mesh dimension of a pmap axis; None for vmap.
    run_collective: For an axis whose devices run as threads rather than
      positions of a pfor loop (debug mode): `run_collective(value, targets,
      step, function)` meets the other devices and returns this device's
      result of a collective over `targets`. None where pfor converts it.
  """
  name: object
  size: int
  index: object
  mesh_dim: str = None
  run_collective: object = None


@dataclasses.dataclass(frozen=True)
class Origin:
  """Where a per-device tensor of a trace comes from: an input leaf.

  Attributes:
    leaf: The input leaf's position among the program's inputs.
    axes: For each axis of the tensor, the leaf's axis it is (the leaf's
      mapped axes are gone from the tensor).
  """
  leaf: int
  axes: tuple


class Crossing(NamedTuple):
  """The sizes of a nested axis that crosses processes.

  Attributes:
    local: How many of its positions each process's inputs hold.
    size: Its global size.
  """
  local: int
  size: int


@dataclasses.dataclass
class TraceState:
  """What a top-level pmap learns while tracing its program.

  Attributes:
    mesh_axes: The `mesh.MeshAxis` of every pmap level, outermost first;
      nested pmaps append theirs.
    max_devices: How many devices the nested product may use.
    input_splits: leaf -> {original axis: mesh_dim} found by nested pmaps.
    devices: The devices the program's mesh is made of.
    lays_out: Whether the program places its values on the mesh (DTensor
      relayouts). A program traced into a user's `tf.function` does not: the
      same graph runs on plain tensors on one device as well as on DTensors,
      and only DTensor can run a relayout.
    parts: Whether the inputs may be this process's parts along nested
      axes (a pmap's with several processes): a nested pmap's `axis_size`
      is then the global size of its axis, of which the inputs may hold
      this process's positions only (`pmap_nested.CrossingAxis`).
    crossing: depth -> the `Crossing` of each nested axis found by earlier
      traces to cross processes.
    given_devices: Whether the top-level pmap was given `devices=`: its
      nested pmaps' grid is then not over `tfspmd.devices()`.
    host: Whether the host executor runs the program (XLA's kernels, which
      compute an integer division by zero: `integer_division`).
  """
  mesh_axes: list
  max_devices: int
  input_splits: dict = dataclasses.field(default_factory=dict)
  devices: tuple = ()
  lays_out: bool = True
  parts: bool = False
  crossing: dict = dataclasses.field(default_factory=dict)
  given_devices: bool = False
  host: bool = False
  # A per-device tensor's `Origin`, and a nested pmap result's splits
  # `{axis: mesh_dim}`, by the tensor's `ref()`.
  _origins: dict = dataclasses.field(default_factory=dict)
  _output_splits: dict = dataclasses.field(default_factory=dict)

  def record_origin(self, tensor, leaf, axes):
    """Notes that `tensor` is input `leaf` with only its axes `axes` left."""
    self._origins[tensor.ref()] = Origin(leaf, tuple(axes))

  def origin_of(self, tensor):
    """The `Origin` of `tensor`, or None if it is no input leaf's part."""
    if not isinstance(tensor, tf.Tensor):
      return None
    return self._origins.get(tensor.ref())

  def record_output_splits(self, tensor, splits):
    """Notes that the nested pmap result `tensor` is split as `splits`."""
    self._output_splits[tensor.ref()] = splits

  def mesh_key(self):
    """`(dims, sizes, devices)` of the mesh of the axes registered so far."""
    return mesh_lib.mesh_key(self.mesh_axes, self.devices)

  def layout(self, spec):
    """A DTensor layout on the program's mesh, from inside its trace.

    Collectives lay out values while the outer pfor converts them, after
    the whole per-device function (and every nested pmap in it) is traced,
    so the axes registered by then are all of the program's.
    """
    return mesh_lib.layout_on(self.mesh_key(), spec)

  def result_splits(self, per_device, axis, mesh_dim):
    """`{axis: mesh_dim}` of a mapped result, with its nested pmaps' splits.

    Args:
      per_device: The per-device value the mapped function returned.
      axis: Where the result puts the mapped axis.
      mesh_dim: The mesh dimension of that axis.
    """
    splits = {axis: mesh_dim}
    found = (self._output_splits.get(per_device.ref())
             if isinstance(per_device, tf.Tensor) else None)
    for inner_axis, dim in (found or {}).items():
      splits[inner_axis + (inner_axis >= axis)] = dim
    return splits

  def slice_tracker(self, values, axes):
    """`on_slice` for a nested map of `values` along `axes`.

    A slice of a tensor that is an input leaf with axes mapped away is
    itself such a tensor, with one axis fewer, so a pmap nested deeper can
    still say which input axis it splits.
    """

    def on_slice(leaf, piece, _):
      origin = self.origin_of(values[leaf])
      if origin is not None:
        self.record_origin(piece, origin.leaf, [
            a for k, a in enumerate(origin.axes) if k != axes[leaf]])

    return on_slice


def frames():
  """The bound axes, outermost first."""
  return tuple(_context.frames)


def split_leading_dims():
  """How many leading dimensions of a value traced now lie split over devices.

  0 inside a per-device function; while a pmap level is vectorized (its
  own frame no longer bound), the stacked dimensions of its axis and of
  the levels inside it: one per mesh dimension not bound by an enclosing
  level. A reshape that merged one of them would move data between the
  devices.
  """
  state = _context.trace
  if state is None:
    return 0
  return max(len(state.mesh_axes) - len(_context.frames), 0)


merged_dims.split_leading_dims = split_leading_dims


def trace_state():
  """The `TraceState` of the top-level pmap being traced, or None."""
  return _context.trace


@contextlib.contextmanager
def bound_axis(frame):
  """Binds `frame`'s axis name while the body traces."""
  _context.frames.append(frame)
  try:
    yield frame
  finally:
    _context.frames.pop()


@contextlib.contextmanager
def tracing(state):
  """Opens the trace of a top-level pmap."""
  saved_frames, saved_trace = _context.frames, _context.trace
  _context.frames, _context.trace = [], state
  try:
    yield state
  finally:
    _context.frames, _context.trace = saved_frames, saved_trace


def check_not_bound(axis_name, transform):
  """Raises if an enclosing map already binds `axis_name`."""
  for frame in _context.frames:
    if frame.name == axis_name:
      raise ValueError(
          f"{transform}: axis name {_describe(axis_name)} is already bound by "
          f"an enclosing pmap or vmap; give the nested {transform} another "
          f"axis_name.")


def _describe(name):
  return repr(name) if not isinstance(name, _PrivateAxis) else str(name)


def unbound_axis_error(name, function):
  bound = [_describe(frame.name) for frame in _context.frames]
  if bound:
    where = ("The following axis names (bound by enclosing pmaps and vmaps) "
             f"are available: {', '.join(bound)}.")
  else:
    where = ("No axis is bound here: collectives run only inside a function "
             "mapped by tfspmd.pmap or tfspmd.vmap with that axis_name.")
  return NameError(f"{function}: unbound axis name: {_describe(name)}. {where}")


def normalize_axis_names(axis_name, function):
  """Checks `axis_name` (a name or a tuple of names) and returns frames.

  Returns:
    A tuple of the bound `Frame`s named, in the order given.

  Raises:
    NameError: If a name is not bound by an enclosing pmap or vmap.
    ValueError: If a name appears twice.
  """
  names = axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,)
  by_name = {}
  for frame in _context.frames:
    by_name[frame.name] = frame
  found = []
  for name in names:
    try:
      frame = by_name.get(name)
    except TypeError:
      raise TypeError(
          f"{function}: `axis_name` must be hashable, got {name!r}.") from None
    if frame is None:
      raise unbound_axis_error(name, function)
    if any(f is frame for f in found):
      raise ValueError(
          f"{function}: `axis_name` names axis {_describe(name)} twice: "
          f"{axis_name!r}.")
    found.append(frame)
  return tuple(found)


class _PrivateAxis:
  """The axis name of a pmap given no `axis_name`: equal only to itself."""

  __slots__ = ("_label",)

  def __init__(self, label):
    self._label = label

  def __repr__(self):
    return f"<unnamed axis of {self._label}>"


def checked_axis_name(axis_name, fun, transform):
  """`axis_name` if hashable; for None, a private name only `fun`'s map binds."""
  if axis_name is None:
    return private_axis_name(getattr(fun, "__name__", type(fun).__name__))
  try:
    hash(axis_name)
  except TypeError:
    raise TypeError(
        f"{transform}: `axis_name` must be hashable, got {axis_name!r}."
    ) from None
  if isinstance(axis_name, tuple):
    # A collective reads a tuple as several axes: this one could not be named.
    two_axes = ("give the mesh two axes" if transform == "Mesh" else
                f"nest two {transform}s")
    raise TypeError(
        f"{transform}: `axis_name` is the tuple {axis_name!r}, but a "
        f"collective reads a tuple as several axis names, so no collective "
        f"could name this axis (jax.pmap refuses it too). Give one name, such "
        f"as a string; for two axes, {two_axes} and name each.")
  return axis_name


def private_axis_name(label):
  return _PrivateAxis(label)
