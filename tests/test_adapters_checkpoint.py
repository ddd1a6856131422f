"""tfspmd.adapters.checkpoint: pmap training state through tf.train.Checkpoint.

A run resumed from a checkpoint must continue with bit-identical numbers to
the run that was never interrupted. A state restored onto other devices
keeps its global values, split over them as `like` is; whatever cannot keep
them (another global shape, dtype or set of leaves) is an error naming the
leaf, never a silent drop or swap. A save killed at any step leaves the old
checkpoint or the new one, whole; a damaged checkpoint is an error naming it.
"""

import collections
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
from unittest import mock

import numpy as np
import pytest
import tensorflow as tf

import keras
import tfspmd
from tfspmd import lax
from tfspmd.adapters import checkpoint
from tfspmd.adapters import keras_training

import warm_python


def per_device_step():
  # w is replicated, s is one row per device: both must survive a restart.
  def step(w, s, x):
    w = w - 0.1 * lax.pmean(tf.reduce_sum(s * x, 0), "i")
    return w, s * 0.5 + tf.sin(x * w)
  return tfspmd.pmap(step, "i", in_axes=(None, 0, 0), out_axes=(None, 0))


def inputs(t):
  return np.random.default_rng(t).standard_normal((8, 4, 3)).astype(np.float32)


def test_resumed_pmap_state_continues_bit_identically(tmp_path):
  step = per_device_step()
  w0 = np.ones(3, np.float32)
  s0 = np.arange(96, dtype=np.float32).reshape(8, 4, 3) / 96
  w, s = w0, s0
  for t in range(4):
    w, s = step(w, s, inputs(t))

  resumed_w, resumed_s = w0, s0
  for t in range(2):
    resumed_w, resumed_s = step(resumed_w, resumed_s, inputs(t))
  path = checkpoint.save(str(tmp_path / "ckpt"), (resumed_w, resumed_s))
  resumed_w, resumed_s = checkpoint.restore(path, like=(resumed_w, resumed_s))
  assert isinstance(resumed_s, tfspmd.ShardedArray)
  assert resumed_s.placement is s.placement
  for t in range(2, 4):
    resumed_w, resumed_s = step(resumed_w, resumed_s, inputs(t))

  np.testing.assert_array_equal(resumed_w, w)
  np.testing.assert_array_equal(resumed_s, s)


def test_replicated_leaves_are_stored_once_and_split_ones_per_device(tmp_path):
  w, s = per_device_step()(np.ones(3, np.float32),
                           np.ones((8, 4, 3), np.float32), inputs(0))
  path = checkpoint.save(str(tmp_path / "ckpt"), {"w": w, "s": s})
  stored = {name: shape for name, shape in tf.train.list_variables(path)
            if name.startswith("state/")}
  # Each leaf under its path: 's' as 8 blocks, 'w' as one copy.
  assert stored == {
      **{f"state/leaves/['s']/{d}/.ATTRIBUTES/VARIABLE_VALUE": [1, 4, 3]
         for d in range(8)},
      "state/leaves/['w']/0/.ATTRIBUTES/VARIABLE_VALUE": [3],
      "state/layout/.ATTRIBUTES/VARIABLE_VALUE": []}
  reader = tf.train.load_checkpoint(path)
  for d in range(8):
    np.testing.assert_array_equal(
        reader.get_tensor(f"state/leaves/['s']/{d}/.ATTRIBUTES/VARIABLE_VALUE"),
        np.asarray(s)[d:d + 1])
  layout = json.loads(
      reader.get_tensor("state/layout/.ATTRIBUTES/VARIABLE_VALUE"))
  assert layout == {"format": 2, "leaves": [
      {"path": "['s']", "shape": [8, 4, 3], "dtype": "float32",
       "split": [8, 1, 1], "devices": 8},
      {"path": "['w']", "shape": [3], "dtype": "float32", "split": [1],
       "devices": 8}]}


def test_host_leaves_and_trackables_are_saved_beside(tmp_path):
  epoch = tf.Variable(7)
  path = checkpoint.save(str(tmp_path / "ckpt"),
                         {"lr": np.float32(0.5), "seen": np.arange(3)},
                         epoch=epoch)
  epoch.assign(0)
  state = checkpoint.restore(
      path, like={"lr": np.float32(0), "seen": np.zeros(3, np.int64)},
      epoch=epoch)
  assert int(epoch) == 7
  assert state["lr"] == 0.5
  np.testing.assert_array_equal(state["seen"], [0, 1, 2])


def test_restoring_into_another_structure_is_an_error(tmp_path):
  out = tfspmd.pmap(lambda x: x)(np.zeros((8, 2), np.float32))
  path = checkpoint.save(str(tmp_path / "ckpt"), [out])
  with pytest.raises(ValueError, match=r"the checkpoint has no value for "
                     r"like\[1\]\. The checkpoint holds state\[0\]"):
    checkpoint.restore(path, like=[out, out])


# --- other device counts: the global value, re-split --------------------------

DEVICES = tfspmd.devices()
X = np.arange(48, dtype=np.float32).reshape(16, 3)
W = np.array([0.5, -1.0, 2.0], np.float32)


def shard_map_on(devices, spec):
  """x + 1 by shard_map over a 1-D mesh of `devices`, in and out split by `spec`."""
  mesh = tfspmd.make_mesh((len(devices),), ("x",), devices=devices)
  return tfspmd.shard_map(lambda b: b + 1, mesh=mesh, in_specs=spec,
                          out_specs=spec)


def elastic_state(count):
  """A (16, 3) array split in `count` blocks of rows, and a replicated (3,)."""
  devices = DEVICES[:count]
  rows = shard_map_on(devices, tfspmd.P("x"))(X)
  w = tfspmd.pmap(lambda w: w * 2, in_axes=None, out_axes=None,
                  axis_size=count, devices=devices)(W)
  return {"rows": rows, "w": w}


def assert_blocks(array, expected_blocks, devices):
  """Device i of `devices` holds `expected_blocks[i]`, exactly."""
  shards = array.addressable_shards
  assert [shard.device for shard in shards] == list(devices)
  for shard, expected in zip(shards, expected_blocks):
    assert np.max(np.abs(shard.data.numpy() - expected)) == 0


@pytest.mark.parametrize("saved_count, restored_count",
                         [(8, 4), (4, 8), (8, 1)])
def test_state_restores_onto_another_device_count_with_its_global_values(
    tmp_path, saved_count, restored_count):
  path = checkpoint.save(str(tmp_path / "ckpt"), elastic_state(saved_count))
  like = elastic_state(restored_count)
  restored = checkpoint.restore(path, like=like)

  rows = X + 1                       # the saved global values, from NumPy
  w = W * 2
  per_block = 16 // restored_count   # rows of the (16, 3) array per device
  devices = DEVICES[:restored_count]
  assert restored["rows"].shape == (16, 3)
  assert restored["rows"].placement is like["rows"].placement
  assert_blocks(restored["rows"],
                [rows[d * per_block:(d + 1) * per_block]
                 for d in range(restored_count)], devices)
  assert restored["w"].placement is like["w"].placement
  assert_blocks(restored["w"], [w] * restored_count, devices)
  np.testing.assert_array_equal(np.asarray(restored["rows"]), rows)


def test_a_2d_split_restores_onto_a_1d_split_and_replicated(tmp_path):
  mesh = tfspmd.make_mesh((2, 4), ("data", "model"))
  x = np.arange(64, dtype=np.float32).reshape(16, 4)
  spec = tfspmd.P("model", "data")
  saved = tfspmd.shard_map(lambda b: b * 3, mesh=mesh, in_specs=spec,
                           out_specs=spec)(x)
  path = checkpoint.save(str(tmp_path / "ckpt"), saved)
  assert [shape for name, shape in tf.train.list_variables(path)
          if name.startswith("state/leaves/")] == [[4, 2]] * 8

  zeros = np.zeros((16, 4), np.float32)
  split = checkpoint.restore(
      path, like=shard_map_on(DEVICES[4:], tfspmd.P("x"))(zeros))
  assert_blocks(split, [x[4 * d:4 * (d + 1)] * 3 for d in range(4)],
                DEVICES[4:])
  replicated = checkpoint.restore(
      path, like=shard_map_on(DEVICES[:2], tfspmd.P())(zeros))
  assert_blocks(replicated, [x * 3] * 2, DEVICES[:2])


_ALL = tuple(tfspmd.devices())
_SHUFFLED = tuple(_ALL[k] for k in (3, 6, 0, 5, 2, 7, 4, 1))


@pytest.mark.parametrize("devices, shape, names, spec", [
    (_ALL, (2, 4), ("a", "b"), tfspmd.P(("b", "a"))),
    (_ALL, (2, 2, 2), ("a", "b", "c"), tfspmd.P(("c", "a"), "b")),
    (_SHUFFLED, (8,), ("x",), tfspmd.P("x")),
    (_SHUFFLED, (2, 4), ("a", "b"), tfspmd.P("b", "a")),
])
def test_splits_in_any_device_order_restore_their_values(
    tmp_path, devices, shape, names, spec):
  # Axes split over mesh axes in another order than the mesh's, or a mesh
  # of shuffled devices: the devices' order differs from the blocks'.
  mesh = tfspmd.sharding.Mesh(np.array(devices).reshape(shape), names)
  x = np.arange(16 * 4, dtype=np.float32).reshape(16, 4)
  saved = tfspmd.device_put(x, tfspmd.sharding.NamedSharding(mesh, spec))
  np.testing.assert_array_equal(np.asarray(saved), x)
  path = checkpoint.save(str(tmp_path / "ckpt"), {"w": saved})
  zeros = np.zeros_like(x)
  for like in (saved, tfspmd.device_put(zeros, tfspmd.sharding.NamedSharding(
      tfspmd.make_mesh((8,), ("x",)), tfspmd.P("x")))):
    restored = checkpoint.restore(path, like={"w": like})["w"]
    np.testing.assert_array_equal(np.asarray(restored), x)
    for shard in restored.addressable_shards:
      np.testing.assert_array_equal(shard.data.numpy(), x[shard.index])


def test_host_and_device_leaves_restore_into_each_other(tmp_path):
  path = checkpoint.save(str(tmp_path / "ckpt"),
                         {"host": X, "device": elastic_state(8)["rows"]})
  like = {"host": elastic_state(4)["rows"], "device": np.zeros((16, 3),
                                                               np.float32)}
  restored = checkpoint.restore(path, like=like)
  assert_blocks(restored["host"], [X[4 * d:4 * (d + 1)] for d in range(4)],
                DEVICES[:4])
  assert isinstance(restored["device"], np.ndarray)
  np.testing.assert_array_equal(restored["device"], X + 1)


def per_device_rows(count, devices):
  """A pmap result of shape (count, 2): device d's row is [d, -d]."""
  rows = np.stack([np.arange(count), -np.arange(count)], 1).astype(np.float32)
  return tfspmd.pmap(lambda r: r * 1, devices=devices)(rows)


@pytest.mark.parametrize("saved_count, restored_count",
                         [(8, 4), (4, 8), (8, 1)])
def test_per_device_values_cannot_go_to_another_device_count(
    tmp_path, saved_count, restored_count):
  saved = per_device_rows(saved_count, DEVICES[:saved_count])
  path = checkpoint.save(str(tmp_path / "ckpt"), {"s": saved})
  like = {"s": per_device_rows(restored_count, DEVICES[:restored_count])}
  where = ("on 1 device" if restored_count == 1
           else f"split over {restored_count} devices")
  with pytest.raises(ValueError, match=(
      rf"like\['s'\] has shape \({restored_count}, 2\) {where}, but the "
      rf"checkpoint saved state\['s'\] as shape \({saved_count}, 2\) split "
      rf"over {saved_count} devices, one row of axis 0 per device\. .* "
      rf"restore it into a NumPy `like` of shape \({saved_count}, 2\)")):
    checkpoint.restore(path, like=like)

  # What the message says to do gives the saved rows.
  rows = checkpoint.restore(
      path, like={"s": np.zeros((saved_count, 2), np.float32)})["s"]
  np.testing.assert_array_equal(
      rows, np.stack([np.arange(saved_count), -np.arange(saved_count)], 1))


def test_per_device_values_move_to_as_many_other_devices(tmp_path):
  path = checkpoint.save(str(tmp_path / "ckpt"),
                         per_device_rows(4, DEVICES[:4]))
  restored = checkpoint.restore(path, like=per_device_rows(4, DEVICES[4:]))
  assert_blocks(restored, [[[d, -d]] for d in range(4)], DEVICES[4:])


# --- leaves by path: no drop, no swap -----------------------------------------

KERNEL = np.arange(12, dtype=np.float32).reshape(4, 3)
BIAS = np.array([1, 2, 3], np.float32)


@pytest.mark.parametrize("like, message", [
    ({"bias": BIAS, "kern": KERNEL},
     r"the checkpoint has no value for like\['kern'\]; `like` has no place "
     r"for the saved state\['kernel'\], which would be lost\. The "
     r"checkpoint holds state\['bias'\], state\['kernel'\]"),
    ({"bias": BIAS, "kernel": KERNEL, "scale": BIAS},
     r"the checkpoint has no value for like\['scale'\]\. The checkpoint "
     r"holds"),
    ({"kernel": KERNEL},
     r"`like` has no place for the saved state\['bias'\], which would be "
     r"lost\."),
    ([BIAS, KERNEL],
     r"the checkpoint has no value for like\[0\], like\[1\]; `like` has "
     r"no place for the saved state\['bias'\], state\['kernel'\]"),
    ({"bias": BIAS, "kernel": KERNEL.T},
     r"like\['kernel'\] has shape \(3, 4\) on the host, but the checkpoint "
     r"saved state\['kernel'\] as shape \(4, 3\) on the host\. A restored "
     r"array keeps its saved global shape, split over any devices: restore "
     r"into a `like` of shape \(4, 3\)\."),
    ({"bias": BIAS.astype(np.float64), "kernel": KERNEL},
     r"like\['bias'\] has dtype float64, but the checkpoint saved "
     r"state\['bias'\] as float32\. Restore into a `like` of dtype float32"),
], ids=["renamed-key", "extra-key", "missing-key", "list-for-dict",
        "shape", "dtype"])
def test_a_like_whose_leaves_differ_from_the_saved_ones_is_an_error(
    tmp_path, like, message):
  path = checkpoint.save(str(tmp_path / "ckpt"),
                         {"bias": BIAS, "kernel": KERNEL})
  with pytest.raises(ValueError, match=r"^checkpoint\.restore: .*" + message):
    checkpoint.restore(path, like=like)


def test_leaves_are_matched_by_path_not_by_position(tmp_path):
  saved_type = collections.namedtuple("Params", ["kernel", "bias", "scale"])
  like_type = collections.namedtuple("Params", ["scale", "bias", "kernel"])
  path = checkpoint.save(str(tmp_path / "ckpt"),
                         saved_type(KERNEL, BIAS, BIAS * 10))
  zeros = np.zeros(3, np.float32)
  restored = checkpoint.restore(
      path, like=like_type(zeros, zeros, np.zeros((4, 3), np.float32)))
  assert isinstance(restored, like_type)
  np.testing.assert_array_equal(restored.kernel, KERNEL)
  np.testing.assert_array_equal(restored.bias, [1, 2, 3])
  np.testing.assert_array_equal(restored.scale, [10, 20, 30])


def test_a_none_leaf_is_an_error_that_says_what_to_do(tmp_path):
  path = str(tmp_path / "ckpt")
  with pytest.raises(TypeError, match=(
      r"checkpoint\.save: state\['opt'\]\[1\] is None, which a checkpoint "
      r"cannot hold: leave the leaf out of the state, or put an empty array "
      r"\(np\.zeros\(0\)\) in its place\.")):
    checkpoint.save(path, {"w": BIAS, "opt": [BIAS, None]})
  assert not os.listdir(tmp_path)

  checkpoint.save(path, {"w": BIAS})
  with pytest.raises(TypeError, match=r"checkpoint\.restore: like\['v'\] is "
                     r"None"):
    checkpoint.restore(path, like={"w": BIAS, "v": None})


def test_a_leaf_that_is_no_array_is_an_error(tmp_path):
  with pytest.raises(TypeError, match=(
      r"checkpoint\.save: state\['name'\] is a str, which a checkpoint "
      r"cannot hold: the leaves must be tfspmd\.ShardedArrays, tensors, "
      r"NumPy arrays or numbers\.")):
    checkpoint.save(str(tmp_path / "ckpt"), {"w": BIAS, "name": "run-3"})


def test_restoring_what_is_not_there_is_an_error(tmp_path):
  with pytest.raises(FileNotFoundError, match=(
      r"there is no checkpoint at '.*nowhere'\. Pass the path given to "
      r"checkpoint\.save, or the prefix it returned\.")):
    checkpoint.restore(str(tmp_path / "nowhere"), like=BIAS)

  raw = tf.train.Checkpoint(state=[tf.Variable(BIAS)]).write(
      str(tmp_path / "raw"))
  with pytest.raises(ValueError, match=(
      r"the checkpoint holds no state written by tfspmd\.adapters\.checkpoint"
      r"\.save "
      r"with its leaves' paths")):
    checkpoint.restore(raw, like=[BIAS])

  path = checkpoint.save(str(tmp_path / "ckpt"), BIAS, step=tf.Variable(3))
  with pytest.raises(ValueError, match=(
      r"the checkpoint holds nothing for the trackables \['epoch'\]; beside "
      r"the state it holds \['step'\]\.")):
    checkpoint.restore(path, like=BIAS, epoch=tf.Variable(0))


def test_a_checkpoints_own_file_given_as_its_path_says_which_path(tmp_path):
  # Nothing is damaged: the message names the path to give.
  base = str(tmp_path / "ckpt")
  prefix = checkpoint.save(base, BIAS)
  for given, named in ((base + ".tfspmd", base),
                       (prefix + ".index", prefix)):
    with pytest.raises(ValueError, match=(
        rf"{re.escape(repr(given))} is one of the files of the checkpoint at "
        rf"{re.escape(repr(named))}; give the path `save` was given \(or the "
        rf"prefix it returned\)")):
      checkpoint.restore(given, like=BIAS)
  np.testing.assert_array_equal(checkpoint.restore(base, like=BIAS), BIAS)


def classifier(weights=None):
  keras.utils.set_random_seed(3)
  model = keras.Sequential([keras.Input((4,)),
                            keras.layers.Dense(8, activation="relu"),
                            keras.layers.Dense(3)])
  model.compile(optimizer=keras.optimizers.Adam(0.02),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True),
                metrics=["accuracy"])
  if weights is not None:
    model.set_weights(weights)
  return model


def test_resumed_keras_training_is_bit_identical(tmp_path):
  rng = np.random.default_rng(0)
  x = rng.standard_normal((96, 4)).astype(np.float32)
  y = rng.integers(0, 3, 96).astype(np.int32)
  dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
  weights = classifier().get_weights()

  uninterrupted = classifier(weights)
  expected = keras_training.KerasTrainer(uninterrupted).fit(
      dataset, epochs=3, verbose=0).history

  first = keras_training.KerasTrainer(classifier(weights))
  first.fit(dataset, epochs=2, verbose=0)
  path = checkpoint.save(os.path.join(tmp_path, "ckpt"), first.state,
                         epoch=tf.Variable(2))

  model = classifier()  # other initial weights: all come from the checkpoint
  second = keras_training.KerasTrainer(model)
  second.build(dataset)
  epoch = tf.Variable(0)
  second.state = checkpoint.restore(path, like=second.state, epoch=epoch)
  history = second.fit(dataset, epochs=3, initial_epoch=int(epoch),
                       verbose=0).history

  assert history["loss"] == expected["loss"][2:]
  assert history["accuracy"] == expected["accuracy"][2:]
  for got, want in zip(model.get_weights(), uninterrupted.get_weights()):
    np.testing.assert_array_equal(got, want)
  for got, want in zip(model.optimizer.variables,
                       uninterrupted.optimizer.variables):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# --- crashes: the old checkpoint or the new one, whole ------------------------

# The directory holding the tfspmd package, for the children.
SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(
    tfspmd.__file__)))

# A child that saves the state of an .npz file to a path and is killed
# (os._exit, as SIGKILL: nothing is cleaned up) just before its Nth call of
# a file operation; it prints which. With fewer calls than N it saves whole.
# A child that dies of a signal instead prints every thread's stack.
CRASHING_SAVE = textwrap.dedent("""
    import faulthandler
    import os
    import sys

    import numpy as np
    import tensorflow as tf

    import tfspmd
    from tfspmd.adapters import checkpoint

    faulthandler.enable()
    path, arrays, crash_at = sys.argv[1], np.load(sys.argv[2]), int(sys.argv[3])
    calls = 0


    def crashing(step, operation):
      def run(*args, **kwargs):
        global calls
        calls += 1
        if calls == crash_at:
          print(step, flush=True)
          os._exit(9)
        return operation(*args, **kwargs)
      return run


    tf.train.Checkpoint.write = crashing("write", tf.train.Checkpoint.write)
    os.fsync = crashing("fsync", os.fsync)
    tf.io.gfile.rename = crashing("rename", tf.io.gfile.rename)
    tf.io.gfile.remove = crashing("remove", tf.io.gfile.remove)
    tf.io.gfile.rmtree = crashing("remove", tf.io.gfile.rmtree)
    state = {"w": arrays["w"], "rows": tfspmd.pmap(lambda x: x)(arrays["rows"])}
    checkpoint.save(path, state, epoch=tf.Variable(arrays["epoch"]))
""")


def numbered_state(k):
  """State k of a run: w = k * [0, ..., 5], rows[d] = [k, d], epoch k."""
  rows = np.stack([np.full(8, k), np.arange(8)], 1).astype(np.float32)
  return {"w": np.arange(6, dtype=np.float32) * k, "rows": rows,
          "epoch": np.int64(k)}


def restored_state(path):
  """The state at `path` as NumPy arrays: what a resumed run would read."""
  epoch = tf.Variable(np.int64(-1))
  state = checkpoint.restore(
      path, like={"w": np.zeros(6, np.float32),
                  "rows": np.zeros((8, 2), np.float32)}, epoch=epoch)
  return {**state, "epoch": epoch.numpy()}


def which_state(path, candidates):
  """The k of `candidates` whose numbered_state(k) `path` holds exactly."""
  state = restored_state(path)
  matches = [k for k in candidates
             if all(np.array_equal(state[key], numbered_state(k)[key])
                    for key in ("w", "rows", "epoch"))]
  assert len(matches) == 1, state
  return matches[0]


def save_numbered(path, k):
  state = numbered_state(k)
  return checkpoint.save(path, {"w": state["w"], "rows": state["rows"]},
                         epoch=tf.Variable(state["epoch"]))


def write_earlier_format(path, k):
  """numbered_state(k) as the plain TensorFlow files an earlier save wrote.

  Those are TensorFlow's files of the checkpoint at the prefix `path`
  itself: the files of a save elsewhere, renamed (an index does not name
  its own prefix).
  """
  elsewhere = save_numbered(os.path.join(os.path.dirname(path), "elsewhere",
                                         "ckpt"), k)
  for suffix in (".index", ".data-00000-of-00001"):
    os.rename(elsewhere + suffix, path + suffix)


def checkpoint_files(directory):
  """The files of `directory` but the one of `write_earlier_format`."""
  return sorted(name for name in os.listdir(directory) if name != "elsewhere")


def run_crashing_save(path, state_file, crash_at, output):
  """Runs CRASHING_SAVE; returns the step it was killed at (None: it ended).

  The child is forked from a process that has imported TensorFlow
  (`warm_python`): each of the dozens of children would otherwise spend
  seconds importing it.
  """
  child = warm_python.shared().start(
      code=CRASHING_SAVE, argv=["-c", path, state_file, str(crash_at)],
      env=os.environ, stdout=output + ".out", stderr=output + ".err")
  try:
    code = child.wait(timeout=300)
  finally:
    child.kill()
  if code == 0:
    return None
  with open(output + ".err", encoding="utf-8") as err:
    assert code == 9, err.read()[-6000:]
  with open(output + ".out", encoding="utf-8") as out:
    return out.read().strip()


@pytest.mark.parametrize("old_format", ["saved", "earlier format"])
def test_a_save_killed_at_any_step_leaves_the_old_or_the_new_state(
    tmp_path, old_format):
  state_file = str(tmp_path / "new.npz")
  np.savez(state_file, **numbered_state(2))
  steps, restored = [], []
  for crash_at in range(1, 40):
    directory = tmp_path / f"crash-{crash_at}"
    directory.mkdir()
    path = str(directory / "ckpt")
    if old_format == "saved":
      save_numbered(path, 1)
    else:
      write_earlier_format(path, 1)
    step = run_crashing_save(path, state_file, crash_at,
                             str(tmp_path / f"child-{crash_at}"))
    restored.append(which_state(path, [1, 2]))

    # The next save goes on from whatever the killed one left, and removes it.
    latest = save_numbered(path, 3)
    assert which_state(path, [1, 2, 3]) == 3
    name = os.path.basename(latest)
    assert checkpoint_files(directory) == sorted([
        "ckpt.tfspmd", "ckpt.tfspmd.lock", name + ".data-00000-of-00001",
        name + ".index"])
    if step is None:
      break
    steps.append(step)

  # The state switches from old to new at the rename of the pointer, and at
  # no other step; the save was killed before each of its file operations.
  switch = steps.index("rename")
  assert restored == [1] * (switch + 1) + [2] * (len(steps) - switch)
  assert steps[0] == "write"
  assert steps[1:switch] == ["fsync"] * (switch - 1)
  assert steps[switch + 1] == "fsync"
  assert steps[switch + 2:] == ["remove"] * (len(steps) - switch - 2)
  assert len(steps) - switch - 2 == 2  # the old index and data file


def test_a_save_flushes_the_new_files_before_it_switches_to_them(tmp_path):
  path = str(tmp_path / "ckpt")
  operations = []
  fsync, rename = os.fsync, tf.io.gfile.rename

  def recording_fsync(descriptor):
    operations.append(("fsync", os.readlink(f"/proc/self/fd/{descriptor}")))
    fsync(descriptor)

  def recording_rename(source, target, overwrite=False):
    operations.append(("rename", source, target))
    rename(source, target, overwrite)

  with mock.patch.object(os, "fsync", recording_fsync), \
       mock.patch.object(tf.io.gfile, "rename", recording_rename):
    prefix = save_numbered(path, 1)
  assert operations == [
      ("fsync", prefix + ".data-00000-of-00001"),
      ("fsync", prefix + ".index"),
      ("fsync", prefix + ".next"),
      ("fsync", str(tmp_path)),
      ("rename", prefix + ".next", path + ".tfspmd"),
      ("fsync", str(tmp_path))]


def test_saving_again_to_a_path_replaces_its_checkpoint(tmp_path):
  path = str(tmp_path / "ckpt")
  first = save_numbered(path, 1)
  assert re.fullmatch(re.escape(path) + r"\.tfspmd-[0-9a-f]{32}", first)
  assert which_state(first, [1]) == 1
  assert which_state(path, [1]) == 1
  second = save_numbered(path, 2)
  assert which_state(path, [1, 2]) == 2
  assert which_state(second, [1, 2]) == 2
  name = os.path.basename(second)
  assert sorted(os.listdir(tmp_path)) == sorted([
      "ckpt.tfspmd", "ckpt.tfspmd.lock", name + ".data-00000-of-00001",
        name + ".index"])
  with pytest.raises(FileNotFoundError, match=(
      rf"there is no checkpoint at '{re.escape(first)}': a later "
      rf"checkpoint\.save to '{re.escape(path)}' replaced it\. Restore "
      rf"'{re.escape(path)}' for the latest checkpoint saved there\.")):
    restored_state(first)
  # What `tf.train.load_checkpoint` reads at the returned prefix is the state.
  np.testing.assert_array_equal(
      tf.train.load_checkpoint(second).get_tensor(
          "state/leaves/['w']/0/.ATTRIBUTES/VARIABLE_VALUE"),
      [0, 2, 4, 6, 8, 10])


def test_a_checkpoint_of_the_earlier_format_restores_and_is_replaced(
    tmp_path):
  path = str(tmp_path / "ckpt")
  write_earlier_format(path, 1)
  assert which_state(path, [1]) == 1
  latest = save_numbered(path, 2)
  assert which_state(path, [1, 2]) == 2
  name = os.path.basename(latest)
  assert checkpoint_files(tmp_path) == sorted([
      "ckpt.tfspmd", "ckpt.tfspmd.lock", name + ".data-00000-of-00001",
        name + ".index"])


def test_what_a_save_killed_inside_tensorflow_left_is_ignored_then_removed(
    tmp_path):
  path = str(tmp_path / "ckpt")
  save_numbered(path, 1)
  # TensorFlow writes a checkpoint's shards in a '_temp' directory, then
  # moves the data file beside it and writes the index last.
  shards = tmp_path / ("ckpt.tfspmd-" + "a" * 32 + "_temp")
  shards.mkdir()
  (shards / "part-00000-of-00001.data-00000-of-00001").write_bytes(b"\0" * 9)
  halfway = str(tmp_path / ("ckpt.tfspmd-" + "b" * 32))
  (tmp_path / (os.path.basename(halfway) + ".data-00000-of-00001")
   ).write_bytes(b"\0" * 9)
  (tmp_path / (os.path.basename(halfway) + ".index")).write_bytes(b"\1" * 5)
  (tmp_path / (os.path.basename(halfway) + ".next")).write_text(
      json.dumps({"checkpoint": os.path.basename(halfway)}))
  # Files of other checkpoints in the directory stay.
  (tmp_path / "ckpt-7.index").write_bytes(b"")
  (tmp_path / "ckpt.tfspmd-notes.txt").write_bytes(b"")
  assert which_state(path, [1]) == 1

  latest = save_numbered(path, 2)
  assert which_state(path, [1, 2]) == 2
  name = os.path.basename(latest)
  assert sorted(os.listdir(tmp_path)) == sorted([
      "ckpt-7.index", "ckpt.tfspmd", "ckpt.tfspmd-notes.txt",
      "ckpt.tfspmd.lock", name + ".data-00000-of-00001", name + ".index"])


_SAVE_MANY = """
import sys
import numpy as np
import tensorflow as tf
from tfspmd.adapters import checkpoint
path, k = sys.argv[1], int(sys.argv[2])
rows = np.stack([np.full(8, k), np.arange(8)], 1).astype(np.float32)
for _ in range(12):
  checkpoint.save(path, {"w": np.arange(6, dtype=np.float32) * k,
                         "rows": rows}, epoch=tf.Variable(np.int64(k)))
"""


def test_saves_to_one_path_from_threads_and_processes_take_turns(tmp_path):
  # Each save removes the files of the saves before it: two at once each
  # removed the other's, and the checkpoint the pointer named was lost.
  path = str(tmp_path / "ckpt")
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [SOURCE_ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
  children = [subprocess.Popen(
      [sys.executable, "-c", _SAVE_MANY, path, str(k)], env=env,
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for k in (3, 4)]
  errors = []

  def save_many(k):
    try:
      for _ in range(12):
        save_numbered(path, k)
        which_state(path, [1, 2, 3, 4])
    except Exception as error:  # pylint: disable=broad-except
      errors.append(error)

  threads = [threading.Thread(target=save_many, args=(k,)) for k in (1, 2)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  for child in children:
    _, stderr = child.communicate(timeout=300)
    assert child.returncode == 0, stderr[-3000:]
  assert not errors, errors
  assert which_state(path, [1, 2, 3, 4]) in (1, 2, 3, 4)
  assert len([name for name in os.listdir(tmp_path)
              if name.endswith(".index")]) == 1


# --- damaged checkpoints: errors that name them -------------------------------


def cut_to(file, size):
  """Truncates `file` to `size` bytes; a negative `size` counts from its end."""
  with open(file, "r+b") as opened:
    opened.truncate(size if size >= 0 else os.path.getsize(file) + size)


def write_file(file, contents):
  with open(file, "wb") as opened:
    opened.write(contents)


def flip_last_byte(file):
  with open(file, "r+b") as opened:
    opened.seek(-1, os.SEEK_END)
    last = opened.read(1)
    opened.seek(-1, os.SEEK_END)
    opened.write(bytes([last[0] ^ 0xFF]))


@pytest.mark.parametrize("damage, message", [
    (lambda path, prefix: cut_to(prefix + ".data-00000-of-00001", 10),
     r"the data file '{prefix}\.data-00000-of-00001' is 10 bytes, shorter "
     r"than the 96 the index says it holds: the checkpoint at '{path}' is "
     r"damaged; restore an earlier one\."),
    (lambda path, prefix: cut_to(prefix + ".data-00000-of-00001", -1),
     r"the data file '{prefix}\.data-00000-of-00001' is shorter than the "
     r"index '{prefix}\.index' says: the checkpoint at '{path}' is damaged; "
     r"restore an earlier one\."),
    (lambda path, prefix: os.remove(prefix + ".data-00000-of-00001"),
     r"the data file '{prefix}\.data-00000-of-00001' is missing: the "
     r"checkpoint at '{path}' is damaged; restore an earlier one\."),
    (lambda path, prefix: write_file(prefix + ".index", b"not an index"),
     r"the index file '{prefix}\.index' is not a checkpoint index: the "
     r"checkpoint at '{path}' is damaged; restore an earlier one\."),
    (lambda path, prefix: flip_last_byte(prefix + ".data-00000-of-00001"),
     r"the data file '{prefix}\.data-00000-of-00001' does not match the "
     r"checksums of the index '{prefix}\.index': the checkpoint at '{path}' "
     r"is damaged; restore an earlier one\."),
    (lambda path, prefix: os.remove(prefix + ".index"),
     r"the index file '{prefix}\.index', which '{path}\.tfspmd' names, is "
     r"missing: the checkpoint at '{path}' is damaged; restore an earlier "
     r"one\."),
    (lambda path, prefix: write_file(path + ".tfspmd", b"{"),
     r"'{path}\.tfspmd', the file that names the current checkpoint files of "
     r"'{path}', names none: the checkpoint at '{path}' is damaged; restore "
     r"an earlier one\."),
], ids=["data-cut-short", "data-cut-by-a-byte", "data-missing", "index-garbage", "data-changed",
        "index-missing", "pointer-garbage"])
def test_a_damaged_checkpoint_is_an_error_naming_it(tmp_path, damage, message):
  path = str(tmp_path / "ckpt")
  # 96 bytes of numbers: w (6 float32), rows (8 x 2 float32), epoch (int64).
  prefix = save_numbered(path, 1)
  damage(path, prefix)
  expected = message.format(prefix=re.escape(prefix), path=re.escape(path))
  with pytest.raises(ValueError, match=rf"^checkpoint\.restore: {expected}$"):
    restored_state(path)
