"""Mistakes in devices, backends and axis names.

Rows of the error catalogue (`error_catalogue`); tests/test_errors.py runs them.
"""

import numpy as np
import tensorflow as tf

import tfspmd
from tfspmd import lax

from error_catalogue import case, P, DEVICES, NAMES


@case("devices-empty", DEVICES, "devices=[]", ValueError,
      r"`devices` is empty")
def devices_empty():
  P(lambda x: x, devices=[])


@case("devices-duplicated", DEVICES, "a device listed twice in devices=",
      ValueError, r"`devices` lists Device\(platform='cpu', id=0\) twice")
def devices_duplicated():
  P(lambda x: x, devices=[tfspmd.devices()[0]] * 2)


@case("devices-wrong-type", DEVICES, "device names instead of Devices",
      TypeError, r"`devices` must hold tfspmd.Device objects .* got str 'CPU:0'")
def devices_wrong_type():
  P(lambda x: x, devices=["CPU:0"])


@case("devices-not-a-sequence", DEVICES, "devices=3", TypeError,
      r"`devices` must be a sequence of tfspmd.Device .* got int 3")
def devices_not_a_sequence():
  P(lambda x: x, devices=3)


@case("devices-mixed-kinds", DEVICES, "CPU and GPU devices in one pmap",
      ValueError, r"`devices` mixes platforms \['cpu', 'gpu'\]")
def devices_mixed_kinds():
  gpu = tfspmd.Device(id=0, platform="gpu", process_index=0, local_id=0,
                      name="/job:localhost/replica:0/task:0/device:GPU:0")
  P(lambda x: x, devices=[tfspmd.devices()[0], gpu])


@case("devices-size-mismatch", DEVICES,
      "a mapped size other than the number of devices given", ValueError,
      r"pmap was given 2 devices \(2 in this process\), but the mapped axis has "
      r"size 3")
def devices_size_mismatch():
  P(lambda x: x, devices=tfspmd.devices()[:2])(np.zeros(3))


@case("nested-devices", DEVICES, "devices= on a nested pmap", ValueError,
      r"nested pmaps with devices= are not supported")
def nested_devices():
  inner = P(lambda x: x, axis_name="c", devices=tfspmd.devices()[:2])
  P(inner, axis_name="r")(np.zeros((2, 2)))


@case("backend-unknown", DEVICES, "backend='foo'", ValueError,
      r"`backend` must be None or one of \('cpu', 'gpu', 'tpu'\), got 'foo'")
def backend_unknown():
  P(lambda x: x, backend="foo")(np.zeros(2))


@case("backend-absent", DEVICES, "backend='tpu' on a machine without TPUs",
      RuntimeError, r"backend='tpu' was requested, but this process has no TPU "
      r"devices; available backends: \['cpu'\]")
def backend_absent():
  P(lambda x: x, backend="tpu")(np.zeros(2))

# --- axis names --------------------------------------------------------------------


@case("axis-name-tuple", NAMES, "pmap(f, axis_name=('a', 'b'))", TypeError,
      r"pmap: `axis_name` is the tuple \('a', 'b'\), but a collective reads a "
      r"tuple as several axis names.*nest two pmaps")
def axis_name_tuple():
  P(lambda x: x, axis_name=("a", "b"))


@case("axis-name-unhashable", NAMES, "axis_name=['i']", TypeError,
      r"pmap: `axis_name` must be hashable, got \['i'\]")
def axis_name_unhashable():
  P(lambda x: x, axis_name=["i"])


@case("unbound-axis-nested", NAMES,
      "a collective over a name no enclosing map binds", NameError,
      r"psum: unbound axis name: 'j'. The following axis names .* are "
      r"available: 'r', 'c'")
def unbound_axis_nested():
  P(P(lambda x: lax.psum(x, "j"), "c"), "r")(np.zeros((2, 2)))


@case("colliding-axis-names", NAMES,
      "a nested pmap reusing the outer pmap's axis name", ValueError,
      r"pmap: axis name 'i' is already bound by an enclosing pmap or vmap")
def colliding_axis_names():
  P(P(lambda x: x, axis_name="i"), axis_name="i")(np.zeros((2, 2)))


@case("colliding-vmap-name", NAMES,
      "a vmap inside a pmap reusing its axis name", ValueError,
      r"vmap: axis name 'i' is already bound by an enclosing pmap or vmap")
def colliding_vmap_name():
  P(lambda x: tfspmd.vmap(lambda y: y, axis_name="i")(x), "i")(
      np.zeros((2, 3)))


@case("collective-outside-map", NAMES,
      "a collective called outside any pmap or vmap", NameError,
      r"psum: unbound axis name: 'i'. No axis is bound here")
def collective_outside_map():
  lax.psum(tf.constant(1.), "i")


@case("axis-named-twice", NAMES, "psum over ('i', 'i')", ValueError,
      r"psum: `axis_name` names axis 'i' twice: \('i', 'i'\)")
def axis_named_twice():
  P(lambda x: lax.psum(x, ("i", "i")), "i")(np.zeros(2))


@case("collective-axis-name-unhashable", NAMES,
      "a collective's axis name that is a list", TypeError,
      r"all_gather: `axis_name` must be hashable, got \['i'\]")
def collective_axis_name_unhashable():
  P(lambda x: lax.all_gather(x, ("i", ["i"])), "i")(np.zeros(2))
