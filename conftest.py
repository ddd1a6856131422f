"""Shared test set-up: 8 logical CPU devices, made once per process.

TensorFlow can split the CPU into logical devices only before it creates
its devices, so this runs before any test module imports TensorFlow. Tests
marked `gpu` are skipped, with the reason, where there is no GPU.
"""

import os
import sys

os.environ.setdefault("TFSPMD_NUM_CPU_DEVICES", "8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_collection_modifyitems(config, items):
  """Skips tests marked `gpu` on a machine without a GPU, saying so."""
  del config  # unused
  gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
  if not gpu_tests:
    return
  import pytest  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if tf.config.list_physical_devices("GPU"):
    return
  skip = pytest.mark.skip(
      reason="needs a GPU: tf.config.list_physical_devices('GPU') is empty "
             "on this machine")
  for item in gpu_tests:
    item.add_marker(skip)
