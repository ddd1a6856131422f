"""pmap training state saved and restored with `tf.train.Checkpoint`.

A state is a pytree (tuples, lists, dicts, namedtuples) whose leaves are
`tfspmd.ShardedArray`s, tensors or NumPy arrays. Each leaf is stored under
its pytree path (`['w']`, `[1]`, `.opt`), never by position, with a record
of its global shape (the array `np.asarray` shows), dtype, how many blocks
it is cut into along each axis and over how many devices:
  - a replicated `ShardedArray` (parameters, optimizer state: the same on
    every device) is stored once;
  - a split `ShardedArray` is stored block by block, each block once, read
    from a device holding it with no gathering;
  - any other leaf is stored whole.

Restoring fills a state of the same structure (`like`, usually the state a
fresh run built) leaf by leaf, by path. Each leaf comes back with its saved
global value, bit for bit, split over the devices of `like`'s leaf however
that leaf is split: over 8 devices or 4 or 1, replicated or split along
another axis. So a shard_map array of shape (16, 3) saved from 8 devices as
blocks of 2 rows restores onto 4 devices as blocks of 4 rows. What cannot
keep its values is an error naming the leaf: a `like` whose leaves are not
the saved ones (a renamed, extra or missing key), or a leaf of another
global shape or dtype. A per-device pmap value of shape (8, ...), one row
per device, is such a leaf on 4 devices, where `like` has shape (4, ...):
restore it into a NumPy `like` of shape (8, ...) to get the saved rows.

Other trackables (a step counter, a `tf.data` iterator) can be saved beside
the state in the same checkpoint.

A crash never loses a checkpoint. A TensorFlow checkpoint is several files
(an index and one data file or more) that cannot be replaced together, so a
save to `path` does not write them at `path`. It writes them under a fresh
prefix beside it, `<path>.tfspmd-<32 hex digits>`, and then switches
`<path>` to them through one small file, `<path>.tfspmd`, which names the
current prefix (`{"checkpoint": "<name of the prefix>"}`):
  1. `tf.train.Checkpoint.write` writes the new prefix's files (the
     directory of `path`, so the same filesystem);
  2. each of them, then the directory, is flushed to disk (fsync);
  3. the new pointer is written to `<new prefix>.next` and flushed, and
     renamed over `<path>.tfspmd` (a rename within a directory replaces a
     file atomically), and the directory is flushed again;
  4. the files of earlier saves to `path` are removed: their prefixes,
     whatever a killed save left (a prefix no pointer names, a `.next`
     pointer, TensorFlow's `_temp` directory), and a checkpoint of the
     earlier format (plain TensorFlow files at `path` itself).
`restore(path)` reads the prefix `<path>.tfspmd` names, so a save killed at
any point leaves the old checkpoint (before the rename of step 3) or the new
one (from it on), complete, never a mix; the leftovers are ignored until the
next save removes them. Without `<path>.tfspmd`, `restore(path)` reads plain
TensorFlow files at `path`: those of a save by an earlier version of this
module, or a prefix `save` returned. Only the latest save to `path` is kept.
On a filesystem that is not local (a `scheme://` path) the files are not
flushed: what is renamed is what was written and closed. Saves to one
path from several threads or processes take turns (a lock on
`<path>.tfspmd.lock`, released by a process that dies), and a restore
waits for a save in progress: the last save is what is kept, whole. On a
`scheme://` path only the threads of one process take turns. In a run of
several processes each process saves its own part of the state, as its
arrays show it: give each process its own `path`, since a save to `path`
replaces any other save to it.

A damaged checkpoint (a data file cut short or missing, an index that is no
checkpoint index, data that does not match the index's checksums) is a
`ValueError` naming the checkpoint and the file.
"""

from __future__ import annotations

import collections
import json
import os
import re
from typing import Any
import uuid

import numpy as np
import tensorflow as tf

import tfspmd
from . import _path_lock
from . import _placement

# Format 1 stored the leaves as a flat list, without their paths or layout.
_FORMAT = 2
_LAYOUT_KEY = "state/layout/.ATTRIBUTES/VARIABLE_VALUE"
# Host copies (whole leaves, blocks read back) stay off the accelerators.
_HOST = "CPU:0"
# The checkpoint's own entries, which are no trackable of the user's.
_NOT_TRACKABLES = ("_CHECKPOINTABLE_OBJECT_GRAPH", "save_counter", "state")
# `<path>.tfspmd` names the current checkpoint of `path`; each save writes
# its files under the prefix `<path>.tfspmd-<token>`.
_POINTER = ".tfspmd"
_TOKEN = r"[0-9a-f]{32}"
_DATA_FILE = re.compile(r"\.data-(\d{5})-of-(\d{5})")


def save(path: str, state: Any, **trackables: Any) -> str:
  """Writes `state` (and any `trackables`) to the checkpoint `path`.

  The checkpoint replaces any earlier one at `path` atomically: a crash
  during the save leaves the earlier checkpoint or this one, whole (see the
  module docstring).

  Args:
    path: The checkpoint's path, e.g. '/tmp/run/ckpt'; saving to the same
      path again replaces it.
    state: The pytree of the training state.
    **trackables: More objects for `tf.train.Checkpoint` to save beside it
      (`tf.Variable`s, Keras models, `tf.data` iterators, ...).

  Returns:
    The prefix of the TensorFlow checkpoint files written,
    `<path>.tfspmd-<token>`: `restore` and TensorFlow's checkpoint readers
    (`tf.train.load_checkpoint`) read it until the next save to `path`
    removes it. `restore(path)` reads the latest save to `path`.

  Raises:
    TypeError: If a leaf of `state` is None or no array (a string, an
      arbitrary object).

  Example:
    >>> import os, tempfile, numpy as np, tfspmd
    >>> from tfspmd.adapters import checkpoint
    >>> state = tfspmd.pmap(lambda x: x * 2)(np.arange(8.))
    >>> path = checkpoint.save(os.path.join(tempfile.mkdtemp(), 'ckpt'), state)
    >>> print(checkpoint.restore(path, like=state))
    [ 0.  2.  4.  6.  8. 10. 12. 14.]
  """
  leaves = _named_leaves(state, "save", "state")
  records = [_record(name, leaf) for name, leaf in leaves]
  with tf.device(_HOST):
    layout = tf.Variable(json.dumps({"format": _FORMAT, "leaves": records}),
                         trainable=False)
  blocks = {name: _saved_blocks(leaf) for name, leaf in leaves}
  prefix = f"{path}{_POINTER}-{uuid.uuid4().hex}"
  with _path_lock.holding(path):
    _checkpoint(layout, blocks, trackables).write(prefix)
    _switch(path, prefix)
    _remove_earlier(path, prefix)
  return prefix


def restore(path: str, like: Any, **trackables: Any) -> Any:
  """Reads a state saved by `save` into the structure and placement of `like`.

  Leaves are matched by pytree path. Each comes back with its saved global
  value, split over `like`'s devices as `like`'s leaf is, whatever devices
  or split it was saved from.

  Args:
    path: The path given to `save` (its latest save is read), or the prefix
      `save` returned, or the prefix of a checkpoint saved by an earlier
      version of this module.
    like: A state with the structure, shapes, dtypes and placements wanted
      (the values are not read).
    **trackables: The objects saved beside the state, to restore in place.

  Returns:
    The restored state: `ShardedArray` leaves where `like` has them, placed
    the same way; NumPy arrays elsewhere.

  Raises:
    FileNotFoundError: If there is no checkpoint at `path`.
    ValueError: If the checkpoint is damaged (a data file cut short or
      missing, an index that is no checkpoint index, data that does not
      match its checksums), if it holds no state written by `save`, if its
      leaves are not those of `like` (by path), if a leaf of `like` has
      another global shape or dtype than the saved one, or if `trackables`
      do not match what was saved beside the state.
    TypeError: If a leaf of `like` is None or no array.

  Examples:
    >>> import os, tempfile, numpy as np, tensorflow as tf, tfspmd
    >>> from tfspmd.adapters import checkpoint
    >>> step = tfspmd.pmap(lambda w, x: w + tfspmd.lax.psum(x, 'i'), 'i',
    ...                    in_axes=(None, 0), out_axes=None)
    >>> w = step(np.zeros(2, np.float32), np.ones((8, 2), np.float32))
    >>> epoch = tf.Variable(1)
    >>> path = checkpoint.save(os.path.join(tempfile.mkdtemp(), 'ckpt'),
    ...                        {'w': w}, epoch=epoch)
    >>> _ = epoch.assign(0)
    >>> restored = checkpoint.restore(path, like={'w': w}, epoch=epoch)
    >>> print(restored['w'], int(epoch))
    [8. 8.] 1

    An array saved from 8 devices, as blocks of 2 rows, restored onto 4 of
    them, as blocks of 4 rows:

    >>> def rows(devices):
    ...   mesh = tfspmd.make_mesh((len(devices),), ('x',), devices=devices)
    ...   return tfspmd.shard_map(lambda b: b + 1, mesh=mesh,
    ...                           in_specs=tfspmd.P('x'),
    ...                           out_specs=tfspmd.P('x'))
    >>> saved = rows(tfspmd.devices())(np.zeros((16, 3)))
    >>> path = checkpoint.save(os.path.join(tempfile.mkdtemp(), 'ckpt'), saved)
    >>> like = rows(tfspmd.devices()[:4])(np.zeros((16, 3)))
    >>> restored = checkpoint.restore(path, like=like)
    >>> [shard.data.shape.as_list() for shard in restored.addressable_shards]
    [[4, 3], [4, 3], [4, 3], [4, 3]]
    >>> float(np.asarray(restored).sum())
    48.0
  """
  # A prefix a save returned is read under the lock of the path saved to.
  saved_to = re.fullmatch(f"(.*){re.escape(_POINTER)}-{_TOKEN}", path)
  with _path_lock.holding(saved_to[1] if saved_to else path, shared=True):
    return _restore(path, like, trackables)


def _restore(path, like, trackables):
  """`restore`, while no save to `path` runs."""
  prefix = _current_prefix(path)
  reader = _reader(path, prefix)
  try:
    records = _saved_records(reader)
  except (IndexError, tf.errors.OpError) as error:
    raise ValueError(_unreadable(path, prefix, error)) from None
  saved = {record["path"]: record for record in records}
  wanted = _named_leaves(like, "restore", "like")
  _check_same_leaves(saved, [name for name, _ in wanted])
  for name, leaf in wanted:
    _check_same_array(name, _record(name, leaf), saved[name])
  with tf.device(_HOST):
    layout = tf.Variable("", trainable=False)
    targets = {name: _block_targets(saved[name]) for name, _ in wanted}
  # The state was checked against its layout above: what fails here is a
  # trackable, absent (AssertionError) or of another shape or dtype.
  try:
    status = _checkpoint(layout, targets, trackables).read(prefix)
    status.assert_existing_objects_matched()
  except (AssertionError, ValueError, tf.errors.InvalidArgumentError):
    raise ValueError(_trackables_mismatch(reader, trackables)) from None
  except (IndexError, tf.errors.OpError) as error:
    # Damage `_reader` cannot see: changed bytes, or a cut into strings.
    raise ValueError(_unreadable(path, prefix, error)) from None
  # Trackables saved beside the state but not asked for stay unread.
  status.expect_partial()
  values = [_restored_leaf(targets[name], saved[name], leaf)
            for name, leaf in wanted]
  return tf.nest.pack_sequence_as(like, values)


def _checkpoint(layout, blocks, trackables):
  state = {"layout": layout, "leaves": blocks}
  return tf.train.Checkpoint(state=state, **trackables)


# --- leaves by path ------------------------------------------------------------


def _named_leaves(tree, operation, root):
  """`(path, leaf)` of each leaf of `tree`, in tf.nest's flatten order.

  The path is relative to the root (`['w']`, `[0].mu`, '' for a lone leaf).
  A leaf that is no `ShardedArray` comes back as a NumPy array.

  Args:
    tree: The state (`save`) or `like` (`restore`).
    operation: 'save' or 'restore', for error messages.
    root: The name of `tree` in error messages: 'state' or 'like'.
  """
  leaves = []
  _collect(tree, "", leaves)
  return [(name, _storable(leaf, f"checkpoint.{operation}", root + name))
          for name, leaf in leaves]


def _collect(tree, path, leaves):
  # The orders are tf.nest's, so that `pack_sequence_as` rebuilds `like`.
  if isinstance(tree, collections.abc.Mapping):
    for key in sorted(tree):
      _collect(tree[key], f"{path}[{key!r}]", leaves)
  elif isinstance(tree, tuple) and hasattr(type(tree), "_fields"):
    for field, child in zip(tree._fields, tree):
      _collect(child, f"{path}.{field}", leaves)
  elif isinstance(tree, (list, tuple)):
    for i, child in enumerate(tree):
      _collect(child, f"{path}[{i}]", leaves)
  else:
    leaves.append((path, tree))


def _storable(leaf, caller, where):
  """`leaf`, as a NumPy array unless it is a `ShardedArray`, if it is an array."""
  if leaf is None:
    raise TypeError(
        f"{caller}: {where} is None, which a checkpoint cannot hold: leave "
        f"the leaf out of the state, or put an empty array (np.zeros(0)) in "
        f"its place.")
  if isinstance(leaf, tfspmd.ShardedArray):
    return leaf
  array = np.asarray(leaf)
  if not _is_numeric(array.dtype):
    raise TypeError(
        f"{caller}: {where} is a {type(leaf).__name__}, which a checkpoint "
        f"cannot hold: the leaves must be tfspmd.ShardedArrays, tensors, "
        f"NumPy arrays or numbers.")
  return array


def _is_numeric(dtype):
  """True for the dtypes of numbers and bools TensorFlow has."""
  try:
    return tf.as_dtype(dtype) != tf.string
  except TypeError:
    return False


def _record(name, leaf):
  """What the checkpoint records of a leaf beside its blocks."""
  if isinstance(leaf, tfspmd.ShardedArray):
    split = [int(count) for count in _placement.block_counts(leaf)]
    devices = _placement.device_count(leaf)
  else:
    split, devices = [1] * leaf.ndim, 0
  return {"path": name, "shape": [int(n) for n in leaf.shape],
          "dtype": tf.as_dtype(leaf.dtype).name, "split": split,
          "devices": devices}


# --- saving ----------------------------------------------------------------------


def _saved_blocks(leaf):
  """One variable per distinct block of `leaf`, in row-major block order."""
  if isinstance(leaf, tfspmd.ShardedArray):
    return [_variable_on(block) for block in _placement.distinct_blocks(leaf)]
  with tf.device(_HOST):
    return [tf.Variable(leaf, trainable=False)]


def _variable_on(tensor):
  with tf.device(tensor.device):
    return tf.Variable(tensor, trainable=False)


def _switch(path, prefix):
  """Makes the checkpoint written at `prefix` the one at `path`, atomically.

  The pointer `<path>.tfspmd` is replaced by a rename, after the files it
  names are on disk: a crash before the rename leaves the old pointer, one
  after it the new one, each naming a complete checkpoint.
  """
  directory, name = _split(prefix)
  for entry in sorted(tf.io.gfile.listdir(directory)):
    if entry.startswith(name + "."):
      _flush(os.path.join(directory, entry))
  staged = prefix + ".next"
  with tf.io.gfile.GFile(staged, "w") as pointer:
    pointer.write(json.dumps({"checkpoint": name}))
  _flush(staged)
  # The new files' names must be on disk before the pointer that names them.
  _flush(directory)
  tf.io.gfile.rename(staged, path + _POINTER, overwrite=True)
  _flush(directory)


def _remove_earlier(path, prefix):
  """Removes what saves to `path` before the one at `prefix` left.

  Their checkpoints, the files of saves killed before their switch, and a
  checkpoint of the earlier format (plain TensorFlow files at `path`).
  """
  directory, name = _split(path)
  current = _split(prefix)[1]
  earlier = re.compile(re.escape(name + _POINTER) + "-" + _TOKEN +
                       r"([._].*)?|" + re.escape(name) +
                       r"(\.index|\.data-\d{5}-of-\d{5})")
  for entry in tf.io.gfile.listdir(directory):
    entry = entry.rstrip("/")  # object stores list directories with a '/'
    if not earlier.fullmatch(entry) or entry.startswith(current):
      continue
    entry = os.path.join(directory, entry)
    if tf.io.gfile.isdir(entry):
      tf.io.gfile.rmtree(entry)
    else:
      tf.io.gfile.remove(entry)


def _flush(path):
  """Flushes the local file or directory `path` to disk.

  A path of another filesystem (`scheme://...`) is left as it is: what a
  closed write wrote is what its store holds.
  """
  if "://" in path:
    return
  descriptor = os.open(path, os.O_RDONLY)
  try:
    os.fsync(descriptor)
  finally:
    os.close(descriptor)


def _split(path):
  """`(directory, name)` of `path`; '.' for a name without a directory."""
  directory, name = os.path.split(path)
  return directory or ".", name


# --- restoring -------------------------------------------------------------------


def _current_prefix(path):
  """The prefix of the checkpoint files at `path`.

  The one `<path>.tfspmd` names; without it, `path` itself (a prefix `save`
  returned, or a checkpoint of the earlier format).
  """
  pointer = path + _POINTER
  if not tf.io.gfile.exists(pointer):
    _check_not_a_file_of_a_checkpoint(path)
    return path
  with tf.io.gfile.GFile(pointer, "rb") as file:
    text = file.read()
  try:
    name = json.loads(text)["checkpoint"]
  except (ValueError, KeyError, TypeError):
    name = None
  versions = re.escape(os.path.basename(path) + _POINTER) + "-" + _TOKEN
  if not isinstance(name, str) or not re.fullmatch(versions, name):
    raise ValueError(
        f"checkpoint.restore: {pointer!r}, the file that names the current "
        f"checkpoint files of {path!r}, names none: the checkpoint at "
        f"{path!r} is damaged; restore an earlier one.")
  return os.path.join(os.path.dirname(path), name)


def _check_not_a_file_of_a_checkpoint(path):
  """Raises if `path` is one of a checkpoint's files, not its path.

  Given the pointer file (`<path>.tfspmd`) or a prefix's `.index` file,
  TensorFlow would read it as a damaged checkpoint; nothing is damaged.
  """
  for suffix in (_POINTER, ".index"):
    if path.endswith(suffix) and tf.io.gfile.exists(path):
      base = path[:-len(suffix)]
      if suffix == _POINTER or tf.io.gfile.exists(base + _POINTER):
        base = re.sub(re.escape(_POINTER) + "-" + _TOKEN + "$", "", base)
      raise ValueError(
          f"checkpoint.restore: {path!r} is one of the files of the "
          f"checkpoint at {base!r}; give the path `save` was given (or the "
          f"prefix it returned): checkpoint.restore({base!r}, like=...).")


def _reader(path, prefix):
  """A reader of the checkpoint files at `prefix`, once they look whole."""
  try:
    reader = tf.train.load_checkpoint(prefix)
  except (tf.errors.NotFoundError, ValueError):
    if prefix != path:
      raise ValueError(
          f"checkpoint.restore: the index file {prefix + '.index'!r}, which "
          f"{path + _POINTER!r} names, is missing: the checkpoint at "
          f"{path!r} is damaged; restore an earlier one.") from None
    raise FileNotFoundError(_not_found(path)) from None
  except tf.errors.OpError:
    raise ValueError(
        f"checkpoint.restore: the index file {prefix + '.index'!r} is not a "
        f"checkpoint index: the checkpoint at {path!r} is damaged; restore an "
        f"earlier one.") from None
  _check_data_files(path, prefix, reader)
  return reader


def _not_found(path):
  """The message for a `path` with no checkpoint files."""
  version = re.fullmatch("(.*)" + re.escape(_POINTER) + "-" + _TOKEN, path)
  if version and _replaced(version[1], path):
    return (f"checkpoint.restore: there is no checkpoint at {path!r}: a later "
            f"checkpoint.save to {version[1]!r} replaced it. Restore "
            f"{version[1]!r} for the latest checkpoint saved there.")
  return (f"checkpoint.restore: there is no checkpoint at {path!r}. Pass the "
          f"path given to checkpoint.save, or the prefix it returned.")


def _replaced(path, prefix):
  """True if a later save to `path` replaced its checkpoint at `prefix`."""
  try:
    return _current_prefix(path) not in (path, prefix)
  except ValueError:
    return False


def _check_data_files(path, prefix, reader):
  """Raises unless the data files of `prefix` are there and long enough.

  The index does not tell how long its data files are, but they hold at
  least the bytes of its numeric tensors.
  """
  files, missing = _data_files(prefix)
  if missing:
    raise ValueError(
        f"checkpoint.restore: {_the_data_files(missing)} "
        f"{'is' if len(missing) == 1 else 'are'} missing: the checkpoint at "
        f"{path!r} is damaged; restore an earlier one.")
  size = sum(tf.io.gfile.stat(file).length for file in files)
  dtypes = reader.get_variable_to_dtype_map()
  needed = sum(int(np.prod(shape)) * dtypes[key].size
               for key, shape in reader.get_variable_to_shape_map().items()
               if dtypes[key] != tf.string)
  if size < needed:
    holds = "it holds" if len(files) == 1 else "they hold"
    raise ValueError(
        f"checkpoint.restore: {_the_data_files(files)} "
        f"{'is' if len(files) == 1 else 'are'} {size} bytes, shorter than the "
        f"{needed} the index says {holds}: the checkpoint at {path!r} is "
        f"damaged; restore an earlier one.")


def _data_files(prefix):
  """The data files of `prefix`, and those of them that are missing.

  How many there are is in each file's name (`.data-00000-of-00001`).
  """
  directory, name = _split(prefix)
  shards = {}
  for entry in tf.io.gfile.listdir(directory):
    match = _DATA_FILE.fullmatch(entry[len(name):])
    if entry.startswith(name) and match:
      shards[int(match[1])] = int(match[2])
  count = max(shards.values(), default=1)
  files = [f"{prefix}.data-{shard:05d}-of-{count:05d}"
           for shard in range(count)]
  missing = [file for shard, file in enumerate(files)
             if shards.get(shard) != count]
  return files, missing


def _the_data_files(files):
  """'the data file 'a'' or 'the data files 'a', 'b'', for a message."""
  names = ", ".join(repr(file) for file in files)
  return f"the data file{'s' if len(files) > 1 else ''} {names}"


def _unreadable(path, prefix, error):
  """The message for data files that TensorFlow could not read as indexed.

  Args:
    path: The path given to `restore`.
    prefix: The prefix of the checkpoint files read.
    error: What TensorFlow raised: an IndexError for a file shorter than
      its index says, an OpError for bytes that fail their checksums.
  """
  files = _data_files(prefix)[0]
  one = len(files) == 1
  index = f"the index {prefix + '.index'!r}"
  if isinstance(error, IndexError):
    what = f"{'is' if one else 'are'} shorter than {index} says"
  else:
    what = f"{'does' if one else 'do'} not match the checksums of {index}"
  return (f"checkpoint.restore: {_the_data_files(files)} {what}: the "
          f"checkpoint at {path!r} is damaged; restore an earlier one.")


def _saved_records(reader):
  if not reader.has_tensor(_LAYOUT_KEY):
    raise ValueError(
        "checkpoint.restore: the checkpoint holds no state written by "
        "tfspmd.adapters.checkpoint.save with its leaves' paths (it was "
        "written by tf.train.Checkpoint directly, or by a "
        "tfspmd.adapters.checkpoint before leaves were saved by path). "
        "Restore it with the code that wrote it, and save it again with "
        "checkpoint.save.")
  layout = json.loads(reader.get_tensor(_LAYOUT_KEY))
  if layout["format"] != _FORMAT:
    raise ValueError(
        f"checkpoint.restore: the checkpoint's state has format "
        f"{layout['format']}, this tfspmd.adapters.checkpoint reads format "
        f"{_FORMAT}: restore it with the version that wrote it.")
  return layout["leaves"]


def _check_same_leaves(saved, wanted):
  """Raises unless `wanted` and `saved` name the same leaves."""
  absent = [name for name in wanted if name not in saved]
  wanted_names = set(wanted)
  dropped = [name for name in saved if name not in wanted_names]
  if not absent and not dropped:
    return
  problems = []
  if absent:
    problems.append(f"the checkpoint has no value for "
                    f"{_paths('like', absent)}")
  if dropped:
    problems.append(f"`like` has no place for the saved "
                    f"{_paths('state', dropped)}, which would be lost")
  raise ValueError(
      f"checkpoint.restore: `like` does not have the leaves of the saved "
      f"state: {'; '.join(problems)}. The checkpoint holds "
      f"{_paths('state', list(saved))}: restore into a `like` with those "
      f"leaves (the same dict keys, sequence lengths and namedtuple fields).")


def _paths(root, names, most=8):
  shown = ", ".join(root + name for name in names[:most])
  if len(names) > most:
    shown += f", ... ({len(names)} in all)"
  return shown


def _check_same_array(name, wanted, saved):
  """Raises unless the leaf `like` wants has the saved global shape and dtype."""
  if wanted["shape"] != saved["shape"]:
    raise ValueError(_shape_mismatch(name, wanted, saved))
  if wanted["dtype"] != saved["dtype"]:
    raise ValueError(
        f"checkpoint.restore: like{name} has dtype {wanted['dtype']}, but the "
        f"checkpoint saved state{name} as {saved['dtype']}. Restore into a "
        f"`like` of dtype {saved['dtype']}, and cast the result if you need "
        f"{wanted['dtype']}.")


def _shape_mismatch(name, wanted, saved):
  """The message for a leaf whose global shape is not the saved one."""
  head = (f"checkpoint.restore: like{name} has shape {_shape(wanted)} "
          f"{_where(wanted)}, but the checkpoint saved state{name} as shape "
          f"{_shape(saved)} {_where(saved)}")
  if _is_per_device(saved) and wanted["shape"][1:] == saved["shape"][1:]:
    rows, want = saved["shape"][0], wanted["shape"][0]
    return (f"{head}, one row of axis 0 per device. A per-device value has "
            f"no same values over another number of devices: restore it into "
            f"a NumPy `like` of shape {_shape(saved)} to get the {rows} saved "
            f"rows on the host, and build the {want} rows you need from them.")
  return (f"{head}. A restored array keeps its saved global shape, split "
          f"over any devices: restore into a `like` of shape "
          f"{_shape(saved)}.")


def _is_per_device(record):
  """True for a pmap result mapped over its devices: one row of axis 0 each."""
  shape, split = record["shape"], record["split"]
  return bool(shape) and shape[0] == split[0] == record["devices"] > 1


def _shape(record):
  return str(tuple(record["shape"]))


def _where(record):
  devices = record["devices"]
  if not devices:
    return "on the host"
  if devices == 1:
    return "on 1 device"
  if all(blocks == 1 for blocks in record["split"]):
    return f"replicated on {devices} devices"
  return f"split over {devices} devices"


def _block_targets(record):
  """Zero variables shaped like the saved blocks, for the checkpoint to fill."""
  shape = [n // count for n, count in zip(record["shape"], record["split"])]
  dtype = tf.as_dtype(record["dtype"])
  return [tf.Variable(tf.zeros(shape, dtype), trainable=False)
          for _ in np.ndindex(*record["split"])]


def _restored_leaf(targets, record, like):
  array = _global_array([target.numpy() for target in targets], record)
  if isinstance(like, tfspmd.ShardedArray):
    return _placement.place_like(array, like)
  return array


def _global_array(blocks, record):
  """The array whose blocks, in row-major order of the grid, are `blocks`."""
  if len(blocks) == 1:
    return blocks[0]
  array = np.empty(record["shape"], blocks[0].dtype)
  for grid_index, block in zip(np.ndindex(*record["split"]), blocks):
    array[tuple(slice(i * n, (i + 1) * n)
                for i, n in zip(grid_index, block.shape))] = block
  return array


def _trackables_mismatch(reader, trackables):
  """The message for trackables the checkpoint does not hold as given."""
  saved = sorted({key.split("/")[0]
                  for key in reader.get_variable_to_shape_map()}
                 - set(_NOT_TRACKABLES))
  absent = [name for name in sorted(trackables) if name not in saved]
  if absent:
    return (f"checkpoint.restore: the checkpoint holds nothing for the "
            f"trackables {absent}; beside the state it holds "
            f"{saved or 'nothing'}. Pass only objects saved with it, under "
            f"the names they were saved with.")
  return (f"checkpoint.restore: the trackables {sorted(trackables)} do not "
          f"match what the checkpoint holds under those names: pass objects "
          f"of the kind and structure that were saved (the same model, "
          f"optimizer or iterator).")
