"""A tf.Module whose tf.function calls a pmap saves, loads and serves.

The pmap's program is in the module's graph with TensorFlow ops only, so
TensorFlow alone (a process that never imports tfspmd, on one device, as
TF Serving runs it) loads the SavedModel and serves plain tensors.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from tfspmd import P
from tfspmd import lax

_ROWS = np.random.default_rng(7).standard_normal((8, 3)).astype(np.float32)


class _Standardizer(tf.Module):
  """Standardizes each column over the devices' rows, then scales it."""

  def __init__(self):
    super().__init__()
    self.scale = tf.Variable([1., 2., 3.])

    def standardize(row):
      centred = row - lax.pmean(row, "batch")
      spread = tf.sqrt(lax.pmean(tf.square(centred), "batch"))
      return self.scale * centred / spread

    self._standardize = tfspmd.pmap(standardize, "batch")
    self._gather = tfspmd.pmap(lambda row: lax.all_gather(row, "batch"),
                               "batch")

  @tf.function(input_signature=[tf.TensorSpec([8, 3], tf.float32)])
  def serve(self, rows):
    return {"standardized": self._standardize(rows),
            "gathered": self._gather(rows)}


def _expected_standardized(rows):
  rows = rows.astype(np.float64)
  centred = rows - rows.mean(0)
  return np.array([1., 2., 3.]) * centred / np.sqrt((centred ** 2).mean(0))


def test_the_module_serves_plain_tensors_before_saving():
  module = _Standardizer()
  served = module.serve(tf.constant(_ROWS))
  np.testing.assert_allclose(served["standardized"].numpy(),
                             _expected_standardized(_ROWS), rtol=1e-5,
                             atol=1e-6)
  np.testing.assert_array_equal(served["gathered"].numpy(),
                                np.tile(_ROWS, (8, 1, 1)))


def _served_without_tfspmd(module, directory, program, *arguments):
  """Saves `module` (its `serve` as the signature) and runs `program` on it.

  `program` runs in a process of its own that never imports tfspmd, on one
  device, as TF Serving runs a SavedModel, with the saved path and
  `arguments` in `sys.argv`; what it prints last (one JSON object) is
  returned.
  """
  path = str(directory / "saved")
  tf.saved_model.save(module, path,
                      signatures={"serving_default": module.serve})
  env = {k: v for k, v in os.environ.items() if not k.startswith("TFSPMD")}
  env["TF_CPP_MIN_LOG_LEVEL"] = "3"
  run = subprocess.run(
      [sys.executable, "-c", program, path, *arguments], env=env,
      cwd=str(directory), capture_output=True, text=True, timeout=300,
      check=False)
  assert run.returncode == 0, run.stderr[-3000:]
  return json.loads(run.stdout.splitlines()[-1])


_SERVE_WITHOUT_TFSPMD = """
import json, sys
import numpy as np
import tensorflow as tf
loaded = tf.saved_model.load(sys.argv[1])
rows = np.array(json.loads(sys.argv[2]), np.float32)
served = loaded.signatures["serving_default"](rows=tf.constant(rows))
print(json.dumps({
    "tfspmd_imported": any(name.startswith("tfspmd") for name in sys.modules),
    "devices": len(tf.config.list_logical_devices("CPU")),
    "standardized": served["standardized"].numpy().tolist(),
    "gathered": served["gathered"].numpy().tolist(),
    "called": loaded.serve(tf.constant(rows))["standardized"].numpy().tolist(),
}))
"""


def test_a_saved_module_serves_in_a_process_without_tfspmd(tmp_path):
  rows = _ROWS[::-1] * 2
  served = _served_without_tfspmd(_Standardizer(), tmp_path,
                                  _SERVE_WITHOUT_TFSPMD,
                                  json.dumps(rows.tolist()))
  assert not served["tfspmd_imported"]
  assert served["devices"] == 1
  expected = _expected_standardized(rows)
  np.testing.assert_allclose(served["standardized"], expected, rtol=1e-5,
                             atol=1e-6)
  np.testing.assert_allclose(served["called"], expected, rtol=1e-5,
                             atol=1e-6)
  np.testing.assert_array_equal(served["gathered"], np.tile(rows, (8, 1, 1)))


def test_a_saved_module_loads_back_in_this_process(tmp_path):
  module = _Standardizer()
  path = str(tmp_path / "standardizer")
  tf.saved_model.save(module, path)
  loaded = tf.saved_model.load(path)
  served = loaded.serve(tf.constant(_ROWS))
  np.testing.assert_allclose(served["standardized"].numpy(),
                             _expected_standardized(_ROWS), rtol=1e-5,
                             atol=1e-6)


class _SameOnEveryDevice(tf.Module):
  """Collectives of values every device holds alike, and of its own rows."""

  def __init__(self):
    super().__init__()
    self._mapped = tfspmd.pmap(
        lambda row, shared: (lax.psum(shared, "b") + lax.psum(2., "b") +
                             lax.pmax(shared, "b") + row),
        "b", in_axes=(0, None))

  @tf.function(input_signature=[tf.TensorSpec([8, 3], tf.float32),
                                tf.TensorSpec([3], tf.float32)])
  def serve(self, rows, shared):
    return self._mapped(rows, shared)


def test_collectives_of_values_alike_on_every_device_save_and_load(tmp_path):
  # TensorFlow saves the gradient of every custom-gradient op of a saved
  # function; such a collective's is one only the pmap's trace can build.
  shared = np.array([1., -2., 0.5], np.float32)
  expected = _ROWS + 8 * shared + 8 * 2. + shared
  path = str(tmp_path / "same_on_every_device")
  tf.saved_model.save(_SameOnEveryDevice(), path)
  loaded = tf.saved_model.load(path)
  np.testing.assert_allclose(
      loaded.serve(tf.constant(_ROWS), tf.constant(shared)).numpy(),
      expected, rtol=1e-6)


# --- a serving signature with an open batch size -----------------------------


def _exchange(x):
  """Collectives over a per-device block of shape (open batch, 4)."""
  shifted = lax.ppermute(x, "d", [(i, (i + 1) % 8) for i in range(8)])
  return {
      "gathered": lax.all_gather(x, "d"),
      "summed": lax.psum(x, "d"),
      "column_max": lax.pmax(tf.reduce_max(x, axis=0), "d"),
      "shifted": shifted + tf.cast(lax.axis_index("d"), tf.float32),
      "exchanged": lax.all_to_all(tf.concat([x, 2 * x], axis=1), "d", 1, 1,
                                  tiled=True),
  }


def _expected_exchange(x):
  x = x.astype(np.float64)
  doubled = np.concatenate([x, 2 * x], axis=2)  # (8, b, 8): one column each
  return {
      "gathered": np.broadcast_to(x, (8,) + x.shape),
      "summed": np.broadcast_to(x.sum(0), x.shape),
      "column_max": np.broadcast_to(x.max(axis=(0, 1)), (8, x.shape[2])),
      "shifted": np.roll(x, 1, axis=0) + np.arange(8)[:, None, None],
      "exchanged": doubled.transpose(2, 1, 0),
  }


class _OpenBatch(tf.Module):

  def __init__(self):
    super().__init__()
    self._exchange = tfspmd.pmap(_exchange, "d")

  @tf.function(input_signature=[tf.TensorSpec([8, None, 4], tf.float32)])
  def serve(self, x):
    return self._exchange(x)


def _rows(batch):
  return np.random.default_rng(batch).standard_normal(
      (8, batch, 4)).astype(np.float32)


def test_a_serving_signature_may_leave_the_per_device_batch_open():
  module = _OpenBatch()
  for batch in (1, 3):
    served = module.serve(tf.constant(_rows(batch)))
    expected = _expected_exchange(_rows(batch))
    assert served.keys() == expected.keys()
    for name, value in expected.items():
      np.testing.assert_allclose(served[name].numpy(), value, rtol=1e-6,
                                 err_msg=name)
  assert module.serve.experimental_get_tracing_count() == 1


_SERVE_OPEN_BATCH = """
import json, sys
import numpy as np
import tensorflow as tf
loaded = tf.saved_model.load(sys.argv[1])
serve = loaded.signatures["serving_default"]
out = {}
for batch in (1, 3):
  x = np.random.default_rng(batch).standard_normal((8, batch, 4))
  served = serve(x=tf.constant(x.astype(np.float32)))
  out[batch] = {name: value.numpy().tolist() for name, value in served.items()}
print(json.dumps({
    "tfspmd_imported": any(name.startswith("tfspmd") for name in sys.modules),
    "served": out,
}))
"""


def test_an_open_batch_signature_serves_two_sizes_without_tfspmd(tmp_path):
  result = _served_without_tfspmd(_OpenBatch(), tmp_path, _SERVE_OPEN_BATCH)
  assert not result["tfspmd_imported"]
  for batch in (1, 3):
    served = result["served"][str(batch)]
    for name, value in _expected_exchange(_rows(batch)).items():
      np.testing.assert_allclose(served[name], value, rtol=1e-6,
                                 err_msg=f"{name}, batch {batch}")


def test_sizes_a_program_cannot_leave_open_are_clear_errors():
  mapped_open = tf.function(
      tfspmd.pmap(lambda x: lax.psum(x, "d"), "d"),
      input_signature=[tf.TensorSpec([None, 4], tf.float32)])
  with pytest.raises(ValueError, match=r"maps axis 0 of args\[0\].*whose "
                     r"size is open \(None\): it is the number of devices"):
    mapped_open.get_concrete_function()
  scattered_open = tf.function(
      tfspmd.pmap(lambda x: lax.psum_scatter(x, "d", tiled=True), "d"),
      input_signature=[tf.TensorSpec([8, None], tf.float32)])
  with pytest.raises(ValueError, match=r"psum_scatter: the dimension "
                     r"`scatter_dimension` is split over the devices, so its "
                     r"size must be known"):
    scattered_open.get_concrete_function()


# --- a model trained over the devices, served batch first --------------------


class _BatchFirstServer(tf.Module):
  """Serves a Keras model over the devices through a batch-first signature.

  TF Serving's batching joins requests along the first axis, so the
  signature takes rows first; they are padded to a multiple of the devices
  and split into one block per device inside.
  """

  def __init__(self, model, devices=8):
    super().__init__()
    self.model, self.devices = model, devices
    self._predict = tfspmd.pmap(lambda rows: self.model(rows), "batch")

  @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32)])
  def serve(self, x):
    rows = tf.shape(x)[0]
    padded = tf.pad(x, [[0, (-rows) % self.devices], [0, 0]])
    blocks = tf.reshape(padded, [self.devices, -1, 4])
    return {"y": tf.reshape(self._predict(blocks), [-1, 3])[:rows]}


_SERVE_BATCH_FIRST = """
import json, sys
import numpy as np
import tensorflow as tf
serve = tf.saved_model.load(sys.argv[1]).signatures["serving_default"]
x = np.array(json.loads(sys.argv[2]), np.float32)
print(json.dumps({
    "tfspmd_imported": any(name.startswith("tfspmd") for name in sys.modules),
    "y": {n: serve(x=tf.constant(x[:n]))["y"].numpy().tolist() for n in (5, 13)},
}))
"""


def test_a_data_parallel_model_serves_batch_first_without_tfspmd(tmp_path):
  import keras  # pylint: disable=g-import-not-at-top
  from tfspmd.adapters import data_parallel  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(0)
  model = data_parallel(keras.Sequential([keras.Input((4,)),
                                          keras.layers.Dense(3)]))
  model.compile(optimizer="sgd", loss="mse")
  x = np.random.default_rng(0).standard_normal((64, 4)).astype(np.float32)
  model.fit(x, x[:, :3], batch_size=16, epochs=1, verbose=0)
  kernel, bias = model.get_weights()
  result = _served_without_tfspmd(_BatchFirstServer(model), tmp_path,
                                  _SERVE_BATCH_FIRST,
                                  json.dumps(x[:13].tolist()))
  assert not result["tfspmd_imported"]
  for rows in (5, 13):
    np.testing.assert_allclose(
        result["y"][str(rows)],
        x[:rows].astype(np.float64) @ kernel + bias, rtol=1e-5, atol=1e-6)


def test_reduce_retracing_relaxes_the_batch_and_keeps_the_values():
  # TensorFlow's reduce_retracing traces the third size with the batch
  # relaxed to None: the pmap (a loop with a psum inside) takes it open.
  def body(v):
    return tf.while_loop(lambda i, u: i < 3,
                         lambda i, u: (i + 1, u + lax.psum(u, "i")), (0, v))[1]

  mapped = tfspmd.pmap(body, "i")
  relaxed = tf.function(lambda v: mapped(v), reduce_retracing=True)
  for batch in (2, 3, 5):
    x = _rows(batch)[:, :, 0]
    np.testing.assert_allclose(relaxed(tf.constant(x)).numpy(),
                               _psum_loop_reference(x), rtol=1e-5)
  assert relaxed.experimental_get_tracing_count() == 2


def _psum_loop_reference(x):
  value = x.astype(np.float64)
  for _ in range(3):
    value = value + value.sum(0)
  return value


def test_nested_pmaps_and_shard_map_take_open_sizes():
  nested = tf.function(
      tfspmd.pmap(tfspmd.pmap(
          lambda v: lax.psum(v, "b") + lax.pmean(v, ("a", "b")), "b"), "a"),
      input_signature=[tf.TensorSpec([2, 4, None, 3], tf.float32)])
  mesh = tfspmd.make_mesh((2, 4), ("a", "b"))
  summed = tf.function(
      tfspmd.shard_map(lambda v: lax.psum(v, "b"), mesh=mesh,
                       in_specs=P("a", None, "b"),
                       out_specs=P("a", None, None)),
      input_signature=[tf.TensorSpec([4, None, 8], tf.float32)])
  for rows in (1, 5):
    x = np.random.default_rng(rows).standard_normal(
        (2, 4, rows, 3)).astype(np.float32)
    np.testing.assert_allclose(
        nested(tf.constant(x)).numpy(),
        np.broadcast_to(x.sum(1, keepdims=True) +
                        x.mean((0, 1), keepdims=True), x.shape), rtol=1e-5,
        atol=1e-6)
    y = np.random.default_rng(rows).standard_normal(
        (4, rows, 8)).astype(np.float32)
    # Each device's block has 2 of the 8 columns; psum over 'b' adds the
    # four blocks of a row of the mesh.
    np.testing.assert_allclose(summed(tf.constant(y)).numpy(),
                               y.reshape(4, rows, 4, 2).sum(2), rtol=1e-5,
                               atol=1e-6)
  assert nested.experimental_get_tracing_count() == 1
  assert summed.experimental_get_tracing_count() == 1
  split_open = tf.function(
      tfspmd.shard_map(lambda v: v, mesh=mesh, in_specs=P("a", "b"),
                       out_specs=P("a", "b")),
      input_signature=[tf.TensorSpec([4, None], tf.float32)])
  with pytest.raises(ValueError, match=r"dimension 1 of args\[0\] is split "
                     r"over the mesh axes \('b',\).*open \(None"):
    split_open.get_concrete_function()
