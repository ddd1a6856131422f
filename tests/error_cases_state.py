"""Mistakes in state, steps= and configuration.

Rows of the error catalogue (`error_catalogue`); tests/test_errors.py runs them.
"""

import os
from unittest import mock

import numpy as np
import tensorflow as tf

import tfspmd

from error_catalogue import case, raise_warning, P, STATE


@case("set-num-cpu-devices-late", STATE,
      "set_num_cpu_devices after TensorFlow started", RuntimeError,
      r"set_num_cpu_devices\(4\) came too late: TensorFlow has already created "
      r"its devices, with 8 logical CPU device\(s\)")
def set_num_cpu_devices_late():
  tfspmd.set_num_cpu_devices(4)


@case("set-num-cpu-devices-zero", STATE, "set_num_cpu_devices(0)",
      ValueError, r"set_num_cpu_devices: `count` must be >= 1, got 0")
def set_num_cpu_devices_zero():
  tfspmd.set_num_cpu_devices(0)


@case("set-num-cpu-devices-bool", STATE, "set_num_cpu_devices(True)",
      TypeError, r"set_num_cpu_devices: `count` must be an int, got bool True")
def set_num_cpu_devices_bool():
  tfspmd.set_num_cpu_devices(True)


@case("steps-zero", STATE, "steps=0", ValueError,
      r"`steps` must be a positive int or None, got 0")
def steps_zero():
  P(lambda c, x: (c, x), steps=0)


@case("steps-input-length", STATE,
      "a per-step input whose length is not steps", ValueError,
      r"steps=3: args\[1\] is a per-step input, so its first per-device axis "
      r"must have length 3 .* per-device shape is \(2,\)")
def steps_input_length():
  P(lambda c, x: (c, x), steps=3)(np.zeros(2), np.zeros((2, 2)))


@case("steps-nested", STATE, "steps= on a nested pmap", ValueError,
      r"steps= is for the outermost pmap")
def steps_nested():
  P(P(lambda c, x: (c, x), "c", steps=2), "r")(np.zeros((2, 2)),
                                               np.zeros((2, 2, 2)))


@case("fun-not-callable", STATE, "pmap(3)", TypeError,
      r"pmap: `fun` must be callable, got 3")
def fun_not_callable():
  P(3)


@case("debug-not-bool", STATE, "debug='yes'", TypeError,
      r"pmap: `debug` must be True or False, got str 'yes'")
def debug_not_bool():
  P(lambda x: x, debug="yes")


@case("sharded-index-out-of-range", STATE,
      "out[5] of a ShardedArray of 2 devices", IndexError,
      r"index 5 is out of bounds for axis 0 with size 2")
def sharded_index_out_of_range():
  P(lambda x: x)(np.zeros(2))[5]  # pylint: disable=expression-not-assigned


@case("sharded-reshape-elements", STATE,
      "reshape of a ShardedArray to a shape of other size", ValueError,
      r"ShardedArray.reshape: cannot reshape an array of shape \(2, 4\) "
      r"\(8 elements\) to \(3, -1\); give ints whose product is the number "
      r"of elements, with at most one -1")
def sharded_reshape_elements():
  P(lambda x: x)(np.zeros((2, 4))).reshape(3, -1)


@case("sharded-arithmetic-other-devices", STATE,
      "arithmetic between ShardedArrays on devices 0-3 and on devices 4-7",
      ValueError,
      r"ShardedArray arithmetic needs both arrays on the same devices; one "
      r"lies on 4 \w+ devices \[0, 1, 2, 3\], the other on 4 \w+ devices "
      r"\[4, 5, 6, 7\]\. Fetch one with np.asarray first")
def sharded_arithmetic_other_devices():
  x = np.ones((4, 2), np.float32)
  P(lambda v: v, devices=tfspmd.devices()[:4])(x) + P(
      lambda v: v, devices=tfspmd.devices()[4:])(x)


@case("config-unknown-setting", STATE,
      "tfspmd.config.update('jax_debug_nans', True)", AttributeError,
      r"tfspmd.config.update: no setting 'jax_debug_nans'; the settings are "
      r"\['tfspmd_enable_x64', 'tfspmd_executor', 'tfspmd_log_compiles'\] \(JAX's names: "
      r"\['jax_enable_x64', 'jax_log_compiles'\]\)")
def config_unknown_setting():
  tfspmd.config.update("jax_debug_nans", True)


@case("config-not-bool", STATE, "tfspmd.config.update(name, 'no')",
      TypeError, r"tfspmd_enable_x64 must be True or False, got str 'no'")
def config_not_bool():
  tfspmd.config.update("tfspmd_enable_x64", "no")


@case("config-attribute-assignment", STATE,
      "tfspmd.config.tfspmd_enable_x64 = False", AttributeError,
      r"tfspmd.config.tfspmd_enable_x64 cannot be assigned; write "
      r"tfspmd.config.update\('tfspmd_enable_x64', False\) instead")
def config_attribute_assignment():
  tfspmd.config.tfspmd_enable_x64 = False


@case("config-attribute-unknown", STATE, "tfspmd.config.enable_x64 = False",
      AttributeError,
      r"tfspmd.config has no setting 'enable_x64' to assign; the settings are "
      r"\['tfspmd_enable_x64', 'tfspmd_executor', 'tfspmd_log_compiles'\], changed with "
      r"tfspmd.config.update")
def config_attribute_unknown():
  tfspmd.config.enable_x64 = False


@case("dtensor-gather-switch-off", STATE,
      "LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2=0 in the environment, to "
      "turn DTensor's switch off", UserWarning,
      r"LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2='0' is set: DTensor turns "
      r"this switch on whenever the variable is set, whatever its value.*To "
      r"turn it off, remove it: del os\.environ\["
      r"'LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2'\]")
def dtensor_gather_switch_off():
  # A switch of DTensor's executor, which warns when it runs a program.
  before = tfspmd.config.tfspmd_executor
  tfspmd.config.update("tfspmd_executor", "dtensor")
  try:
    with mock.patch.dict(
        os.environ, {"LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2": "0"}):
      raise_warning(lambda: P(lambda x: x * 2)(np.zeros(8)))
  finally:
    tfspmd.config.update("tfspmd_executor", before)


@case("variable-assign-debug", STATE,
      "assigning to a tf.Variable inside a pmap in debug mode", ValueError,
      r"writes to a tf.Variable \(AssignAddVariableOp\).*Pass the state")
def variable_assign_debug():
  v = tf.Variable(0.)
  P(lambda x: v.assign_add(tf.reduce_sum(x)), debug=True)(
      np.zeros(2, np.float32))


@case("jit-gradient-of-a-captured-variable", STATE,
      "a GradientTape around a tfspmd.jit call whose function reads a "
      "tf.Variable it is not passed", ValueError,
      r"jit: .*<lambda> reads the tf.Variables \['scale:0'\], which it was "
      r"not passed; a GradientTape around a jitted call differentiates its "
      r"arguments only. Pass the variables as arguments, or take the "
      r"gradient inside the jitted function.")
def jit_gradient_of_a_captured_variable():
  scale = tf.Variable(np.ones(8, np.float32), name="scale")
  f = tfspmd.jit(lambda x: tf.reduce_sum(x * scale))
  x = tf.constant(np.arange(8, dtype=np.float32))
  with tf.GradientTape() as tape:
    tape.watch(x)
    y = f(x)
  tape.gradient(y, [x, scale])
