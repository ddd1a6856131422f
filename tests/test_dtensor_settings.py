"""The DTensor switches tfspmd's programs run with (dtensor_settings.py).

Each program gets its switches once, when it is traced, and runs under the
same ones every time; the values the switches affect are checked by the
whole suite (collectives on 1-D and nested meshes, every dtype).
"""

import ctypes
import os

import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from tfspmd import lax
from tfspmd._src.executors import dtensor_settings

# The switches DTensor's executor sets for a program it runs.
pytestmark = pytest.mark.usefixtures("dtensor_executor")

MULTI = dtensor_settings.MULTI_DEVICE_EXPANSION
GATHER = dtensor_settings.COLLECTIVE_GATHER


def _switches(mapped):
  (program,) = mapped._programs.values()  # pylint: disable=protected-access
  return program.dtensor_switches


def test_a_program_on_a_1d_cpu_mesh_gets_both_switches():
  f = tfspmd.pmap(lambda v: lax.all_gather(v, "i"), "i")
  out = f(np.arange(8, dtype=np.float32))
  np.testing.assert_array_equal(out, np.broadcast_to(np.arange(8.), (8, 8)))
  assert _switches(f) == (MULTI, GATHER)


def test_no_collective_gather_on_a_nested_mesh_or_for_wide_unsigned_ints():
  nested = tfspmd.pmap(tfspmd.pmap(lambda v: lax.all_gather(v, "c"), "c"), "r")
  out = nested(np.arange(8, dtype=np.float32).reshape(2, 4))
  np.testing.assert_array_equal(
      out, np.broadcast_to(np.arange(8.).reshape(2, 1, 4), (2, 4, 4)))
  assert _switches(nested) == (MULTI,)

  unsigned = tfspmd.pmap(lambda v: lax.all_gather(v, "i"), "i")
  out = unsigned(np.arange(8, dtype=np.uint32))
  np.testing.assert_array_equal(out, np.broadcast_to(np.arange(8), (8, 8)))
  assert _switches(unsigned) == (MULTI,)


def test_no_multi_device_expansion_for_a_program_with_a_loop():
  looped = tfspmd.pmap(
      lambda v: tf.while_loop(lambda k, c: k < 3,
                              lambda k, c: (k + 1, c + lax.psum(c, "i")),
                              (0, v))[1], "i")
  out = looped(np.ones(8, np.float32))
  np.testing.assert_array_equal(out, np.full(8, 9.0 ** 3))
  assert _switches(looped) == (GATHER,)
  steps = tfspmd.pmap(lambda c, x: (c + x, c), "i", steps=2)
  steps(np.zeros(8, np.float32), np.ones((8, 2), np.float32))
  assert _switches(steps) == (GATHER,)


def _c_environment(name):
  """The value of `name` in the C environment, which DTensor's C++ reads."""
  getenv = ctypes.CDLL(None).getenv
  getenv.restype = ctypes.c_char_p
  value = getenv(name.encode())
  return None if value is None else value.decode()


def test_switches_are_set_only_while_a_program_runs():
  assert _c_environment(MULTI) is None and _c_environment(GATHER) is None
  with dtensor_settings.applied((MULTI, GATHER)):
    assert _c_environment(MULTI) == "1" and _c_environment(GATHER) == "1"
    assert MULTI not in os.environ
  assert _c_environment(MULTI) is None and _c_environment(GATHER) is None


def test_a_switch_the_user_set_is_left_alone():
  environ = {MULTI: "0", GATHER: "1"}
  user_set = dtensor_settings.user_settings(environ)
  assert user_set == {MULTI, GATHER}
  assert environ == {MULTI: "0", GATHER: "1"}
  devices = tfspmd.devices()
  assert dtensor_settings.for_program(devices, 1, 1, None, user_set) == ()
  assert dtensor_settings.for_program(devices, 1, 2, None, set()) == (GATHER,)
  assert dtensor_settings.for_program(devices, 2, 1, None, set()) == (MULTI,)


def test_an_off_value_of_the_gather_switch_warns_and_stays():
  environ = {GATHER: "false"}
  with pytest.warns(UserWarning, match=r"whatever its value.*del os\.environ"):
    assert dtensor_settings.user_settings(environ) == {GATHER}
  assert environ == {GATHER: "false"}


def test_a_switch_the_user_sets_after_import_stays_set(monkeypatch):
  monkeypatch.setenv(MULTI, "1")
  f = tfspmd.pmap(lambda v: v * 3)
  np.testing.assert_array_equal(f(np.arange(8.)), np.arange(8.) * 3)
  assert _switches(f) == (GATHER,)  # the user's switch is not tfspmd's
  assert os.environ[MULTI] == "1" and _c_environment(MULTI) == "1"


def test_a_switch_set_after_a_program_was_traced_stays_set(monkeypatch):
  f = tfspmd.pmap(lambda v: v - 2)
  np.testing.assert_array_equal(f(np.arange(8.)), np.arange(8.) - 2)
  assert _switches(f) == (MULTI, GATHER)
  monkeypatch.setenv(MULTI, "1")
  np.testing.assert_array_equal(f(np.arange(8.)), np.arange(8.) - 2)
  assert os.environ[MULTI] == "1" and _c_environment(MULTI) == "1"
  monkeypatch.delenv(MULTI)
  np.testing.assert_array_equal(f(np.arange(8.)), np.arange(8.) - 2)
  assert _c_environment(MULTI) is None
