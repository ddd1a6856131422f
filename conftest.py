"""Shared test set-up: 8 logical CPU devices, made once per process.

TensorFlow can split the CPU into logical devices only before it creates
its devices, so this runs before any test module imports TensorFlow. Tests
marked `gpu` or `tpu` are skipped, with the reason, where there is no such
device. `--executor=dtensor` (or `host`) runs the tests' programs on that
executor (`TFSPMD_EXECUTOR`), in this process and the processes it starts.
"""

import os
import sys

os.environ.setdefault("TFSPMD_NUM_CPU_DEVICES", "8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_addoption(parser):
  parser.addoption(
      "--executor", choices=("auto", "host", "dtensor"), default=None,
      help="the executor that runs tfspmd's programs (TFSPMD_EXECUTOR)")


def pytest_configure(config):
  executor = config.getoption("--executor")
  if executor is not None:
    os.environ["TFSPMD_EXECUTOR"] = executor


def pytest_report_header(config):
  del config  # unused
  return f"tfspmd executor: {os.environ.get('TFSPMD_EXECUTOR', 'auto')}"


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


def _executor_fixture(name):
  """A fixture under which tfspmd's programs run on the executor `name`."""
  import pytest  # pylint: disable=g-import-not-at-top

  @pytest.fixture
  def on_executor():
    import tfspmd  # pylint: disable=g-import-not-at-top
    before = tfspmd.config.tfspmd_executor
    tfspmd.config.update("tfspmd_executor", name)
    try:
      yield name
    finally:
      tfspmd.config.update("tfspmd_executor", before)
  return on_executor


# For tests of what only one executor does (DTensor's moves of blocks
# between devices, its device's recovery; the host's one XLA program).
dtensor_executor = _executor_fixture("dtensor")
host_executor = _executor_fixture("host")


def _each_executor():
  import pytest  # pylint: disable=g-import-not-at-top

  @pytest.fixture(params=["host", "dtensor"])
  def each_executor(request):
    """Runs the test once on each executor; its name is the value."""
    import tfspmd  # pylint: disable=g-import-not-at-top
    before = tfspmd.config.tfspmd_executor
    tfspmd.config.update("tfspmd_executor", request.param)
    try:
      yield request.param
    finally:
      tfspmd.config.update("tfspmd_executor", before)
  return each_executor


each_executor = _each_executor()
