"""Shared test set-up: 8 logical CPU devices, made once per process.

TensorFlow can split the CPU into logical devices only before it creates
its devices, so this runs before any test module imports TensorFlow. Tests
marked `gpu` or `tpu` are skipped, with the reason, where there is no such
device.
"""

import os
import sys

os.environ.setdefault("TFSPMD_NUM_CPU_DEVICES", "8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_collection_modifyitems(config, items):
  """Skips tests marked `gpu` or `tpu` where there is no such device, saying so."""
  del config  # unused
  for platform in ("gpu", "tpu"):
    marked = [item for item in items if item.get_closest_marker(platform)]
    if not marked:
      continue
    import pytest  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    kind = platform.upper()
    if tf.config.list_physical_devices(kind):
      continue
    skip = pytest.mark.skip(
        reason=f"needs a {kind}: tf.config.list_physical_devices('{kind}') "
               f"is empty on this machine")
    for item in marked:
      item.add_marker(skip)
