"""The result type of a pmap: one array whose blocks live on the devices."""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Sequence
import dataclasses
import operator
from typing import Any, TypeAlias

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfspmd._src.core import multiprocess_hooks
from tfspmd._src.executors import dtensor_device
from tfspmd._src.executors import dtensor_values
from tfspmd._src.executors import host as host_executor
from tfspmd._src.executors import selection
from tfspmd._src.executors import small_values
from tfspmd._src.runtime import array_ops
from tfspmd._src.runtime import devices as devices_lib
from tfspmd._src.runtime import function_inputs
from tfspmd._src.runtime import named_sharding
from tfspmd._src.runtime import placement as placement_lib

# What `tf.as_dtype` accepts: tf.float32, np.float32, np.dtype, 'float32'.
DTypeLike: TypeAlias = tf.DType | np.dtype | type | str
# The axes a reduction runs over: one, several, or None for all of them.
Axes: TypeAlias = int | Sequence[int] | None


@dataclasses.dataclass(frozen=True)
class Shard:
  """One device's block of a `ShardedArray`.

  Attributes:
    device: The `Device` holding it.
    index: NumPy index of the block within the array (within this process's
      part, with several processes).
    data: The block, a `tf.Tensor` on that device.

  Example:
    >>> import numpy as np, tfspmd
    >>> out = tfspmd.pmap(lambda x: x + 1)(np.zeros((4, 2), np.float32))
    >>> shard = out.addressable_shards[1]
    >>> shard.device, shard.index, shard.data.shape
    (Device(platform='cpu', id=1), (slice(1, 2, None), slice(None, None, None)), TensorShape([1, 2]))
  """
  device: devices_lib.Device
  index: tuple[slice, ...]
  data: tf.Tensor


def _operator_pair(op):
  """`(a op b, b op a)` methods of ShardedArray `a`, run on the devices."""
  def forward(self, other):
    return self._binary(op, other)  # pylint: disable=protected-access

  def reflected(self, other):
    return self._binary(op, other, reflected=True)  # pylint: disable=protected-access

  return forward, reflected


class ShardedArray:
  """A pmap result: an array split over devices along its mapped axes.

  It converts to NumPy (`np.asarray`, `.numpy()`) and to `tf.Tensor`
  wherever TensorFlow asks for one, indexes per device (`out[5]` is device
  5's row), and goes back into a pmap with no copy when it already lies the
  way that pmap needs.

  With several processes (`tfspmd.distributed`), it is this process's part,
  as in JAX's pmap: its shape, NumPy value, indexing and
  `addressable_shards` (indices within the part) cover only the blocks of
  this process's devices; `dtensor_value` is the DTensor of the whole array.

  A result of the host executor (`tfspmd.config`'s `tfspmd_executor`) is
  held as one buffer of its whole shape in host memory, which the logical
  CPU devices share; its blocks go onto the mesh's devices when first asked
  for (`dtensor_value`, `addressable_shards`), and NumPy reads the buffer
  with no copy.

  Example:
    >>> import numpy as np, tensorflow as tf, tfspmd
    >>> out = tfspmd.pmap(lambda x: x * 2)(tf.range(8))
    >>> out.shape, out.dtype
    (TensorShape([8]), tf.int32)
    >>> print(out)
    [ 0  2  4  6  8 10 12 14]
    >>> int(out[5])
    10
    >>> out.addressable_shards[5].device
    Device(platform='cpu', id=5)
    >>> float(tf.reduce_sum(tf.cast(out, tf.float32)))
    56.0
  """

  __slots__ = ("_value", "_placement", "_shape", "_dtype", "_host",
               "_whole_on_each_device", "_wide", "_other_form", "_expanded",
               "_whole", "_deleted", "__weakref__")

  def __init__(self, value: tf.Tensor, placement: placement_lib.Placement,
               shape: Sequence[int] | tf.TensorShape,
               dtype: DTypeLike, *, wide: bool = False,
               expanded: bool = False) -> None:
    # A small array whole on each device may be held wide (`small_values`),
    # as programs return it; the other form is made when first needed.
    # `expanded`: the DTensor held reports its devices as an expanded
    # program's outputs do (`expanded_inputs`).
    self._value = value
    self._wide = wide
    self._other_form = None
    self._expanded = expanded
    self._placement = placement
    # A TensorShape is never changed in place: a pmap's results share the
    # one its program made when traced.
    self._shape = (shape if isinstance(shape, tf.TensorShape) else
                   tf.TensorShape(shape))
    self._dtype = tf.as_dtype(dtype)
    self._host = None
    self._whole_on_each_device = None
    # The whole array as one tensor on the host (`on_host`); the DTensor
    # `_value` is then made from it when first needed.
    self._whole = None
    self._deleted = False

  @classmethod
  def on_host(cls, whole: tf.Tensor, placement: placement_lib.Placement,
              shape: Sequence[int] | tf.TensorShape,
              dtype: DTypeLike) -> ShardedArray:
    """The array `whole`, a host tensor of its whole shape, as laid out by `placement`.

    Its blocks are placed on the mesh's devices when first asked for.
    """
    array = cls(None, placement, shape, dtype)
    array._whole = whole
    return array

  @classmethod
  def from_whole(cls, whole: Any,
                 placement: placement_lib.Placement) -> ShardedArray:
    """The array `whole` (NumPy or a tensor), laid out by `placement`.

    `whole` is this process's part of the array. Where the host executor
    runs programs on the placement's devices it is held as one tensor on
    the host; elsewhere each device gets its block.
    """
    devices = placement.devices
    if selection.holds_on_host([device.platform for device in devices],
                               devices_lib.process_count()):
      tensor = host_executor.put(whole, devices[0].name)
      return cls.on_host(tensor, placement, tensor.shape, tensor.dtype)
    array = whole.numpy() if isinstance(whole, tf.Tensor) else np.asarray(
        whole)
    value = placement_lib.pack_host_array(array, placement)
    return cls(value, placement, array.shape, value.dtype)

  def _held_on_host(self) -> tf.Tensor | None:
    """The host tensor of the whole array, if it is held so (`on_host`)."""
    self._check_alive()
    return self._whole if self._value is None else None

  def _whole_tensor(self) -> tf.Tensor:
    """The whole array as one tensor on the host (this process's part).

    An array held on the devices is gathered once, and kept.
    """
    if self._whole is None:
      self._whole = tf.convert_to_tensor(self.numpy())
    return self._whole

  @property
  def shape(self) -> tf.TensorShape:
    """The shape of the array (of this process's part, with several)."""
    return self._shape

  @property
  def dtype(self) -> tf.DType:
    """The element type, a `tf.DType`."""
    return self._dtype

  @property
  def ndim(self) -> int:
    return self._shape.rank

  @property
  def size(self) -> int:
    return self._shape.num_elements()

  @property
  def placement(self) -> placement_lib.Placement:
    """How the array lies on its mesh (which axis is split over which dim)."""
    return self._placement

  @property
  def layout(self) -> dtensor.Layout:
    """The DTensor layout of `dtensor_value`.

    An axis the sharding splits over a mesh axis of size 1 is whole on
    every device, and the layout says so (`unsharded`).
    """
    return self._placement.layout

  @property
  def sharding(self) -> named_sharding.NamedSharding:
    """How the array lies on the devices, as a `tfspmd.sharding.NamedSharding`.

    Its mesh is the DTensor mesh the array lies on, its axes named as that
    mesh's dimensions: a shard_map's mesh has the `Mesh`'s axis names (so a
    shard_map result's sharding names the mesh it ran on), a pmap's has one
    axis per nested pmap, named 'axis_0', 'axis_1', ... from the outermost.
    An array a spec split over several mesh axes in one dimension (a
    shard_map result of `out_specs=P(('a', 'b'))`, or `device_put` to such
    a sharding) has the `Mesh` and spec it was given, though its
    `dtensor_value` lies on a DTensor mesh of the same devices whose one
    dimension merges those axes. `tfspmd.device_put(y, x.sharding)` lays `y`
    out as `x`.

    Example:
      >>> import tensorflow as tf, tfspmd
      >>> tfspmd.pmap(lambda x: x)(tf.zeros((2, 3))).sharding
      NamedSharding(mesh=Mesh({'axis_0': 2}), spec=PartitionSpec('axis_0'))
    """
    return named_sharding.sharding_of(self._placement)

  @property
  def dtensor_value(self) -> tf.Tensor:
    """The underlying DTensor, for use with TensorFlow's DTensor API.

    A `tf.function` given it checks its call's inputs as for a ShardedArray
    (`function_inputs`): plain tensors beside it go whole to its devices,
    and arrays on another mesh are named.
    """
    if self._deleted:
      self._check_alive()
    return function_inputs.traced_as_checked(self._live())

  def devices(self) -> tuple[devices_lib.Device, ...]:
    """The devices holding the array, in mesh order."""
    return self._placement.devices

  @property
  def addressable_shards(self) -> list[Shard]:
    """This process's blocks, one `Shard` per local device, in mesh order.

    The order is that of the devices of `sharding.mesh`, as in JAX.
    """
    self._check_alive()
    counts = self._placement.local_counts()
    shards = []
    with multiprocess_hooks.peer_failures():
      components = placement_lib.components(self._live())
    for (device, index), data in zip(self._placement.local_view, components):
      shards.append(Shard(device=device, index=placement_lib.block_slices(
          index, self._shape.as_list(), counts), data=_on(device, data)))
    if self._placement.merged is not None:
      order = {device: k for k, device in
               enumerate(self._placement.merged.mesh.devices.flat)}
      shards.sort(key=lambda shard: order[shard.device])
    return shards

  def addressable_data(self, index: int) -> tf.Tensor:
    """The block of this process's `index`-th device, in mesh order.

    `addressable_shards[index].data`, as JAX's `addressable_data`.

    Example:
      >>> import numpy as np, tfspmd
      >>> out = tfspmd.pmap(lambda x: x * 2)(np.arange(8.))
      >>> out.addressable_data(3)
      <tf.Tensor: shape=(1,), dtype=float64, numpy=array([6.])>
    """
    shards = self.addressable_shards
    try:
      position = operator.index(index)
    except TypeError:
      position = None
    if position is None or not -len(shards) <= position < len(shards):
      raise IndexError(
          f"addressable_data: `index` must be an int in [0, {len(shards)}) "
          f"(this process's devices of the array), got {index!r}.")
    return shards[position].data

  def block_until_ready(self) -> ShardedArray:
    """Waits until the computation producing the array has finished.

    Other Python threads run during the wait (`placement_lib.components`);
    an array split over the devices waits for its own program, one whole
    on every device for every program in flight.
    """
    self._check_alive()
    if self._value is None:
      host_executor.get(self._whole)
      return self
    with multiprocess_hooks.peer_failures():
      placement_lib.components(self._stored())
    return self

  def is_deleted(self) -> bool:
    """True once the array was donated to a pmapped function."""
    return self._deleted

  def delete(self) -> None:
    """Frees the device buffers; any later use raises RuntimeError."""
    self._deleted = True
    self._value = None
    self._whole = None
    self._host = None
    self._whole_on_each_device = None
    self._other_form = None

  def _stored(self):
    """The DTensor as held, on DTensor's current device (`current`).

    An array held on the host is placed on its mesh's devices first.
    """
    if self._value is None:
      # Placed eagerly, also where a function that closes over it traces.
      with tf.init_scope():
        self._value = placement_lib.pack_host_array(
            host_executor.get(self._whole), self._placement)
    value = dtensor_device.current(self._value)
    if value is not self._value:
      self._value, self._expanded = value, False
    return value

  def _is_expanded(self, value):
    """Whether `value` is the DTensor held, reporting devices as expanded."""
    return value is self._value and self._expanded

  def _hold_expanded(self, value, relabelled):
    """Holds `relabelled`, the held DTensor `value` reporting as expanded."""
    if value is self._value:
      self._value, self._expanded = relabelled, True

  def _live(self):
    """The DTensor of the array's shape, on DTensor's current device."""
    if not self._wide:
      return self._stored()
    if self._other_form is None:
      self._other_form = dtensor_values.entered(
          small_values.narrowed, self._stored(), self._shape.as_list())
    self._other_form = dtensor_device.current(self._other_form)
    return self._other_form

  def _wide_value(self, placement: placement_lib.Placement) -> tf.Tensor:
    """The array's wide DTensor (`small_values`) on `placement`'s mesh.

    For a small array whole on each device, going into a program;
    `placement` is where the program takes it, on the same devices.
    """
    if self._wide:
      wide = self._stored()
    else:
      if self._other_form is None:
        self._other_form = dtensor_values.entered(small_values.widened,
                                                  self._stored())
      wide = self._other_form = dtensor_device.current(self._other_form)
    return small_values.on_mesh(wide, placement.mesh)

  def _check_alive(self):
    """Raises if the array was donated, or is used inside a trace."""
    if self._deleted:
      raise RuntimeError(
          f"This ShardedArray (shape {self._shape.as_list()}, {self._dtype.name}) "
          f"has been deleted: it was donated to a pmapped function through "
          f"`donate_argnums`, which frees it. Keep the function's result "
          f"instead, or do not donate an argument you use again.")
    if not tf.executing_eagerly():
      raise TypeError(
          f"A ShardedArray (shape {self._shape.as_list()}, "
          f"{self._dtype.name}) is used while a function is traced (a "
          f"pmap's, a vmap's or a tf.function's), most likely captured by "
          f"closure. It lives on the devices and enters a traced function "
          f"only as an argument: pass it to the pmap (in_axes=None gives "
          f"every device all of it, a mapped axis each device its block), or "
          f"to your own tf.function as an argument.")

  def numpy(self) -> np.ndarray:
    """The array as a NumPy array (this process's part, with several)."""
    self._check_alive()
    if self._host is None and self._whole is not None:
      self._host = host_executor.get(self._whole)
    if self._host is None:
      with multiprocess_hooks.peer_failures():
        if self._wide:
          self._host = small_values.narrow_host(
              placement_lib.components(self._stored())[0].numpy(),
              self._shape.as_list())
        else:
          self._host = placement_lib.assemble(
              self._live(), self._placement, self._shape.as_list(),
              self._dtype.as_numpy_dtype)
      self._host.flags.writeable = False
    return self._host

  def __array__(self, dtype=None, copy=None):
    array = self.numpy()
    if dtype is not None and np.dtype(dtype) != array.dtype:
      return array.astype(dtype)
    if copy:
      return array.copy()
    return array

  def __tf_tensor__(self, dtype=None, name=None):
    self._check_alive()
    if self._on_host_executor() and (dtype is None or dtype == self._dtype):
      return self._whole_tensor()
    return tf.convert_to_tensor(self.numpy(), dtype=dtype, name=name)

  def __tf_tracing_type__(self, context):
    """A tf.function given a ShardedArray gets the whole array.

    Where the host executor runs the array's mesh, the function takes the
    host tensor of the whole array and runs as it does on any tensor, on
    one device: what it computes, and each update of a variable, happens
    once per call. Elsewhere (DTensor's executor) it runs on every device
    of the array's mesh, given the array whole on each, with no trip
    through the host, and what it returns is readable (`.numpy()`), as
    DTensor reads only DTensors that are whole on each device; a variable
    it updates would change once per device, so that is an error
    (`function_inputs`). To keep the array split inside the function (a
    loop of pmap calls), pass `dtensor_value` instead. Plain tensors given
    beside it go whole to the same devices.
    """
    del context  # unused
    self._check_alive()
    if self._on_host_executor():
      return tf.TensorSpec(self._shape, self._dtype)
    return _ShardedArraySpec.of(self)

  def _on_host_executor(self):
    """Whether the host executor runs programs on the array's devices."""
    return selection.holds_on_host(
        [device.platform for device in self._placement.devices],
        devices_lib.process_count())

  def _global_shape(self):
    """The whole array's shape (over all processes)."""
    if self._wide or self._value is None:
      return self._shape
    return self._value.shape

  def _whole_on_devices(self):
    """The DTensor of the array whole on each device of its mesh, made once."""
    self._check_alive()
    if self._whole_on_each_device is None:
      value = self._live()
      self._whole_on_each_device = dtensor_values.relayout(
          value, dtensor.Layout.replicated(self._placement.mesh,
                                           value.shape.rank))
    self._whole_on_each_device = dtensor_device.current(
        self._whole_on_each_device)
    return self._whole_on_each_device

  def __copy__(self):
    """A copy on the same devices, split the same way."""
    self._check_alive()
    return array_ops.elementwise(tf.identity, self)

  def __deepcopy__(self, memo):
    return self.__copy__()

  def __reduce__(self):
    # A pickle holds the values, not the devices: it loads as a NumPy array.
    return (np.array, (self.numpy(),))

  # --- arithmetic on the devices (array_ops.py) --------------------------

  def _binary(self, op, other, reflected=False):
    self._check_alive()
    if not array_ops.accepts(other, self):
      return NotImplemented
    left, right = (other, self) if reflected else (self, other)
    return array_ops.binary(op, left, right, self)

  __add__, __radd__ = _operator_pair(tf.add)
  __sub__, __rsub__ = _operator_pair(tf.subtract)
  __mul__, __rmul__ = _operator_pair(tf.multiply)
  __truediv__, __rtruediv__ = _operator_pair(tf.math.truediv)
  __floordiv__, __rfloordiv__ = _operator_pair(tf.math.floordiv)
  __mod__, __rmod__ = _operator_pair(tf.math.floormod)
  __pow__, __rpow__ = _operator_pair(tf.pow)
  __matmul__, __rmatmul__ = _operator_pair(array_ops.matmul)
  # Python reflects comparisons itself (a < b is b > a).
  __eq__ = _operator_pair(tf.equal)[0]
  __ne__ = _operator_pair(tf.not_equal)[0]
  __lt__ = _operator_pair(tf.less)[0]
  __le__ = _operator_pair(tf.less_equal)[0]
  __gt__ = _operator_pair(tf.greater)[0]
  __ge__ = _operator_pair(tf.greater_equal)[0]

  __hash__ = None  # elementwise ==, as NumPy and JAX arrays
  # `ndarray + out` defers to `out.__radd__` (on the devices) instead of
  # converting `out` to NumPy; ufuncs such as np.exp still convert it.
  __array_priority__ = 100

  def __neg__(self):
    self._check_alive()
    return array_ops.elementwise(tf.negative, self)

  def __pos__(self):
    self._check_alive()
    return self

  def __abs__(self):
    self._check_alive()
    return array_ops.elementwise(tf.abs, self)

  def item(self, *args: int) -> Any:
    """One element as a Python scalar, as `numpy.ndarray.item` gives it.

    Example:
      >>> import numpy as np
      >>> import tfspmd
      >>> total = tfspmd.pmap(lambda x: tfspmd.lax.psum(x, "i"), "i",
      ...                     out_axes=None)(np.arange(8.0))
      >>> total.item()
      28.0
      >>> tfspmd.pmap(lambda x: x * 2)(np.arange(8)).item(3)
      6
    """
    return self.numpy().item(*args)

  def tolist(self) -> Any:
    """The array as nested lists of Python scalars (`numpy.ndarray.tolist`).

    Example:
      >>> import numpy as np
      >>> import tfspmd
      >>> tfspmd.pmap(lambda x: x + 1)(np.arange(4)).tolist()
      [1, 2, 3, 4]
    """
    return self.numpy().tolist()

  def astype(self, dtype: DTypeLike) -> ShardedArray:
    """The array cast to `dtype`, on the devices."""
    self._check_alive()
    return array_ops.elementwise(lambda v: tf.cast(v, dtype), self)

  @property
  def T(self) -> ShardedArray:  # pylint: disable=invalid-name
    """The array with its axes reversed, on the devices."""
    self._check_alive()
    return array_ops.unary(tf.transpose, self)

  def reshape(self, *shape: int | Sequence[int]) -> ShardedArray:
    """The array reshaped as `jax.Array.reshape` does, on the devices.

    The elements keep their row-major order, as `numpy.reshape` of the
    whole array gives them; one size may be -1. Where the new shape starts
    with the axes up to the last one split over devices, each device keeps
    its own block, and the result is split as this array. Otherwise the
    result lies as DTensor's reshape leaves it: each device keeps its own
    elements where the new shape allows it (an array split along axis 0
    over n devices stays split along the new shape's first axis of size
    above 1 when n divides that size), and the array is whole on every
    device where it does not.

    Args:
      *shape: The new shape, as ints or one tuple of ints.

    Returns:
      The reshaped `ShardedArray`.

    Raises:
      ValueError: If `shape` is not ints, or does not hold as many elements;
        with several processes, if it changes an axis up to the last one
        split over devices.

    Example:
      >>> import numpy as np, tfspmd
      >>> out = tfspmd.pmap(lambda x: x * 2)(np.arange(16.).reshape(8, 2))
      >>> out.reshape(8, 2, 1).shape
      TensorShape([8, 2, 1])
      >>> flat = out.reshape(-1)
      >>> flat.shape, flat.sharding.spec
      (TensorShape([16]), PartitionSpec('axis_0'))
      >>> out.reshape(2, 8).sharding.spec
      PartitionSpec()
    """
    self._check_alive()
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
      shape = tuple(shape[0])
    current = self._shape.as_list()
    new = _resolved_shape(shape, self._shape.num_elements())
    if new is None:
      raise ValueError(
          f"ShardedArray.reshape: cannot reshape an array of shape "
          f"{tuple(current)} ({self._shape.num_elements()} elements) to "
          f"{tuple(shape)}; give ints whose product is the number of "
          f"elements, with at most one -1.")
    split_axes = [a for a, dim in enumerate(self._placement.spec)
                  if dim is not None]
    kept = split_axes[-1] + 1 if split_axes else 0
    if new[:kept] == current[:kept]:
      # Each device's block reshaped: the global sizes of the split axes,
      # which differ from this process's part with several processes.
      global_shape = self._global_shape().as_list()
      return array_ops.unary(
          lambda v: tf.reshape(v, global_shape[:kept] + new[kept:]), self)
    if devices_lib.process_count() > 1:
      raise ValueError(
          f"ShardedArray.reshape: with several processes an array holds "
          f"this process's part, so a reshape keeps the axes up to the last "
          f"one split over devices (axes {split_axes}, "
          f"{tuple(current[:kept])}); got {tuple(shape)}. Reshape inside "
          f"the mapped function, or reshape np.asarray(x).")
    return array_ops.unary(lambda v: tf.reshape(v, new), self)

  def sum(self, axis: Axes = None, dtype: DTypeLike | None = None,
          out: None = None, keepdims: bool = False) -> ShardedArray:
    """The sum over `axis` (all axes by default), on the devices."""
    return self._reduce(tf.reduce_sum, axis, dtype, out, keepdims)

  def mean(self, axis: Axes = None, dtype: DTypeLike | None = None,
           out: None = None, keepdims: bool = False) -> ShardedArray:
    """The mean over `axis` (all axes by default), on the devices.

    Integers give float64, as NumPy's mean (TensorFlow's would truncate).
    """
    if dtype is None and not (self._dtype.is_floating or
                              self._dtype.is_complex):
      dtype = tf.float64
    return self._reduce(tf.reduce_mean, axis, dtype, out, keepdims)

  def max(self, axis: Axes = None, out: None = None,
          keepdims: bool = False) -> ShardedArray:
    return self._reduce(tf.reduce_max, axis, None, out, keepdims)

  def min(self, axis: Axes = None, out: None = None,
          keepdims: bool = False) -> ShardedArray:
    return self._reduce(tf.reduce_min, axis, None, out, keepdims)

  def _reduce(self, reduce, axis, dtype, out, keepdims):
    """`reduce` on the devices; `dtype` and `out` as NumPy's reductions."""
    self._check_alive()
    if out is not None:
      raise TypeError("ShardedArray reductions do not take `out=`; use the "
                      "result they return.")
    value = self if dtype is None else self.astype(dtype)
    return array_ops.unary(
        lambda v: reduce(v, axis=axis, keepdims=keepdims), value)

  def __len__(self):
    if self._shape.rank == 0:
      raise TypeError("len() of an unsized (0-d) ShardedArray")
    return self._shape[0]

  def __iter__(self) -> Iterator[tf.Tensor]:
    for i in range(len(self)):
      yield self[i]

  def __getitem__(self, key):
    """`out[i]` is the block of device i along a mapped leading axis."""
    self._check_alive()
    spec = self._placement.spec
    if (isinstance(key, int) and not isinstance(key, bool) and spec and
        spec[0] is not None and sum(dim is not None for dim in spec) == 1 and
        self._placement.local_counts()[0] == self._shape[0]):
      size = self._shape[0]
      if not -size <= key < size:
        raise IndexError(
            f"index {key} is out of bounds for axis 0 with size {size}")
      key %= size
      with multiprocess_hooks.peer_failures():
        components = placement_lib.components(self._live())
      for (device, index), data in zip(self._placement.local_view,
                                       components):
        if index[0] == key:
          with tf.device(device.name):
            return tf.squeeze(data, axis=0)
    return tf.convert_to_tensor(self.numpy()[key])

  def __int__(self):
    return int(self.numpy())

  def __float__(self):
    return float(self.numpy())

  def __bool__(self):
    return bool(self.numpy())

  def __str__(self):
    return str(self.numpy())

  def __repr__(self):
    """Values and dtype as jax prints an array, then how it lies on devices."""
    if self._deleted:
      return f"ShardedArray(<deleted>, shape={self._shape.as_list()})"
    body = np.array2string(self.numpy(), separator=", ", prefix="ShardedArray(")
    return (f"ShardedArray({body}, dtype={self._dtype.name}, "
            f"{self._placement_words()})")

  def _placement_words(self):
    """'axis 0 over 8 devices', or 'replicated on 8 devices'."""
    dims, sizes, _ = self._placement.mesh_key
    size_of = dict(zip(dims, sizes))
    splits = [f"axis {axis} over {size_of[dim]} devices"
              for axis, dim in enumerate(self._placement.spec)
              if dim is not None]
    if not splits:
      return f"replicated on {len(self._placement.devices)} devices"
    return ", ".join(splits)


class _ShardedArraySpec(function_inputs.CheckedInputSpec):
  """The trace type of a ShardedArray: a tensor of its global shape, on its mesh.

  The mesh is part of the type, so a function called with arrays on another
  mesh traces anew; one given arrays on two meshes at once is refused while
  it traces (DTensor runs a function on one mesh, and refuses such a call in
  its own words, TF 2.21). An array DTensor folds into the function as a
  constant (`small_values`) lies on no mesh there.
  """
  _mesh = None
  _placement = None

  @classmethod
  def of(cls, array):
    shape = array._global_shape()  # pylint: disable=protected-access
    spec = cls(shape, array.dtype)
    if small_values.is_small(shape, array.dtype):
      return spec
    spec._placement = array._placement  # pylint: disable=protected-access
    spec._mesh = spec._placement.mesh
    return spec

  def described(self):
    """The array in words, for messages."""
    return (f"of shape {self.shape.as_list()} on "
            f"{named_sharding.sharding_of(self._placement).mesh} (devices "
            f"{[d.id for d in self._placement.devices]})")

  def __eq__(self, other):
    return super().__eq__(other) and _same_mesh(self._mesh, other._mesh)

  def __hash__(self):
    return super().__hash__()

  def is_subtype_of(self, other):
    # A function traced for any other tensor would take the array through
    # the host (`__tf_tensor__`).
    return (isinstance(other, _ShardedArraySpec) and
            super().is_subtype_of(other) and _same_mesh(other._mesh,
                                                        self._mesh))

  def most_specific_common_supertype(self, others):
    # TensorFlow's supertype (reduce_retracing) is made anew, without the
    # mesh; arrays on other meshes have none.
    if not all(_same_mesh(getattr(other, "_mesh", None), self._mesh)
               for other in others):
      return None
    supertype = super().most_specific_common_supertype(others)
    if supertype is not None:
      supertype._placement, supertype._mesh = self._placement, self._mesh  # pylint: disable=protected-access
    return supertype

  def placeholder_value(self, placeholder_context):
    if self._mesh is not None and not placeholder_context.unnest_only:
      _check_one_mesh(self, placeholder_context.context_graph)
    return super().placeholder_value(placeholder_context)

  def cast(self, value, casting_context):
    if isinstance(value, ShardedArray):
      value = value._whole_on_devices()  # pylint: disable=protected-access
    return super().cast(value, casting_context)


def _resolved_shape(shape, size):
  """`shape` with its -1 resolved for `size` elements, or None if it cannot be."""
  if any(isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < -1
         for n in shape):
    return None
  shape = [int(n) for n in shape]
  known = int(np.prod([n for n in shape if n != -1]))
  unknown = shape.count(-1)
  if unknown > 1 or (unknown == 1 and (known == 0 or size % known)):
    return None
  if unknown:
    shape[shape.index(-1)] = size // known
  return shape if int(np.prod(shape)) == size else None


def _same_mesh(mesh, other):
  """Whether two meshes, each a DTensor Mesh or None, are the same."""
  return mesh is other or (
      mesh is not None and other is not None and mesh == other)


def _check_one_mesh(spec, graph):
  """Raises if the function `graph` traces takes arrays on two meshes."""
  first = getattr(graph, "_tfspmd_first_array", None)
  if first is None:
    graph._tfspmd_first_array = spec  # pylint: disable=protected-access
  elif first._mesh != spec._mesh:  # pylint: disable=protected-access
    raise ValueError(
        f"a tf.function was called with ShardedArrays on different meshes: "
        f"one {first.described()}, another {spec.described()}. "
        f"DTensor runs a function on one mesh: put the arrays on one first, "
        f"e.g. `tfspmd.device_put(b, a.sharding)`, or call the function on "
        f"each mesh's arrays apart.")


def _on(device, data):
  """`data` as a tensor of `device`.

  DTensor's multi-device expansion unpacks its outputs as tensors of the
  host's first CPU device, whichever device computed them (TF 2.21).
  """
  if data.device == device.name:
    return data
  with tf.device(device.name):
    return tf.identity(data)
