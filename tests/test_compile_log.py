"""tfspmd_log_compiles: a line per trace and per compile; retracing warns.

JAX's `jax_log_compiles` logs each compile; tf.function warns when a
function retraces often. tfspmd does both on the `tfspmd` logger.
"""

import logging
import os
from unittest import mock

import numpy as np
import pytest

import tfspmd
from tfspmd._src.core import config as config_lib


@pytest.fixture(name="logs")
def fixture_logs(caplog):
  caplog.set_level(logging.WARNING, logger="tfspmd")
  yield caplog
  tfspmd.config.update("tfspmd_log_compiles", False)


def lines(caplog):
  return [r.getMessage() for r in caplog.records if r.name == "tfspmd"]


def test_a_trace_and_a_first_run_log_one_line_each(logs):
  tfspmd.config.update("jax_log_compiles", True)  # JAX's name for it

  def double_rows(x):
    return x * 2

  f = tfspmd.pmap(double_rows)
  x = np.ones((8, 3), np.float32)
  for _ in range(3):
    np.testing.assert_array_equal(np.asarray(f(x)), x * 2)
  traced, compiled = lines(logs)
  assert traced.startswith(
      "tfspmd: traced pmap of test_a_trace_and_a_first_run_log_one_line_each."
      "<locals>.double_rows for (float32[8,3]) in ")
  assert compiled.startswith(
      "tfspmd: lowered, compiled and ran pmap of test_a_trace_and_a_first_run"
      "_log_one_line_each.<locals>.double_rows for (float32[8,3]) in ")
  # A new shape: one more of each.
  f(np.ones((8, 2), np.int32))
  assert len(lines(logs)) == 4 and "(int32[8,2])" in lines(logs)[-1]


def test_a_shard_map_logs_under_its_function_name(logs):
  tfspmd.config.update("tfspmd_log_compiles", True)

  def add_one(block):
    return block + 1

  mesh = tfspmd.make_mesh((8,), ("x",))
  g = tfspmd.shard_map(add_one, mesh=mesh, in_specs=tfspmd.P("x"),
                       out_specs=tfspmd.P("x"))
  g(np.zeros(16, np.float32))
  assert [line.split(" for ")[0] for line in lines(logs)] == [
      "tfspmd: traced shard_map of test_a_shard_map_logs_under_its_function_"
      "name.<locals>.add_one",
      "tfspmd: lowered, compiled and ran shard_map of test_a_shard_map_logs_"
      "under_its_function_name.<locals>.add_one"]
  # The arrays the user passed, not each device's block inside.
  assert all(" for (float32[16]) in " in line for line in lines(logs))
  two_axes = tfspmd.shard_map(add_one, mesh=tfspmd.make_mesh((2, 4),
                                                             ("a", "b")),
                              in_specs=tfspmd.P("a", "b"),
                              out_specs=tfspmd.P("a", "b"))
  two_axes(np.zeros((4, 16), np.float32))
  assert all(" for (float32[4,16]) in " in line for line in lines(logs)[2:])
  assert len(lines(logs)) == 4


def test_nothing_is_logged_by_default(logs):
  f = tfspmd.pmap(lambda x: x + 1)
  f(np.ones((8, 2), np.float32))
  assert not lines(logs)


def test_the_fifth_signature_warns_once_whatever_the_setting(logs):
  f = tfspmd.pmap(lambda x: x + 1)
  for width in range(1, 9):
    f(np.ones((8, width), np.float32))
  warned = lines(logs)
  assert len(warned) == 1
  assert "was traced for 5 different call signatures (the last: " \
         "float32[8,5])" in warned[0]
  assert "Pass arrays of a few fixed shapes" in warned[0]


def test_the_environment_sets_it_at_import():
  with mock.patch.dict(os.environ, {"JAX_LOG_COMPILES": "1"}):
    assert config_lib.Config().tfspmd_log_compiles
  with mock.patch.dict(os.environ, {"JAX_LOG_COMPILES": "off"}):
    assert not config_lib.Config().jax_log_compiles
  with mock.patch.dict(os.environ, {"JAX_LOG_COMPILES": "maybe"}):
    with pytest.raises(ValueError, match="JAX_LOG_COMPILES must be one of"):
      config_lib.Config()
