"""A `tf.data.Dataset` of global batches, as per-device batches on the devices.

Every element of the dataset is one global batch: a tensor or a tuple, dict
or namedtuple of tensors whose first axis is the batch. `device_batches`
iterates it as the same structure of `tfspmd.ShardedArray`s of shape
`(local_devices, per_device_batch, ...)`, each device's rows its block
(held as one host tensor where the host executor runs the devices' programs),
ready for a pmap with `in_axes=0`:

  global batch rows:  [ process 0's share | process 1's share | ... ]
  process p's share:  [ device 0 | device 1 | ... ]   (this process's devices)

In a multi-process run each process keeps only its share of every batch
(the slice is taken inside the tf.data pipeline) and places it on its own
devices. A background thread places the next batches while the current step
runs.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterator
import queue
import threading
from typing import Any

import tensorflow as tf

import tfspmd
from . import _placement

_REMAINDER_POLICIES = ("error", "pad")
# Batches placed ahead of the one in use: the next step's, and one more.
DEFAULT_BUFFER_SIZE = 2


def device_batches(dataset: tf.data.Dataset, *,
                   num_devices: int | None = None,
                   steps_per_call: int | None = None,
                   remainder: str = "error",
                   buffer_size: int = DEFAULT_BUFFER_SIZE,
                   process_index: int | None = None,
                   process_count: int | None = None) -> DeviceBatches:
  """Iterates a dataset of global batches as batches placed on the devices.

  Args:
    dataset: A `tf.data.Dataset` whose elements are global batches (a tensor
      or a pytree of tensors, all with the batch as their first axis).
    num_devices: How many local devices to spread each batch over (the
      mapped size of the pmap it feeds); None for all local devices.
    steps_per_call: None for one batch per item. An int K stacks K
      consecutive batches per item, for `pmap(..., steps=K)`: each leaf
      then has shape `(devices, K, per_device_batch, ...)`. The last item of
      the dataset, or one where the batch size changes, may hold fewer steps.
    remainder: What to do with a global batch whose size does not divide by
      the number of devices of all processes. 'error' (the default) raises
      ValueError. 'pad' appends zero rows up to the next multiple, and gives
      every batch per-example weights, 1 for real rows and 0 for padding:
      elements must be `(x, y)` (they become `(x, y, weights)`) or
      `(x, y, sample_weight)` (the sample weights are padded with zeros).
    buffer_size: How many batches are placed ahead of the one in use; 0
      places each batch only when it is asked for.
    process_index: This process's index; None asks `tfspmd.process_index()`.
    process_count: The number of processes; None asks
      `tfspmd.process_count()`.

  Returns:
    A `DeviceBatches`: iterate it (once or many times, e.g. once per epoch)
    to get the placed batches.

  Raises:
    ValueError: For a bad argument here (a dataset that is not batched, or
      whose elements hold sparse or ragged tensors, included), or while
      iterating, for a batch that does not divide by the devices, or whose
      leaves disagree in size.

  Example:
    >>> import numpy as np, tensorflow as tf
    >>> from tfspmd.adapters import tf_data
    >>> x = np.arange(32.).reshape(16, 2)
    >>> dataset = tf.data.Dataset.from_tensor_slices(x).batch(8)
    >>> batches = list(tf_data.device_batches(dataset, num_devices=4))
    >>> batches[0].shape, batches[0].addressable_shards[1].data.numpy().tolist()
    (TensorShape([4, 2, 2]), [[[4.0, 5.0], [6.0, 7.0]]])
  """
  return DeviceBatches(dataset, num_devices=num_devices,
                       steps_per_call=steps_per_call, remainder=remainder,
                       buffer_size=buffer_size, process_index=process_index,
                       process_count=process_count)


class DeviceBatches:
  """An iterable of placed per-device batches; made by `device_batches`.

  Attributes:
    devices: The local devices each batch is spread over, in order.
    process_index: This process's index.
    process_count: The number of processes.
  """

  def __init__(self, dataset: tf.data.Dataset, *, num_devices: int | None,
               steps_per_call: int | None, remainder: str, buffer_size: int,
               process_index: int | None,
               process_count: int | None,
               undivided_advice: str | None = None) -> None:
    """See `device_batches`; `undivided_advice` ends the error for a batch
    that does not divide by the devices, in place of the remainder advice."""
    if not isinstance(dataset, tf.data.Dataset):
      raise TypeError(
          f"device_batches: `dataset` must be a tf.data.Dataset of global "
          f"batches, got {type(dataset).__name__}.")
    if steps_per_call is not None and (
        isinstance(steps_per_call, bool) or not isinstance(steps_per_call, int)
        or steps_per_call < 1):
      raise ValueError(
          f"device_batches: `steps_per_call` must be a positive int or None, "
          f"got {steps_per_call!r}.")
    if remainder not in _REMAINDER_POLICIES:
      raise ValueError(
          f"device_batches: `remainder` must be one of {_REMAINDER_POLICIES}, "
          f"got {remainder!r}.")
    if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or (
        buffer_size < 0):
      raise ValueError(
          f"device_batches: `buffer_size` must be an int >= 0, got "
          f"{buffer_size!r}.")
    self.process_count = (tfspmd.process_count() if process_count is None
                          else process_count)
    self.process_index = (tfspmd.process_index() if process_index is None
                          else process_index)
    if not 0 <= self.process_index < self.process_count:
      raise ValueError(
          f"device_batches: `process_index` must be in [0, process_count="
          f"{self.process_count}), got {self.process_index}.")
    check_element_spec(dataset.element_spec, "device_batches", "dataset")
    self.devices = _placement.data_devices(num_devices)
    self._steps = steps_per_call
    self._remainder = remainder
    self._undivided_advice = undivided_advice
    self._buffer_size = buffer_size
    self._dataset = self._pipeline(dataset)

  @property
  def total_devices(self) -> int:
    """The number of devices of all processes a global batch is split over."""
    return len(self.devices) * self.process_count

  def _pipeline(self, dataset):
    """The dataset of (this process's share, each batch's global size)."""
    total = self.total_devices
    if self._remainder == "pad":
      _check_paddable(dataset.element_spec, total)
      dataset = map_as_written(dataset, lambda *e: _pad(_element(e), total))
    dataset = map_as_written(dataset, lambda *e: _share(
        _element(e), self.process_index, self.process_count))
    if self._steps is not None:
      # Zeros fill a shorter batch up to the longest of its chunk; the sizes
      # travel along, and `_items` cuts the chunk where the size changes.
      dataset = dataset.padded_batch(self._steps)
    return dataset.prefetch(tf.data.AUTOTUNE)

  def __iter__(self) -> Iterator[Any]:
    items = self._items()
    if self._buffer_size == 0:
      return items
    return _background(items, self._buffer_size)

  def _items(self):
    batch_index = 0
    for share, sizes in dataset_elements(self._dataset):
      sizes = sizes.numpy()
      if self._steps is None:
        self._check_sizes(sizes, batch_index)
        batch_index += 1
        yield tf.nest.map_structure(self._place, share)
        continue
      for t in range(len(sizes)):
        self._check_sizes(sizes[t], batch_index + t)
      start = 0
      while start < len(sizes):
        stop = start + 1
        while stop < len(sizes) and sizes[stop][0] == sizes[start][0]:
          stop += 1
        rows = sizes[start][0] // self.process_count
        yield tf.nest.map_structure(
            lambda leaf, a=start, b=stop, r=rows: self._place_steps(
                leaf[a:b, :r]), share)
        start = stop
      batch_index += len(sizes)

  def _check_sizes(self, sizes, batch_index):
    if len(set(sizes.tolist())) > 1:
      raise ValueError(
          f"device_batches: the leaves of batch {batch_index} have different "
          f"batch sizes {sizes.tolist()}; every leaf of an element needs the "
          f"batch as its first axis (a dataset that is not batched yet needs "
          f"`dataset.batch(n)`).")
    size = int(sizes[0])
    if size % self.total_devices:
      advice = self._undivided_advice or (
          f"Make the batch size a multiple of {self.total_devices} (e.g. "
          f"`dataset.batch(n, drop_remainder=True)` to drop a short last "
          f"batch on purpose), or pass remainder='pad' to pad it with "
          f"zero-weight rows.")
      raise ValueError(
          f"device_batches: batch {batch_index} has {size} examples, which "
          f"does not divide by the {self.total_devices} devices "
          f"({self.process_count} process(es) x {len(self.devices)} local "
          f"devices). {advice}")

  def _place(self, share):
    """`(rows, ...)` -> `(devices, rows / devices, ...)` on the devices."""
    count = len(self.devices)
    blocks = tf.reshape(share, [count, -1] + share.shape.as_list()[1:])
    return _placement.place(blocks, self.devices, split=True)

  def _place_steps(self, share):
    """`(steps, rows, ...)` -> `(devices, steps, rows / devices, ...)`."""
    count = len(self.devices)
    shape = share.shape.as_list()
    blocks = tf.reshape(share, [shape[0], count, -1] + shape[2:])
    blocks = tf.transpose(blocks, [1, 0] + list(range(2, len(shape) + 1)))
    return _placement.place(blocks, self.devices, split=True)


def map_as_written(dataset: tf.data.Dataset,
                   function: Callable[..., Any]) -> tf.data.Dataset:
  """`dataset.map(function)`, the function traced as written.

  `Dataset.map` first rewrites a function with AutoGraph, 60-70 ms each at
  the start of every fit; the functions here branch on the structure of
  the elements only, never on their values, so they need no rewriting.
  """
  return dataset.map(tf.autograph.experimental.do_not_convert(function))


def _element(args):
  """The element a `Dataset.map` function was given, whatever its arity."""
  return args[0] if len(args) == 1 else args


def _check_paddable(element_spec, total):
  """Raises unless a dataset's elements are `(x, y)` or `(x, y, weight)`.

  Checked on the spec, before `Dataset.map`: raised inside the map, the
  error would come wrapped in tf.data's trace of the function.
  """
  if isinstance(element_spec, tuple) and len(element_spec) in (2, 3):
    return
  given = type(element_spec).__name__
  if isinstance(element_spec, tuple):
    given += f" of length {len(element_spec)}"
  raise ValueError(
      f"device_batches(remainder='pad') needs elements `(x, y)` or `(x, y, "
      f"sample_weight)`, to give the padding rows weight 0; got elements of "
      f"type {given}. Use remainder='error' and batch sizes that divide by "
      f"{total}.")


def _pad(element, total):
  """Pads a global batch to a multiple of `total` rows, with 0-weight rows."""
  if len(element) == 2:
    element = element + (tf.ones([_batch_size(element)], tf.float32),)
  padded, _ = pad_rows(element, total)
  return padded


def pad_rows(element: Any, multiple: int) -> tuple[Any, tf.Tensor]:
  """Pads every leaf of a global batch with zero rows to a multiple of rows.

  Args:
    element: A global batch: a tensor or a pytree of tensors whose first
      axis is the batch.
    multiple: The number of rows the padded batch must divide by.

  Returns:
    The padded element, and a float32 mask of its rows: 1 for the batch's
    own rows, 0 for the padding rows after them.

  Example:
    >>> import tensorflow as tf
    >>> from tfspmd.adapters import tf_data
    >>> padded, rows = tf_data.pad_rows({"x": tf.ones([3, 2])}, 4)
    >>> padded["x"].shape.as_list(), rows.numpy().tolist()
    ([4, 2], [1.0, 1.0, 1.0, 0.0])
  """
  size = _batch_size(element)
  padded = (size + multiple - 1) // multiple * multiple

  def pad(leaf):
    extra = [[0, padded - size]] + [[0, 0]] * (leaf.shape.rank - 1)
    return tf.pad(leaf, extra)

  rows = tf.pad(tf.ones([size], tf.float32), [[0, padded - size]])
  return tf.nest.map_structure(pad, element), rows


def check_element_spec(spec: Any, caller: str, argument: str) -> None:
  """Raises if a dataset's elements are not global batches of dense tensors.

  Args:
    spec: The dataset's `element_spec`.
    caller: The function to name in the message (e.g. 'device_batches').
    argument: The argument that holds the dataset (e.g. 'dataset').

  Raises:
    ValueError: If a leaf is sparse or ragged (it cannot be split into
      per-device blocks), or is a scalar (the dataset is not batched).
  """
  for path, leaf in named_leaves(spec, "element"):
    path = f"{path} of `{argument}`"
    if isinstance(leaf, (tf.SparseTensorSpec, tf.RaggedTensorSpec)):
      kind = "sparse" if isinstance(leaf, tf.SparseTensorSpec) else "ragged"
      fix = ("tf.sparse.to_dense(t)" if kind == "sparse" else
             "t.to_tensor() (zero-padded)")
      raise ValueError(
          f"{caller}: {path} is a {kind} tensor ({leaf}); only dense tensors "
          f"can be split into per-device blocks. Make it dense in the "
          f"pipeline, e.g. `{argument} = {argument}.map(...)` with {fix}.")
    if not isinstance(leaf, tf.TensorSpec):
      raise ValueError(
          f"{caller}: {path} is a {type(leaf).__name__}, not a tensor; the "
          f"elements of `{argument}` must be tensors or tuples, dicts or "
          f"namedtuples of tensors.")
    if leaf.shape.rank == 0:
      raise ValueError(
          f"{caller}: {path} is a scalar ({leaf}), so `{argument}` is not "
          f"batched: each of its elements must be a global batch whose first "
          f"axis is the batch. Batch it, e.g. `{argument}.batch(n)` with n a "
          f"multiple of the number of devices.")


def named_leaves(structure: Any, root: str) -> list[tuple[str, Any]]:
  """The leaves of a nested structure with Python-style paths from `root`.

  Example:
    >>> from tfspmd.adapters import tf_data
    >>> [path for path, _ in tf_data.named_leaves({"a": (1, 2)}, "x")]
    ["x['a'][0]", "x['a'][1]"]
  """
  if isinstance(structure, dict):
    items = [(f"{root}[{key!r}]", structure[key]) for key in sorted(structure)]
  elif isinstance(structure, (tuple, list)):
    items = [(f"{root}[{k}]", value) for k, value in enumerate(structure)]
  else:
    return [(root, structure)]
  return [named for path, value in items
          for named in named_leaves(value, path)]


def _batch_size(element):
  return tf.shape(tf.nest.flatten(element)[0])[0]


def _share(element, index, count):
  """This process's rows of a global batch, and every leaf's global size."""
  leaves = tf.nest.flatten(element)
  sizes = tf.stack([tf.shape(leaf)[0] for leaf in leaves])
  rows = sizes[0] // count
  share = tf.nest.map_structure(
      lambda leaf: leaf[index * rows:(index + 1) * rows], element)
  return share, sizes


def dataset_elements(dataset: tf.data.Dataset) -> Iterator[Any]:
  """The elements of `dataset`, read as `for element in dataset` reads them.

  A `for` loop over a dataset makes and frees one eager executor per element
  (TF 2.21); a wait for the programs in flight in another thread, which each
  read of a result makes, can meet a freed one: the process crashes ("Mutex
  corrupt", a segfault) or hangs. `get_next_as_optional` makes none, so
  every dataset tfspmd reads in a thread of its own is read through here.

  Example:

    >>> [int(x) for x in dataset_elements(tf.data.Dataset.range(3))]
    [0, 1, 2]
  """
  iterator = iter(dataset)
  while True:
    element = iterator.get_next_as_optional()
    if not element.has_value():
      return
    yield element.get_value()


def _background(items, buffer_size):
  """Runs the generator `items` in a thread, up to `buffer_size` ahead."""
  buffer = queue.Queue(maxsize=buffer_size)
  stop = threading.Event()
  done = object()

  def produce():
    try:
      for item in items:
        if not _put(buffer, (item, None), stop):
          return
      _put(buffer, (done, None), stop)
    except Exception as e:  # pylint: disable=broad-except
      # Raised again in the consumer, with its traceback.
      _put(buffer, (done, e), stop)

  thread = threading.Thread(target=produce, daemon=True,
                            name="tfspmd.adapters.tf_data placement")
  thread.start()
  try:
    while True:
      item, error = buffer.get()
      if error is not None:
        raise error
      if item is done:
        return
      yield item
  finally:
    stop.set()
    # Emptied, the buffer takes the item a waiting producer holds; the
    # producer then sees the stop and ends.
    while True:
      try:
        buffer.get_nowait()
      except queue.Empty:
        break
    thread.join()


def _put(buffer, item, stop):
  """Puts `item` unless the consumer has stopped; False if it has."""
  if stop.is_set():
    return False
  buffer.put(item)
  return not stop.is_set()
