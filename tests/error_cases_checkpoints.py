"""Mistakes with tfspmd.adapters.checkpoint.

Rows of the error catalogue (`error_catalogue`); tests/test_errors.py runs them.
"""

import os
import tempfile

import numpy as np
import tensorflow as tf

from tfspmd.adapters import checkpoint

from error_catalogue import case, P, CHECKPOINTS


def _saved(state, **trackables):
  """A checkpoint of `state` in a fresh directory."""
  return checkpoint.save(os.path.join(tempfile.mkdtemp(), "ckpt"), state,
                         **trackables)


_PARAMS = {"bias": np.zeros(3, np.float32),
           "kernel": np.zeros((4, 3), np.float32)}


@case("checkpoint-none-leaf", CHECKPOINTS, "checkpoint.save of a None leaf",
      TypeError, r"checkpoint\.save: state\['opt'\]\[1\] is None, which a "
      r"checkpoint cannot hold: leave the leaf out of the state, or put an "
      r"empty array \(np\.zeros\(0\)\) in its place")
def checkpoint_none_leaf():
  checkpoint.save(os.path.join(tempfile.mkdtemp(), "ckpt"),
                  {"w": np.zeros(2), "opt": [np.zeros(2), None]})


@case("checkpoint-not-an-array", CHECKPOINTS,
      "checkpoint.save of a leaf that is no array (a str)", TypeError,
      r"checkpoint\.save: state\['name'\] is a str, which a checkpoint cannot "
      r"hold: the leaves must be tfspmd\.ShardedArrays, tensors, NumPy arrays "
      r"or numbers")
def checkpoint_not_an_array():
  checkpoint.save(os.path.join(tempfile.mkdtemp(), "ckpt"),
                  {"w": np.zeros(2), "name": "run-3"})


@case("checkpoint-renamed-leaf", CHECKPOINTS,
      "checkpoint.restore into a `like` with a key renamed", ValueError,
      r"checkpoint\.restore: `like` does not have the leaves of the saved "
      r"state: the checkpoint has no value for like\['weights'\]; `like` has "
      r"no place for the saved state\['kernel'\], which would be lost\. The "
      r"checkpoint holds state\['bias'\], state\['kernel'\]")
def checkpoint_renamed_leaf():
  checkpoint.restore(_saved(_PARAMS), like={"bias": _PARAMS["bias"],
                                            "weights": _PARAMS["kernel"]})


@case("checkpoint-extra-leaf", CHECKPOINTS,
      "checkpoint.restore into a `like` with a key the checkpoint lacks",
      ValueError, r"the checkpoint has no value for like\['scale'\]\. The "
      r"checkpoint holds state\['bias'\], state\['kernel'\]")
def checkpoint_extra_leaf():
  checkpoint.restore(_saved(_PARAMS), like={**_PARAMS, "scale": np.zeros(3)})


@case("checkpoint-missing-leaf", CHECKPOINTS,
      "checkpoint.restore into a `like` without one of the saved keys",
      ValueError, r"`like` has no place for the saved state\['bias'\], which "
      r"would be lost")
def checkpoint_missing_leaf():
  checkpoint.restore(_saved(_PARAMS), like={"kernel": _PARAMS["kernel"]})


@case("checkpoint-shape", CHECKPOINTS,
      "checkpoint.restore into a leaf of another global shape", ValueError,
      r"like\['kernel'\] has shape \(3, 4\) on the host, but the checkpoint "
      r"saved state\['kernel'\] as shape \(4, 3\) on the host\. A restored "
      r"array keeps its saved global shape, split over any devices: restore "
      r"into a `like` of shape \(4, 3\)")
def checkpoint_shape():
  checkpoint.restore(_saved(_PARAMS), like={"bias": _PARAMS["bias"],
                                            "kernel": np.zeros((3, 4))})


@case("checkpoint-dtype", CHECKPOINTS,
      "checkpoint.restore into a leaf of another dtype", ValueError,
      r"like\['bias'\] has dtype float64, but the checkpoint saved "
      r"state\['bias'\] as float32\. Restore into a `like` of dtype float32")
def checkpoint_dtype():
  checkpoint.restore(_saved(_PARAMS), like={"bias": np.zeros(3),
                                            "kernel": _PARAMS["kernel"]})


@case("checkpoint-per-device-count", CHECKPOINTS,
      "checkpoint.restore of a per-device pmap value from 8 devices onto 4",
      ValueError, r"like\['s'\] has shape \(4, 2\) split over 4 devices, but "
      r"the checkpoint saved state\['s'\] as shape \(8, 2\) split over 8 "
      r"devices, one row of axis 0 per device\. .*restore it into a NumPy "
      r"`like` of shape \(8, 2\) to get the 8 saved rows")
def checkpoint_per_device_count():
  path = _saved({"s": P(lambda x: x + 1)(np.zeros((8, 2)))})
  checkpoint.restore(path, like={"s": P(lambda x: x + 1)(np.zeros((4, 2)))})


@case("checkpoint-not-found", CHECKPOINTS,
      "checkpoint.restore of a path with no checkpoint", FileNotFoundError,
      r"checkpoint\.restore: there is no checkpoint at '/nonexistent/ckpt'\. "
      r"Pass the path given to checkpoint\.save, or the prefix it returned\.")
def checkpoint_not_found():
  checkpoint.restore("/nonexistent/ckpt", like=_PARAMS)


@case("checkpoint-replaced", CHECKPOINTS,
      "checkpoint.restore of a prefix save returned, after a later save to "
      "the same path", FileNotFoundError,
      r"there is no checkpoint at '/tmp/run/ckpt\.tfspmd-<32 hex digits>': a "
      r"later checkpoint\.save to '/tmp/run/ckpt' replaced it\. Restore "
      r"'/tmp/run/ckpt' for the latest checkpoint saved there\.")
def checkpoint_replaced():
  path = os.path.join(tempfile.mkdtemp(), "ckpt")
  first = checkpoint.save(path, _PARAMS)
  checkpoint.save(path, _PARAMS)
  checkpoint.restore(first, like=_PARAMS)


def _damaged(damage):
  """The path of a checkpoint of `_PARAMS`, after `damage(path, prefix)`.

  `_PARAMS` is 60 bytes of numbers (3 + 12 float32s); `prefix` is the one
  `save` returned, whose files the pointer at `path` names.
  """
  path = os.path.join(tempfile.mkdtemp(), "ckpt")
  damage(path, checkpoint.save(path, _PARAMS))
  return path


def _truncate(file, size):
  with open(file, "r+b") as opened:
    opened.truncate(size)


def _overwrite(file, contents):
  with open(file, "wb") as opened:
    opened.write(contents)


def _flip_last_byte(file):
  with open(file, "r+b") as opened:
    opened.seek(-1, os.SEEK_END)
    last = opened.read(1)[0]
    opened.seek(-1, os.SEEK_END)
    opened.write(bytes([last ^ 0xFF]))


_DATA = ".data-00000-of-00001"


@case("checkpoint-data-cut-short", CHECKPOINTS,
      "checkpoint.restore of a checkpoint whose data file was cut short",
      ValueError, r"checkpoint\.restore: the data file '/tmp/run/ckpt\.tfspmd-"
      r"<32 hex digits>\.data-00000-of-00001' is 10 bytes, shorter than the 60 "
      r"the index says it holds: the checkpoint at '/tmp/run/ckpt' is "
      r"damaged; restore an earlier one\.")
def checkpoint_data_cut_short():
  path = _damaged(lambda path, prefix: _truncate(prefix + _DATA, 10))
  checkpoint.restore(path, like=_PARAMS)


@case("checkpoint-data-cut-by-a-byte", CHECKPOINTS,
      "checkpoint.restore of a checkpoint whose data file lost its last byte",
      ValueError, r"checkpoint\.restore: the data file '/tmp/run/ckpt\.tfspmd-"
      r"<32 hex digits>\.data-00000-of-00001' is shorter than the index "
      r"'/tmp/run/ckpt\.tfspmd-<32 hex digits>\.index' says: the checkpoint at "
      r"'/tmp/run/ckpt' is damaged; restore an earlier one\.")
def checkpoint_data_cut_by_a_byte():
  path = _damaged(lambda path, prefix: _truncate(
      prefix + _DATA, os.path.getsize(prefix + _DATA) - 1))
  checkpoint.restore(path, like=_PARAMS)


@case("checkpoint-data-changed", CHECKPOINTS,
      "checkpoint.restore of a checkpoint whose data file was changed",
      ValueError, r"checkpoint\.restore: the data file '/tmp/run/ckpt\.tfspmd-"
      r"<32 hex digits>\.data-00000-of-00001' does not match the checksums of "
      r"the index '/tmp/run/ckpt\.tfspmd-<32 hex digits>\.index': the "
      r"checkpoint at '/tmp/run/ckpt' is damaged; restore an earlier one\.")
def checkpoint_data_changed():
  path = _damaged(lambda path, prefix: _flip_last_byte(prefix + _DATA))
  checkpoint.restore(path, like=_PARAMS)


@case("checkpoint-data-missing", CHECKPOINTS,
      "checkpoint.restore of a checkpoint whose data file was removed",
      ValueError, r"checkpoint\.restore: the data file '/tmp/run/ckpt\.tfspmd-"
      r"<32 hex digits>\.data-00000-of-00001' is missing: the checkpoint at "
      r"'/tmp/run/ckpt' is damaged; restore an earlier one\.")
def checkpoint_data_missing():
  path = _damaged(lambda path, prefix: os.remove(prefix + _DATA))
  checkpoint.restore(path, like=_PARAMS)


@case("checkpoint-index-garbage", CHECKPOINTS,
      "checkpoint.restore of a checkpoint whose index is no index",
      ValueError, r"checkpoint\.restore: the index file '/tmp/run/ckpt\.tfspmd-"
      r"<32 hex digits>\.index' is not a checkpoint index: the checkpoint at "
      r"'/tmp/run/ckpt' is damaged; restore an earlier one\.")
def checkpoint_index_garbage():
  path = _damaged(lambda path, prefix: _overwrite(prefix + ".index",
                                                  b"not an index"))
  checkpoint.restore(path, like=_PARAMS)


@case("checkpoint-index-missing", CHECKPOINTS,
      "checkpoint.restore of a checkpoint whose index was removed",
      ValueError, r"checkpoint\.restore: the index file '/tmp/run/ckpt\.tfspmd-"
      r"<32 hex digits>\.index', which '/tmp/run/ckpt\.tfspmd' names, is "
      r"missing: the checkpoint at '/tmp/run/ckpt' is damaged; restore an "
      r"earlier one\.")
def checkpoint_index_missing():
  path = _damaged(lambda path, prefix: os.remove(prefix + ".index"))
  checkpoint.restore(path, like=_PARAMS)


@case("checkpoint-pointer-garbage", CHECKPOINTS,
      "checkpoint.restore of a path whose .tfspmd file names no checkpoint",
      ValueError, r"checkpoint\.restore: '/tmp/run/ckpt\.tfspmd', the file "
      r"that names the current checkpoint files of '/tmp/run/ckpt', names "
      r"none: the checkpoint at '/tmp/run/ckpt' is damaged; restore an "
      r"earlier one\.")
def checkpoint_pointer_garbage():
  path = _damaged(lambda path, prefix: _overwrite(path + ".tfspmd", b"{"))
  checkpoint.restore(path, like=_PARAMS)


@case("checkpoint-not-from-save", CHECKPOINTS,
      "checkpoint.restore of a checkpoint not written by checkpoint.save",
      ValueError, r"the checkpoint holds no state written by "
      r"tfspmd\.adapters\.checkpoint\.save with its leaves' paths")
def checkpoint_not_from_save():
  path = tf.train.Checkpoint(state=[tf.Variable(1.)]).write(
      os.path.join(tempfile.mkdtemp(), "ckpt"))
  checkpoint.restore(path, like=[np.float32(0)])


@case("checkpoint-trackable-absent", CHECKPOINTS,
      "checkpoint.restore with a trackable that was not saved", ValueError,
      r"the checkpoint holds nothing for the trackables \['epoch'\]; beside "
      r"the state it holds \['step'\]")
def checkpoint_trackable_absent():
  path = _saved(_PARAMS, step=tf.Variable(3))
  checkpoint.restore(path, like=_PARAMS, epoch=tf.Variable(0))


@case("checkpoint-trackable-mismatch", CHECKPOINTS,
      "checkpoint.restore with a trackable of another shape than saved",
      ValueError, r"the trackables \['step'\] do not match what the "
      r"checkpoint holds under those names")
def checkpoint_trackable_mismatch():
  path = _saved(_PARAMS, step=tf.Variable(3))
  checkpoint.restore(path, like=_PARAMS, step=tf.Variable([0, 0]))
