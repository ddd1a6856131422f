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
import tensorflow as tf

import tfspmd
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
  module = _Standardizer()
  path = str(tmp_path / "standardizer")
  tf.saved_model.save(module, path,
                      signatures={"serving_default": module.serve})
  rows = _ROWS[::-1] * 2
  env = {k: v for k, v in os.environ.items() if not k.startswith("TFSPMD")}
  env["TF_CPP_MIN_LOG_LEVEL"] = "3"
  run = subprocess.run(
      [sys.executable, "-c", _SERVE_WITHOUT_TFSPMD, path,
       json.dumps(rows.tolist())], env=env, cwd=str(tmp_path),
      capture_output=True, text=True, timeout=300, check=False)
  assert run.returncode == 0, run.stderr[-3000:]
  served = json.loads(run.stdout.splitlines()[-1])
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
