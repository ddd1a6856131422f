"""The DTensor switches tfspmd's programs run with (dtensor_settings.py).

Each program gets its switches once, when it is traced, and runs under the
same ones every time; the values the switches affect are checked by the
whole suite (collectives on 1-D and nested meshes, every dtype).
"""

import ctypes
import os

import numpy as np
import tensorflow as tf

import tfspmd
from tfspmd import lax
from tfspmd._src import dtensor_settings

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


def test_switches_are_set_only_while_a_program_runs():
  getenv = ctypes.CDLL(None).getenv  # what DTensor's C++ reads
  getenv.restype = ctypes.c_char_p

  def c_environment(name):
    return getenv(name.encode()) is not None

  assert not c_environment(MULTI) and not c_environment(GATHER)
  with dtensor_settings.applied((MULTI, GATHER)):
    assert c_environment(MULTI) and c_environment(GATHER)
    assert MULTI not in os.environ
  assert not c_environment(MULTI) and not c_environment(GATHER)


def test_a_switch_the_user_set_is_left_alone():
  environ = {MULTI: "0", GATHER: "false"}
  user_set = dtensor_settings.user_settings(environ)
  assert user_set == {MULTI, GATHER}
  # DTensor takes the gather switch as on whatever its value.
  assert environ == {MULTI: "0"}
  devices = tfspmd.devices()
  assert dtensor_settings.for_program(devices, 1, 1, None, user_set) == ()
  assert dtensor_settings.for_program(devices, 1, 2, None, set()) == (GATHER,)
  assert dtensor_settings.for_program(devices, 2, 1, None, set()) == (MULTI,)
