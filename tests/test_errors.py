"""The catalogue of bad inputs: each raises a specific error that says what to change.

Each row of `CATALOGUE` is one kind of mistake: what the user did, code that
does it, the exception type it must raise (exactly that type; for a mistake
the call goes on from, the warning it gives, which `raise_warning` raises),
and a pattern its message must match: the argument at fault (its pytree path
where it has one), what was expected and what was given. docs/errors.md lists
every row with the message it raises today; `test_docs_list_every_case`
keeps the two equal. After changing a message or a row, rewrite the page with

  TFSPMD_WRITE_ERRORS_DOC=1 .venv/bin/python -m pytest -q tests/test_errors.py
"""

import collections
import dataclasses
import fractions
import os
import re
import tempfile
from unittest import mock
import warnings

import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from tfspmd import lax
from tfspmd._src.core import config as config_lib
from tfspmd._src.runtime import devices as devices_lib
from tfspmd.adapters import checkpoint

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC_PATH = os.path.join(_ROOT, "docs", "errors.md")


@dataclasses.dataclass(frozen=True)
class Case:
  id: str
  group: str
  what: str
  trigger: object
  error: type
  match: str


CATALOGUE = []


def case(id_, group, what, error, match):
  """Adds the decorated trigger function to the catalogue as one row."""
  def add(trigger):
    CATALOGUE.append(Case(id_, group, what, trigger, error, match))
    return trigger
  return add


def raise_warning(run):
  """Runs `run`, then raises the UserWarning it gave, for a row to match.

  A warning does not stop the call that gives it; raising it afterwards
  lets its row check the type and message as for an error.
  """
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    run()
  for warning in caught:
    if warning.category is UserWarning:
      raise warning.message


P = tfspmd.pmap
SIZES, AXES, STATIC, LEAVES, OUTPUTS, DEVICES, NAMES, COLLECTIVES, OPS, STATE = (
    "Mapped sizes", "in_axes and out_axes", "Static and donated arguments",
    "Argument leaves", "Outputs", "Devices and backends",
    "Axis names", "Collective arguments", "Ops inside the mapped function",
    "State, steps and configuration")
PROCESSES = "Several processes"
SHARD_MAP = "shard_map and meshes"
PYTREES = "Pytrees: tfspmd.tree_util"
SHARDINGS = "Shardings and device_put"
CHECKPOINTS = "Adapters: checkpoints"
KERAS = "Adapters: Keras and tf.data"

# --- mapped sizes ------------------------------------------------------------


@case("mismatched-sizes", SIZES,
      "mapped arguments disagree on the mapped size", ValueError,
      r"inconsistent sizes.*\n  args\[0\] of shape \(4, 2\) mapped along axis 0 "
      r"has size 4\n  args\[1\]\['w'\] of shape \(3, 2\) mapped along axis 0 "
      r"has size 3")
def _():
  P(lambda a, b: a)(np.zeros((4, 2)), {"w": np.zeros((3, 2))})


@case("too-many-replicas", SIZES, "a mapped size above the device count",
      ValueError, r"requires 9 replicas, but only 8 devices are available")
def _():
  P(lambda x: x)(np.zeros(9))


@case("too-many-replicas-nested", SIZES,
      "nested pmaps whose product exceeds the device count", ValueError,
      r"requires 12 replicas \(4 x 3 nested pmaps\), but only 8 devices")
def _():
  P(P(lambda x: x, axis_name="c"), axis_name="r")(np.zeros((4, 3)))


@case("zero-size", SIZES, "a mapped axis of size 0", ValueError,
      r"maps axis 0 of args\[0\], of shape \(0, 3\), which has size 0.*size >= 1")
def _():
  P(lambda x: x)(np.zeros((0, 3)))


@case("nested-sizes-disagree", SIZES,
      "two nested pmaps at the same depth with different sizes", ValueError,
      r"axis 'd' has size 4, another pmap at that depth has size 2")
def _():
  P(lambda x, y: (P(lambda a: a, "c")(x), P(lambda a: a, "d")(y)), "r")(
      np.zeros((2, 2)), np.zeros((2, 4)))


@case("axis-size-negative", SIZES, "axis_size=-1", ValueError,
      r"`axis_size` must be a positive int or None, got -1")
def _():
  P(lambda x: x, axis_size=-1)


@case("no-mapped-argument", SIZES,
      "nothing mapped (every in_axes None) and no axis_size", ValueError,
      r"no mapped argument to take the axis size from.*pass axis_size=")
def _():
  P(lambda x: x, in_axes=None)(np.zeros(2))


@case("axis-size-disagrees", SIZES,
      "axis_size different from the mapped arguments' size", ValueError,
      r"axis_size=3, but its mapped arguments have size 2")
def _():
  P(lambda x: x, axis_size=3)(np.zeros(2))

# --- in_axes and out_axes ----------------------------------------------------


@case("in-axes-out-of-range", AXES, "in_axes=2 for a rank-2 argument",
      ValueError, r"in_axes maps axis 2 of argument args\[0\], which has rank 2: "
      r"the axis must be in \[-2, 2\)")
def _():
  P(lambda x: x, in_axes=2)(np.zeros((2, 2)))


@case("in-axes-negative-out-of-range", AXES,
      "in_axes=-3 for a rank-2 argument", ValueError,
      r"in_axes maps axis -3 of argument args\[0\], which has rank 2: the axis "
      r"must be in \[-2, 2\)")
def _():
  P(lambda x: x, in_axes=-3)(np.zeros((2, 2)))


@case("mapping-a-scalar", AXES, "a scalar argument mapped over axis 0",
      ValueError, r"in_axes maps axis 0 of argument args\[1\], but it is a "
      r"scalar \(rank 0\).*in_axes=None")
def _():
  P(lambda a, b: a + b)(np.zeros(2), 3.0)


@case("mapping-a-scalar-keyword", AXES,
      "a scalar keyword argument (keyword arguments are mapped over axis 0)",
      ValueError, r"axis 0 of argument kwargs\['x'\], but it is a scalar")
def _():
  P(lambda x: x)(x=3.0)


@case("out-axes-out-of-range", AXES, "out_axes=3 for a rank-2 result",
      ValueError, r"out_axes puts the mapped axis at 3 of output\[1\], whose "
      r"result has rank 2 .*\[-2, 2\)")
def _():
  P(lambda x: (x, x), out_axes=(0, 3))(np.zeros((2, 2)))


@case("out-axes-negative-out-of-range", AXES,
      "out_axes=-3 for a rank-2 result", ValueError,
      r"out_axes puts the mapped axis at -3 of output, whose result has rank 2")
def _():
  P(lambda x: x, out_axes=-3)(np.zeros((2, 2)))


@case("in-axes-length", AXES,
      "in_axes with fewer entries than positional arguments", ValueError,
      r"in_axes has 1 entries, but the function was called with 2 positional")
def _():
  P(lambda a, b: a, in_axes=(0,))(np.zeros(2), np.zeros(2))


@case("in-axes-dict-keys", AXES, "an in_axes dict with other keys",
      ValueError, r"in_axes specification at args\[0\] has keys \['a'\], but "
      r"the value there has keys \['b'\]")
def _():
  P(lambda a: a, in_axes=({"a": 0},))({"b": np.zeros(2)})


@case("in-axes-not-a-prefix", AXES,
      "an in_axes container where the argument is a leaf", ValueError,
      r"in_axes specification must be a tree prefix .* got specification "
      r"\(0, 0\) for value tree \* at args\[0\]")
def _():
  P(lambda a: a, in_axes=((0, 0),))(np.zeros(2))


@case("out-axes-wrong-tree", AXES,
      "out_axes with more entries than the outputs", ValueError,
      r"out_axes specification at output has 3 entries, but the value there "
      r"has 2")
def _():
  P(lambda a: (a, a), out_axes=(0, 0, 0))(np.zeros(2))


@case("in-axes-bool", AXES, "in_axes=True", TypeError,
      r"in_axes must be an int, None, or a container of those; got the bool "
      r"True")
def _():
  P(lambda a: a, in_axes=True)


@case("out-axes-bool", AXES, "out_axes=False", TypeError,
      r"out_axes must be an int, None, or a container of those; got the bool "
      r"False")
def _():
  P(lambda a: a, out_axes=False)


@case("in-axes-string", AXES, "in_axes='0'", TypeError,
      r"in_axes must be an int, None, or a \(nested\) tuple/list/dict of "
      r"those; got str '0'")
def _():
  P(lambda a: a, in_axes="0")


@case("in-axes-float", AXES, "in_axes=(1.5,)", TypeError,
      r"in_axes must be an int, None, .* got float 1.5")
def _():
  P(lambda a: a, in_axes=(1.5,))


@case("out-axes-set", AXES, "out_axes={0}", TypeError,
      r"out_axes must be an int, None, .* got set \{0\}")
def _():
  P(lambda a: a, out_axes={0})


@case("out-axes-none-varying", AXES,
      "out_axes=None for an output that differs between devices", ValueError,
      r"out_axes=None for output\[1\], but that output varies across the "
      r"devices of axis 'i'.*Give it an integer out_axes")
def _():
  P(lambda x: (lax.psum(x, "i"), x), "i", out_axes=None)(np.zeros(2))

# --- static and donated arguments ---------------------------------------------


@case("unhashable-static", STATIC, "a list as a static argument",
      ValueError, r"static argument args\[1\] of the pmapped function is not "
      r"hashable: list \[1, 2\]")
def _():
  P(lambda x, n: x, static_broadcasted_argnums=1)(np.zeros(2), [1, 2])


@case("missing-static", STATIC, "a static argument left out of the call",
      ValueError, r"static_broadcasted_argnums=\(1,\), but was called with "
      r"only 1 positional argument")
def _():
  P(lambda x, n=2: x, static_broadcasted_argnums=1)(np.zeros(2))


@case("static-and-donated", STATIC,
      "one argument both static and donated", ValueError,
      r"arguments \[0\] are both static .* and donated")
def _():
  P(lambda x: x, static_broadcasted_argnums=0, donate_argnums=0)


@case("static-argnums-type", STATIC, "static_broadcasted_argnums='0'",
      TypeError, r"static_broadcasted_argnums must be an int or a collection "
      r"of ints, got '0'")
def _():
  P(lambda x: x, static_broadcasted_argnums="0")


@case("donate-argnums-type", STATIC, "donate_argnums=[0.5]", TypeError,
      r"donate_argnums must be an int or a collection of ints, got \[0.5\]")
def _():
  P(lambda x: x, donate_argnums=[0.5])


@case("donate-out-of-range", STATIC,
      "donate_argnums naming an argument the call does not pass", ValueError,
      r"donate_argnums=\(3,\), but was called with only 1 positional "
      r"argument.*argument 3 cannot be donated")
def _():
  P(lambda x: x, donate_argnums=3)(np.zeros(2))


@case("donated-used-again", STATIC,
      "a donated ShardedArray used after the call", RuntimeError,
      r"argument args\[0\] is a ShardedArray that was donated to an earlier "
      r"call \(donate_argnums\), which deleted it")
def _():
  x = P(lambda v: v)(np.zeros(2))
  P(lambda v: v + 1, donate_argnums=(0,))(x)
  P(lambda v: v)(x)

# --- argument leaves -----------------------------------------------------------


@case("function-leaf", LEAVES, "a function inside an argument", TypeError,
      r"argument args\[0\]\['f'\] is a builtin_function_or_method \(<built-in "
      r"function print>\), not an array.*static_broadcasted_argnums")
def _():
  P(lambda d: d)({"f": print, "x": np.zeros(2)})


@case("str-leaf", LEAVES, "a Python str as an argument", TypeError,
      r"argument args\[0\] is a str \('ab'\), not an array")
def _():
  P(lambda x: x)("ab")


@case("fraction-leaf", LEAVES, "a fractions.Fraction as an argument",
      TypeError, r"argument args\[1\] is a Fraction \(Fraction\(1, 3\)\), not an "
      r"array.*Python bool, int, float or complex")
def _():
  P(lambda x, y: x, in_axes=(0, None))(np.zeros(2), fractions.Fraction(1, 3))


@case("ragged-leaf", LEAVES, "a tf.RaggedTensor as an argument", TypeError,
      r"argument args\[0\] is a RaggedTensor .*, not an array")
def _():
  P(lambda x: x)(tf.ragged.constant([[1], [2, 3]]))


@case("string-tensor", LEAVES, "a tf.string tensor", TypeError,
      r"argument args\[0\] has dtype string, which cannot be split over "
      r"devices; only numeric and bool arrays can")
def _():
  P(lambda s: s)(tf.constant(["a", "b"]))


@case("numpy-str-array", LEAVES, "a NumPy array of str", TypeError,
      r"argument args\[0\]\.text has dtype str, which cannot be split")
def _():
  Batch = collections.namedtuple("Batch", ["x", "text"])
  P(lambda b: b.x)(Batch(np.zeros(2), np.array(["a", "b"])))


@case("numpy-object-array", LEAVES, "a NumPy array of Python objects",
      TypeError, r"argument args\[0\] has dtype object, which cannot be split")
def _():
  P(lambda x: x)(np.array([None, 1], dtype=object))


@case("numpy-datetime-array", LEAVES, "a NumPy datetime64 array", TypeError,
      r"argument kwargs\['t'\] has dtype datetime64, which cannot be split")
def _():
  P(lambda t: t)(t=np.array(["2020-01-01", "2020-01-02"], dtype="datetime64[D]"))


@case("quantized-tensor", LEAVES, "a quantized (tf.qint8) tensor", TypeError,
      r"argument args\[0\] has dtype qint8, which cannot be split")
def _():
  P(lambda x: x)(tf.constant([1, 2], tf.qint8))


@case("int-overflow", LEAVES, "a Python int too large for int32",
      OverflowError, r"argument args\[1\] is the Python int 1099511627776, "
      r"which does not fit int32.*np.int64")
def _():
  P(lambda x, n: x, in_axes=(0, None))(np.zeros(2), 2 ** 40)


@case("unsortable-dict-keys", LEAVES, "a dict whose keys cannot be sorted",
      TypeError, r"dict at \[0\]\[0\] has keys that cannot be sorted "
      r"\(\[1, 'a'\]\)")
def _():
  P(lambda d: d)({1: np.zeros(2), "a": np.zeros(2)})


@case("sharded-array-into-nested", LEAVES,
      "a ShardedArray from outside passed to a nested pmap", TypeError,
      r"nested pmap argument args\[0\] is a ShardedArray from outside the "
      r"enclosing pmap")
def _():
  outside = P(lambda v: v)(np.zeros((2, 2)))
  P(lambda x: P(lambda a: a)(outside), "r")(np.zeros(2))

# --- outputs ---------------------------------------------------------------------


@case("output-not-a-tensor", OUTPUTS, "an object() returned", TypeError,
      r"returned a object at output\[1\], which is not convertible to a tensor")
def _():
  P(lambda x: (x, object()))(np.zeros(2))


@case("output-a-string", OUTPUTS, "a Python str returned", TypeError,
      r"the pmapped function returned the string 'label' at output\['name'\]; "
      r"outputs must be numbers or bools")
def _():
  P(lambda x: {"value": x, "name": "label"})(np.zeros(2))


@case("output-unknown-rank", OUTPUTS,
      "an output of unknown rank (tf.numpy_function)", ValueError,
      r"returned output of unknown rank .* tf.ensure_shape")
def _():
  P(lambda x: tf.numpy_function(lambda a: a, [x], tf.float64))(np.zeros(2))


@case("step-not-a-pair", OUTPUTS,
      "a steps= function returning one value, not (carry, y)", TypeError,
      r"steps=2: the step function must return a pair \(carry, output\)")
def _():
  P(lambda c, x: c, steps=2)(np.zeros(2), np.zeros((2, 2)))


@case("carry-changes-shape", OUTPUTS,
      "a steps= function whose carry changes shape", TypeError,
      r"carry leaf args\[0\] with per-device shape \[2\] and dtype float64, "
      r"but was given shape \[\] ")
def _():
  P(lambda c, x: (c + x, c), steps=2)(np.zeros(2), np.zeros((2, 2, 2)))


@case("output-data-dependent-size", OUTPUTS,
      "an output whose size depends on the data (tf.unique)", ValueError,
      r"returned output of shape \(2, None\) \(with the mapped axis\), whose "
      r"size depends on the data .* pad it to its largest size")
def _():
  P(lambda x, w: tf.unique(w)[0] + x[0], in_axes=(0, None))(
      np.zeros((2, 3)), np.array([1., 1., 2.]))


@case("data-dependent-shape-inside", OUTPUTS,
      "tf.boolean_mask with the same mask on every device, then a sum",
      ValueError, r"makes a tensor whose size depends on the data: the op "
      r"Where \(boolean_mask/Where\) gives shape \(None, 1\).*keep the full "
      r"size and mask instead")
def _():
  P(lambda x, m: tf.reduce_sum(tf.boolean_mask(x, m)), in_axes=(0, None))(
      np.ones((2, 3)), np.array([True, False, True]))


@case("sharded-array-captured", OUTPUTS,
      "a ShardedArray captured by closure inside the mapped function",
      TypeError, r"A ShardedArray \(shape \[2\], float64\) is used while a "
      r"function is traced .* pass it to the pmap \(in_axes=None")
def _():
  earlier = P(lambda x: x)(np.zeros(2))
  P(lambda x: x + earlier)(np.zeros(2))

@case("tf-function-two-meshes", OUTPUTS,
      "ShardedArrays on a 4-device and an 8-device mesh into one tf.function",
      ValueError, r"a tf.function was called with ShardedArrays on different "
      r"meshes: one of shape \[4, 2\] on Mesh\(\{'axis_0': 4\}\) \(devices "
      r"\[0, 1, 2, 3\]\), another of shape \[8, 2\] .* "
      r"`tfspmd.device_put\(b, a.sharding\)`")
def _():
  four = P(lambda x: x, devices=tfspmd.devices()[:4])(np.zeros((4, 2)))
  eight = P(lambda x: x)(np.zeros((8, 2)))
  tf.function(lambda a, b: a + b)(four, eight)

# --- devices and backends --------------------------------------------------


@case("devices-empty", DEVICES, "devices=[]", ValueError,
      r"`devices` is empty")
def _():
  P(lambda x: x, devices=[])


@case("devices-duplicated", DEVICES, "a device listed twice in devices=",
      ValueError, r"`devices` lists Device\(platform='cpu', id=0\) twice")
def _():
  P(lambda x: x, devices=[tfspmd.devices()[0]] * 2)


@case("devices-wrong-type", DEVICES, "device names instead of Devices",
      TypeError, r"`devices` must hold tfspmd.Device objects .* got str 'CPU:0'")
def _():
  P(lambda x: x, devices=["CPU:0"])


@case("devices-not-a-sequence", DEVICES, "devices=3", TypeError,
      r"`devices` must be a sequence of tfspmd.Device .* got int 3")
def _():
  P(lambda x: x, devices=3)


@case("devices-mixed-kinds", DEVICES, "CPU and GPU devices in one pmap",
      ValueError, r"`devices` mixes platforms \['cpu', 'gpu'\]")
def _():
  gpu = tfspmd.Device(id=0, platform="gpu", process_index=0, local_id=0,
                      name="/job:localhost/replica:0/task:0/device:GPU:0")
  P(lambda x: x, devices=[tfspmd.devices()[0], gpu])


@case("devices-size-mismatch", DEVICES,
      "a mapped size other than the number of devices given", ValueError,
      r"pmap was given 2 devices \(2 in this process\), but the mapped axis has "
      r"size 3")
def _():
  P(lambda x: x, devices=tfspmd.devices()[:2])(np.zeros(3))


@case("nested-devices", DEVICES, "devices= on a nested pmap", ValueError,
      r"nested pmaps with devices= are not supported")
def _():
  inner = P(lambda x: x, axis_name="c", devices=tfspmd.devices()[:2])
  P(inner, axis_name="r")(np.zeros((2, 2)))


@case("backend-unknown", DEVICES, "backend='foo'", ValueError,
      r"`backend` must be None or one of \('cpu', 'gpu', 'tpu'\), got 'foo'")
def _():
  P(lambda x: x, backend="foo")(np.zeros(2))


@case("backend-absent", DEVICES, "backend='tpu' on a machine without TPUs",
      RuntimeError, r"backend='tpu' was requested, but this process has no TPU "
      r"devices; available backends: \['cpu'\]")
def _():
  P(lambda x: x, backend="tpu")(np.zeros(2))

# --- axis names --------------------------------------------------------------------


@case("axis-name-tuple", NAMES, "pmap(f, axis_name=('a', 'b'))", TypeError,
      r"pmap: `axis_name` is the tuple \('a', 'b'\), but a collective reads a "
      r"tuple as several axis names.*nest two pmaps")
def _():
  P(lambda x: x, axis_name=("a", "b"))


@case("axis-name-unhashable", NAMES, "axis_name=['i']", TypeError,
      r"pmap: `axis_name` must be hashable, got \['i'\]")
def _():
  P(lambda x: x, axis_name=["i"])


@case("unbound-axis-nested", NAMES,
      "a collective over a name no enclosing map binds", NameError,
      r"psum: unbound axis name: 'j'. The following axis names .* are "
      r"available: 'r', 'c'")
def _():
  P(P(lambda x: lax.psum(x, "j"), "c"), "r")(np.zeros((2, 2)))


@case("colliding-axis-names", NAMES,
      "a nested pmap reusing the outer pmap's axis name", ValueError,
      r"pmap: axis name 'i' is already bound by an enclosing pmap or vmap")
def _():
  P(P(lambda x: x, axis_name="i"), axis_name="i")(np.zeros((2, 2)))


@case("colliding-vmap-name", NAMES,
      "a vmap inside a pmap reusing its axis name", ValueError,
      r"vmap: axis name 'i' is already bound by an enclosing pmap or vmap")
def _():
  P(lambda x: tfspmd.vmap(lambda y: y, axis_name="i")(x), "i")(
      np.zeros((2, 3)))


@case("collective-outside-map", NAMES,
      "a collective called outside any pmap or vmap", NameError,
      r"psum: unbound axis name: 'i'. No axis is bound here")
def _():
  lax.psum(tf.constant(1.), "i")


@case("axis-named-twice", NAMES, "psum over ('i', 'i')", ValueError,
      r"psum: `axis_name` names axis 'i' twice: \('i', 'i'\)")
def _():
  P(lambda x: lax.psum(x, ("i", "i")), "i")(np.zeros(2))


@case("collective-axis-name-unhashable", NAMES,
      "a collective's axis name that is a list", TypeError,
      r"all_gather: `axis_name` must be hashable, got \['i'\]")
def _():
  P(lambda x: lax.all_gather(x, ("i", ["i"])), "i")(np.zeros(2))

# --- collective arguments ----------------------------------------------------------


@case("psum-string", COLLECTIVES, "psum of strings", TypeError,
      r"psum: x\[1\] has dtype string, but psum takes numbers .*tf.cast")
def _():
  P(lambda x: lax.psum((x, tf.strings.as_string(x)), "i"), "i")(np.zeros(2))


@case("pmax-complex", COLLECTIVES, "pmax of complex numbers", TypeError,
      r"pmax: x has dtype complex64, but pmax takes real numbers")
def _():
  P(lambda x: lax.pmax(x, "i"), "i")(np.zeros(2, np.complex64))


@case("collective-of-non-array", COLLECTIVES, "psum of an object()",
      TypeError, r"psum: x\['b'\] is of type object, which is not convertible "
      r"to a tensor")
def _():
  P(lambda x: lax.psum({"a": x, "b": object()}, "i"), "i")(np.zeros(2))


@case("all-gather-axis-out-of-range", COLLECTIVES,
      "all_gather with axis=3 for a rank-1 value", ValueError,
      r"all_gather: `axis`=3 is out of range for the gathered result of rank 2 "
      r"\(a per-device value of rank 1 and the new axis\); it must be in "
      r"\[-2, 2\)")
def _():
  P(lambda v: lax.all_gather(v, "i", axis=3), "i")(np.zeros((2, 2)))


@case("all-gather-axis-float", COLLECTIVES, "all_gather with axis=1.5",
      TypeError, r"all_gather: `axis` must be an int, got float 1.5")
def _():
  P(lambda v: lax.all_gather(v, "i", axis=1.5), "i")(np.zeros(2))


@case("all-gather-tiled-scalar", COLLECTIVES,
      "all_gather(tiled=True) of a scalar", ValueError,
      r"all_gather: tiled=True .* needs a per-device value of rank >= 1, but got "
      r"a scalar")
def _():
  P(lambda v: lax.all_gather(v, "i", tiled=True), "i")(np.zeros(2))


@case("psum-scatter-size", COLLECTIVES,
      "psum_scatter over a dimension whose size is not the axis size",
      ValueError, r"psum_scatter: the dimension `scatter_dimension` has size 3, "
      r"but must equal the axis size 2")
def _():
  P(lambda v: lax.psum_scatter(v, "i"), "i")(np.zeros((2, 3)))


@case("psum-scatter-tiled-divisible", COLLECTIVES,
      "psum_scatter(tiled=True) of a dimension the axis size does not divide",
      ValueError, r"psum_scatter: with tiled=True the dimension "
      r"`scatter_dimension` \(size 3\) must divide evenly by the axis size 2")
def _():
  P(lambda v: lax.psum_scatter(v, "i", tiled=True), "i")(np.zeros((2, 3)))


@case("ppermute-not-pairs", COLLECTIVES, "ppermute with perm=[0, 1]",
      TypeError, r"ppermute: `perm` must be a sequence of \(source, "
      r"destination\) pairs, got \[0, 1\]")
def _():
  P(lambda v: lax.ppermute(v, "i", [0, 1]), "i")(np.zeros(2))


@case("ppermute-negative-index", COLLECTIVES,
      "ppermute with a negative device index", ValueError,
      r"ppermute: `perm` entry \(-1, 0\) is out of range for an axis of size 2; "
      r"indices must be in \[0, 2\)")
def _():
  P(lambda v: lax.ppermute(v, "i", [(-1, 0)]), "i")(np.zeros(2))


@case("ppermute-repeated-source", COLLECTIVES,
      "ppermute sending from one device twice", ValueError,
      r"ppermute: `perm` is not a permutation: a source appears more than once")
def _():
  P(lambda v: lax.ppermute(v, "i", [(0, 1), (0, 0)]), "i")(np.zeros(2))


@case("pshuffle-not-a-permutation", COLLECTIVES,
      "pshuffle with perm=[0, 0]", ValueError,
      r"pshuffle: `perm` must be a permutation of range\(2\), got \[0, 0\]")
def _():
  P(lambda v: lax.pshuffle(v, "i", [0, 0]), "i")(np.zeros(2))


@case("all-to-all-size", COLLECTIVES,
      "all_to_all splitting a dimension whose size is not the axis size",
      ValueError, r"all_to_all: the dimension `split_axis` has size 3, but must "
      r"equal the axis size 2")
def _():
  P(lambda v: lax.all_to_all(v, "i", 0, 0), "i")(np.zeros((2, 3)))


@case("pswapaxes-axis-out-of-range", COLLECTIVES,
      "pswapaxes with axis=5 for a rank-1 value", ValueError,
      r"pswapaxes: `axis`=5 is out of range for a per-device value of rank 1")
def _():
  P(lambda v: lax.pswapaxes(v, "i", 5), "i")(np.zeros((2, 2)))


@case("axis-index-groups-not-lists", COLLECTIVES,
      "psum with axis_index_groups=[0, 1] (not a list of lists)", TypeError,
      r"psum: axis_index_groups must be a list of lists of ints .*, got "
      r"\[0, 1\]")
def _():
  P(lambda v: lax.psum(v, "i", axis_index_groups=[0, 1]), "i")(np.zeros(2))


@case("axis-index-groups-not-ints", COLLECTIVES,
      "all_gather with axis_index_groups holding a float", TypeError,
      r"all_gather: axis_index_groups must be a list of lists of ints")
def _():
  P(lambda v: lax.all_gather(v, "i", axis_index_groups=[[0.0, 1]]), "i")(
      np.zeros(2))


@case("axis-index-groups-empty", COLLECTIVES,
      "pmean with axis_index_groups=[]", ValueError,
      r"pmean: axis_index_groups must hold at least one group, each of at "
      r"least one index, got \[\]")
def _():
  P(lambda v: lax.pmean(v, "i", axis_index_groups=[]), "i")(np.zeros(2))


@case("axis-index-groups-out-of-range", COLLECTIVES,
      "psum with axis_index_groups naming index 5 on an axis of size 4",
      ValueError,
      r"psum: axis_index_groups has index 5, out of range for the axis 'i' of "
      r"size 4; indices must be in \[0, 4\)")
def _():
  P(lambda v: lax.psum(v, "i", axis_index_groups=[[0, 1], [2, 5]]), "i")(
      np.zeros(4))


@case("axis-index-groups-not-a-partition", COLLECTIVES,
      "pmax with axis_index_groups that repeat an index and leave one out",
      ValueError,
      r"pmax: axis_index_groups must cover all indices exactly once: every "
      r"index of the axis 'i' of size 4 in exactly one group, but got "
      r"\[\[0, 1\], \[1, 3\]\]")
def _():
  P(lambda v: lax.pmax(v, "i", axis_index_groups=[[0, 1], [1, 3]]), "i")(
      np.zeros(4))


@case("axis-index-groups-unequal", COLLECTIVES,
      "psum_scatter with axis_index_groups of sizes 3 and 1", ValueError,
      r"psum_scatter: axis_index_groups must all be the same size, but got "
      r"groups of sizes \[1, 3\]")
def _():
  P(lambda v: lax.psum_scatter(v, "i", axis_index_groups=[[0, 1, 2], [3]]),
    "i")(np.zeros((4, 2)))


@case("axis-index-groups-tuple-of-axes", COLLECTIVES,
      "all_to_all over ('i', 'j') with axis_index_groups of the inner axis "
      "only", ValueError,
      r"all_to_all: axis_index_groups must cover all indices exactly once: "
      r"every index of the axes \('i', 'j'\) of size 4 \(their linear index, "
      r"the first name major\)")
def _():
  P(P(lambda v: lax.all_to_all(v, ("i", "j"), 0, 0,
                               axis_index_groups=[[0], [1]]), "j"), "i")(
                                   np.zeros((2, 2, 1)))


@case("axis-index-groups-split-size", COLLECTIVES,
      "all_to_all with axis_index_groups, splitting a dimension whose size is "
      "the axis size, not the group size", ValueError,
      r"all_to_all: the dimension `split_axis` has size 4, but must equal the "
      r"size of each axis_index_groups group 2")
def _():
  P(lambda v: lax.all_to_all(v, "i", 0, 0, axis_index_groups=[[0, 1], [2, 3]]),
    "i")(np.zeros((4, 4)))

# --- ops inside the mapped function -------------------------------------------------


@case("per-device-size", OPS,
      "an op whose result size depends on per-device data (tf.unique)",
      ValueError,
      r"the op Unique \(Unique\) gets inputs that differ between devices and "
      r"gives a result of shape \(None,\), whose size depends on those inputs")
def _():
  P(lambda x: tf.unique(x)[0])(np.zeros((2, 3)))


@case("strided-slice-offset-step", OPS,
      "a strided slice with a step, at an offset that differs between "
      "devices", ValueError,
      r"starts at an offset that differs between devices, and tfspmd maps "
      r"such a slice only with steps of 1")
def _():
  P(lambda x: x[lax.axis_index("i") % 2::2], "i")(np.zeros((2, 6)))


@case("slice-offset-unknown-size", OPS,
      "tf.slice to the end (-1) from an offset that differs between devices",
      ValueError,
      r"starts at an offset that differs between devices and has the size "
      r"\(None,\), not known when tracing")
def _():
  P(lambda x: tf.slice(x, tf.reshape(lax.axis_index("i"), [1]), [-1]),
    "i")(np.zeros((2, 6)))


@case("variable-assign", OPS, "assigning to a tf.Variable inside",
      ValueError, r"writes to a tf.Variable \(AssignAddVariableOp\).*Pass the "
      r"state as an argument and return its new value")
def _():
  v = tf.Variable(0., dtype=tf.float64)
  P(lambda x: v.assign_add(tf.reduce_sum(x)))(np.zeros(2))


@case("variable-created", OPS, "tf.Variable(...) created inside",
      ValueError, r"creates a tf.Variable \(scale\); a mapped function cannot "
      r"create variables. Create it outside the mapped function and pass its "
      r"value in as an argument")
def _():
  P(lambda x: x * tf.Variable(2., name="scale"))(np.zeros(2, np.float32))


@case("python-if-on-a-tensor", OPS, "a Python `if` on a per-device value",
      TypeError, r"uses a tensor as a Python bool \(an `if`.*use tf.cond or "
      r"tf.where to choose between values")
def _():
  def f(x):
    if tf.reduce_sum(x) > 0:
      return x
    return -x
  P(f)(np.zeros((2, 3)))


@case("python-for-over-a-tensor", OPS, "a Python `for` over a per-device "
      "tensor", TypeError, r"iterates over a tensor with a Python for loop.*"
      r"tf.map_fn or tf.scan")
def _():
  P(lambda x: sum(row for row in x))(np.zeros((2, 3)))


@case("dtensor-cannot-split", OPS,
      "psum_scatter of rows scattered into new zeros (DTensor cannot split "
      "the scatter)", ValueError,
      r"uses the op TensorScatterUpdate, which DTensor \(TF [\d.]+\) could "
      r"not split over the devices: The sharding spec for axis 1 splits among "
      r"2 values.*Build the op's inputs another way")
def _():
  P(lambda v: lax.psum_scatter(tf.tensor_scatter_nd_update(
      tf.zeros((2, 4)), [[0]], v[None]), "i", tiled=True), "i")(
          np.ones((2, 4), np.float32))


@case("stateful-random", OPS, "tf.random.uniform inside", ValueError,
      r"uses the op RandomUniform, .*Stateful random operations are not "
      r"supported in DTensor. Use the stateless random ops")
def _():
  P(lambda x: x + tf.random.uniform([3]), "i")(np.zeros((2, 3), np.float32))


@case("random-generator", OPS, "a tf.random.Generator drawn inside",
      ValueError,
      r"draws from a tf.random.Generator \(RngReadAndSkip\).*"
      r"generator.make_seeds\(n\)")
def _():
  generator = tf.random.Generator.from_seed(5)
  P(lambda x: x + generator.normal([3]), "i")(np.zeros((2, 3), np.float32))


@case("collective-in-diverging-cond", OPS,
      "a psum in a tf.cond whose predicate differs between devices",
      ValueError,
      r"psum inside tf.cond whose predicate differs between the devices of "
      r"the mapped axis: .* would not all reach the psum.*pmax or psum")
def _():
  P(lambda x: tf.cond(tf.reduce_sum(x) > 0, lambda: lax.psum(x, "i"),
                      lambda: x), "i")(np.zeros((2, 3), np.float32))


@case("collective-in-diverging-loop", OPS,
      "a pmean in a tf.while_loop whose condition differs between devices",
      ValueError,
      r"pmean inside tf.while_loop whose condition differs between the "
      r"devices")
def _():
  P(lambda x: tf.while_loop(lambda k, v: k < lax.axis_index("i"),
                            lambda k, v: (k + 1, lax.pmean(v, "i")),
                            (0, x))[1], "i")(np.zeros((2, 3), np.float32))


@case("print-in-loop", OPS,
      "a tf.print or tf.debugging assertion inside a tf.while_loop",
      ValueError,
      r"tf.print or a tf.debugging assertion inside a tf.while_loop in the "
      r"function mapped over axis 'i'.*Move the print or assertion out of "
      r"the loop.*debug=True")
def _():
  def body(k, v):
    tf.print(v)
    return k + 1, v + 1
  P(lambda x: tf.while_loop(lambda k, v: k < 2, body, (0, x))[1], "i")(
      np.zeros(2, np.float32))


@case("print-with-steps", OPS,
      "a tf.print or tf.debugging assertion in a pmap with steps=",
      ValueError,
      r"tf.print or a tf.debugging assertion inside a pmap with steps=2.*"
      r"Return the values to print or check from the step")
def _():
  def step(c, x):
    tf.debugging.assert_less(x, 1.0)
    return c, x
  P(step, steps=2)(np.zeros(2, np.float32), np.zeros((2, 2), np.float32))


@case("print-of-computed-string", OPS,
      "tf.print of a string tensor computed inside the mapped function",
      ValueError,
      r"tf.print inside a mapped function is given a string tensor computed "
      r"while it runs.*Pass the numbers and put the text in the message")
def _():
  P(lambda x: (tf.print(tf.strings.as_string(x)), x)[1], "i")(
      np.zeros(2, np.float32))


@case("gradient-through-unbounded-loop", OPS,
      "a GradientTape through a tf.while_loop without maximum_iterations",
      ValueError,
      r"takes a gradient through a tf.while_loop with no maximum_iterations"
      r".* Give the loop maximum_iterations")
def _():
  def grad(v):
    with tf.GradientTape() as tape:
      tape.watch(v)
      y = tf.while_loop(lambda k, c: k < 2, lambda k, c: (k + 1, c * c),
                        (0, v))[1]
      loss = tf.reduce_sum(y)
    return tape.gradient(loss, v)
  P(grad, "i")(np.ones((2, 3), np.float32))


@case("new-axis-on-replicated", OPS,
      "x[None] of an in_axes=None argument (DTensor would crash)", ValueError,
      r"indexes a value that is the same on every device with a new axis "
      r"\(x\[None\].*at tests/test_errors.py:LINE.*tf.expand_dims")
def _():
  P(lambda v, w: v + w[None][0], in_axes=(0, None))(
      np.zeros((2, 3), np.float32), np.ones(3, np.float32))


@case("dynamic-shape-in-tf-function", OPS,
      "a pmap inside a tf.function whose mapped axis has an open size",
      ValueError, r"pmap inside a tf.function maps axis 0 of args\[0\], of "
      r"shape \(None,\), whose size is open \(None\)")
def _():
  f = P(lambda v: v)
  # No AutoGraph: it would prefix the message with a traceback of this file.
  tf.function(lambda v: f(v), autograph=False,
              input_signature=[tf.TensorSpec([None], tf.float32)]
              ).get_concrete_function()

# --- state, steps and configuration ----------------------------------------------


@case("set-num-cpu-devices-late", STATE,
      "set_num_cpu_devices after TensorFlow started", RuntimeError,
      r"set_num_cpu_devices\(4\) came too late: TensorFlow has already created "
      r"its devices, with 8 logical CPU device\(s\)")
def _():
  tfspmd.set_num_cpu_devices(4)


@case("set-num-cpu-devices-zero", STATE, "set_num_cpu_devices(0)",
      ValueError, r"set_num_cpu_devices: `count` must be >= 1, got 0")
def _():
  tfspmd.set_num_cpu_devices(0)


@case("set-num-cpu-devices-bool", STATE, "set_num_cpu_devices(True)",
      TypeError, r"set_num_cpu_devices: `count` must be an int, got bool True")
def _():
  tfspmd.set_num_cpu_devices(True)


@case("steps-zero", STATE, "steps=0", ValueError,
      r"`steps` must be a positive int or None, got 0")
def _():
  P(lambda c, x: (c, x), steps=0)


@case("steps-input-length", STATE,
      "a per-step input whose length is not steps", ValueError,
      r"steps=3: args\[1\] is a per-step input, so its first per-device axis "
      r"must have length 3 .* per-device shape is \(2,\)")
def _():
  P(lambda c, x: (c, x), steps=3)(np.zeros(2), np.zeros((2, 2)))


@case("steps-nested", STATE, "steps= on a nested pmap", ValueError,
      r"steps= is for the outermost pmap")
def _():
  P(P(lambda c, x: (c, x), "c", steps=2), "r")(np.zeros((2, 2)),
                                               np.zeros((2, 2, 2)))


@case("fun-not-callable", STATE, "pmap(3)", TypeError,
      r"pmap: `fun` must be callable, got 3")
def _():
  P(3)


@case("debug-not-bool", STATE, "debug='yes'", TypeError,
      r"pmap: `debug` must be True or False, got str 'yes'")
def _():
  P(lambda x: x, debug="yes")


@case("sharded-index-out-of-range", STATE,
      "out[5] of a ShardedArray of 2 devices", IndexError,
      r"index 5 is out of bounds for axis 0 with size 2")
def _():
  P(lambda x: x)(np.zeros(2))[5]  # pylint: disable=expression-not-assigned


@case("sharded-reshape-mapped-axis", STATE,
      "reshape of a ShardedArray that merges its mapped axis", ValueError,
      r"ShardedArray.reshape: an array of shape \(2, 4\) split over devices "
      r"along axes \[0\] keeps its first 1 axes \(2,\), .*got \(8,\)")
def _():
  P(lambda x: x)(np.zeros((2, 4))).reshape(8)


@case("sharded-arithmetic-other-devices", STATE,
      "arithmetic between ShardedArrays on devices 0-3 and on devices 4-7",
      ValueError,
      r"ShardedArray arithmetic needs both arrays on the same devices; one "
      r"lies on 4 \w+ devices \[0, 1, 2, 3\], the other on 4 \w+ devices "
      r"\[4, 5, 6, 7\]\. Fetch one with np.asarray first")
def _():
  x = np.ones((4, 2), np.float32)
  P(lambda v: v, devices=tfspmd.devices()[:4])(x) + P(
      lambda v: v, devices=tfspmd.devices()[4:])(x)


@case("config-unknown-setting", STATE,
      "tfspmd.config.update('jax_debug_nans', True)", AttributeError,
      r"tfspmd.config.update: no setting 'jax_debug_nans'; the settings are "
      r"\['tfspmd_enable_x64', 'tfspmd_log_compiles'\] \(JAX's names: "
      r"\['jax_enable_x64', 'jax_log_compiles'\]\)")
def _():
  tfspmd.config.update("jax_debug_nans", True)


@case("config-not-bool", STATE, "tfspmd.config.update(name, 'no')",
      TypeError, r"tfspmd_enable_x64 must be True or False, got str 'no'")
def _():
  tfspmd.config.update("tfspmd_enable_x64", "no")


@case("config-attribute-assignment", STATE,
      "tfspmd.config.tfspmd_enable_x64 = False", AttributeError,
      r"tfspmd.config.tfspmd_enable_x64 cannot be assigned; write "
      r"tfspmd.config.update\('tfspmd_enable_x64', False\) instead")
def _():
  tfspmd.config.tfspmd_enable_x64 = False


@case("config-attribute-unknown", STATE, "tfspmd.config.enable_x64 = False",
      AttributeError,
      r"tfspmd.config has no setting 'enable_x64' to assign; the settings are "
      r"\['tfspmd_enable_x64', 'tfspmd_log_compiles'\], changed with "
      r"tfspmd.config.update")
def _():
  tfspmd.config.enable_x64 = False


@case("dtensor-gather-switch-off", STATE,
      "LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2=0 in the environment, to "
      "turn DTensor's switch off", UserWarning,
      r"LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2='0' is set: DTensor turns "
      r"this switch on whenever the variable is set, whatever its value.*To "
      r"turn it off, remove it: del os\.environ\["
      r"'LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2'\]")
def _():
  with mock.patch.dict(
      os.environ, {"LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2": "0"}):
    raise_warning(lambda: P(lambda x: x * 2)(np.zeros(8)))


@case("variable-assign-debug", STATE,
      "assigning to a tf.Variable inside a pmap in debug mode", ValueError,
      r"writes to a tf.Variable \(AssignAddVariableOp\).*Pass the state")
def _():
  v = tf.Variable(0.)
  P(lambda x: v.assign_add(tf.reduce_sum(x)), debug=True)(
      np.zeros(2, np.float32))

# --- shard_map ---------------------------------------------------------------


def _mesh():
  return tfspmd.make_mesh((2, 4), ("data", "model"))


@case("shard-map-indivisible", SHARD_MAP,
      "an input dimension not divisible by the mesh axes that split it",
      ValueError, r"dimension 0 of args\[0\] has size 3.*not divisible by 2")
def _():
  tfspmd.shard_map(lambda b: b, mesh=_mesh(), in_specs=tfspmd.P("data"),
                   out_specs=tfspmd.P("data"))(np.zeros(3))


@case("shard-map-in-specs-list", SHARD_MAP,
      "in_specs=[P('data'), P('data')], a list, for two arguments", ValueError,
      r"shard_map: in_specs is a list, \[PartitionSpec\('data'\), "
      r"PartitionSpec\('data'\)\]; .*write in_specs=\(PartitionSpec\('data'\), "
      r"PartitionSpec\('data'\)\)")
def _():
  tfspmd.shard_map(lambda a, b: a + b, mesh=_mesh(),
                   in_specs=[tfspmd.P("data"), tfspmd.P("data")],
                   out_specs=tfspmd.P("data"))(np.zeros(2), np.zeros(2))


@case("shard-map-unknown-axis", SHARD_MAP,
      "a partition spec naming an axis the mesh does not have", ValueError,
      r"args\[0\] names the axis 'rows', which is not an axis of the mesh")
def _():
  tfspmd.shard_map(lambda b: b, mesh=_mesh(), in_specs=tfspmd.P("rows"),
                   out_specs=tfspmd.P())(np.zeros(4))


@case("shard-map-spec-too-long", SHARD_MAP,
      "a partition spec longer than the value's rank", ValueError,
      r"in spec PartitionSpec\('data', None\) for args\[0\] has 2 entries, "
      r"but the value has rank 1")
def _():
  tfspmd.shard_map(lambda b: b, mesh=_mesh(), in_specs=tfspmd.P("data", None),
                   out_specs=tfspmd.P())(np.zeros(4))


@case("shard-map-axis-twice", SHARD_MAP,
      "the same mesh axis twice in one partition spec", ValueError,
      r"args\[0\] names the mesh axis 'data' twice")
def _():
  tfspmd.shard_map(lambda b: b, mesh=_mesh(),
                   in_specs=tfspmd.P("data", "data"),
                   out_specs=tfspmd.P())(np.zeros((4, 4)))


@case("shard-map-out-spec-too-long", SHARD_MAP,
      "an out spec longer than the output's rank", ValueError,
      r"out spec PartitionSpec\('data', None\) for output has 2 entries")
def _():
  tfspmd.shard_map(lambda b: b, mesh=_mesh(), in_specs=tfspmd.P(),
                   out_specs=tfspmd.P("data", None))(np.zeros(4))


@case("shard-map-varying-output", SHARD_MAP,
      "an output that varies along a mesh axis its out spec leaves out",
      ValueError, r"shard_map: output varies along the mesh axis 'model', "
      r"which its out spec does not name")
def _():
  tfspmd.shard_map(
      lambda b: b + tf.cast(tfspmd.lax.axis_index("model"), tf.float64),
      mesh=_mesh(), in_specs=tfspmd.P("data"),
      out_specs=tfspmd.P("data"))(np.zeros(4))


@case("shard-map-inside-pmap", SHARD_MAP, "a shard_map inside a pmap",
      ValueError, r"shard_map inside a pmap or vmap is not supported")
def _():
  mesh = _mesh()
  P(lambda v: tfspmd.shard_map(lambda b: b, mesh=mesh, in_specs=tfspmd.P(),
                               out_specs=tfspmd.P())(v))(np.zeros(8))


@case("shard-map-not-a-mesh", SHARD_MAP, "a mesh that is not a tfspmd.Mesh",
      TypeError, r"`mesh` must be a tfspmd.Mesh")
def _():
  tfspmd.shard_map(lambda b: b, mesh="mesh", in_specs=tfspmd.P(),
                   out_specs=tfspmd.P())


@case("shard-map-no-mesh", SHARD_MAP,
      "a shard_map without a mesh called where tfspmd.set_mesh set none",
      ValueError, r"shard_map: no `mesh` was given and none is set: pass "
      r"mesh=\.\.\., or call the function inside `with tfspmd.set_mesh")
def _():
  tfspmd.shard_map(lambda b: b, in_specs=tfspmd.P(),
                   out_specs=tfspmd.P())(np.zeros(4))


@case("shard-map-missing-specs", SHARD_MAP, "a shard_map without out_specs",
      TypeError, r"shard_map: `out_specs` is missing: give a tfspmd.P per "
      r"output")
def _():
  tfspmd.shard_map(lambda b: b, _mesh(), tfspmd.P())


@case("shard-map-check-rep-and-check-vma", SHARD_MAP,
      "both check_rep and its newer name check_vma", TypeError,
      r"shard_map: give `check_vma` or its older name `check_rep`, not both")
def _():
  tfspmd.shard_map(lambda b: b, _mesh(), tfspmd.P(), tfspmd.P(),
                   check_rep=True, check_vma=True)


@case("shard-map-check-rep-not-bool", SHARD_MAP,
      "a check_rep that is not True or False", TypeError,
      r"shard_map: `check_rep` must be True or False, got 'yes'")
def _():
  tfspmd.shard_map(lambda b: b, _mesh(), tfspmd.P(), tfspmd.P(),
                   check_rep="yes")


@case("shard-map-auto", SHARD_MAP,
      "mesh axes left automatic (the older shard_map's `auto`)", ValueError,
      r"shard_map: `auto` must be empty, got \{'model'\}")
def _():
  tfspmd.shard_map(lambda b: b, _mesh(), tfspmd.P("data"), tfspmd.P("data"),
                   auto=frozenset({"model"}))


@case("set-mesh-not-a-mesh", SHARD_MAP,
      "tfspmd.set_mesh of something that is not a tfspmd.Mesh", TypeError,
      r"set_mesh: `mesh` must be a tfspmd.Mesh \(tfspmd.make_mesh\(\.\.\.\)\) "
      r"or None, got str")
def _():
  tfspmd.set_mesh("mesh")


@case("make-mesh-axis-types", SHARD_MAP,
      "mesh axis types that are not one AxisType per axis", ValueError,
      r"make_mesh: `axis_types` must hold one tfspmd.sharding.AxisType per "
      r"axis name \('data', 'model'\), got \(Auto,\)")
def _():
  tfspmd.make_mesh((2, 4), ("data", "model"),
                   (tfspmd.sharding.AxisType.Auto,))


@case("make-mesh-too-big", SHARD_MAP, "a mesh bigger than the devices there are",
      ValueError, r"a mesh of shape \(4, 4\) needs 16 devices, only 8 are "
      r"available")
def _():
  tfspmd.make_mesh((4, 4), ("a", "b"))


@case("mesh-dtensor-mesh-axis-name", SHARD_MAP,
      "the DTensor mesh of a mesh whose axis name DTensor cannot take",
      ValueError, r"Mesh.dtensor_mesh: the axis name 'a b' cannot name a "
      r"DTensor mesh dimension: DTensor takes only letters, digits")
def _():
  return tfspmd.make_mesh((2, 4), ("a b", "model")).dtensor_mesh


# --- pytrees -----------------------------------------------------------------


@case("tree-map-structures", PYTREES,
      "tree_map over trees of different structures", ValueError,
      r"tree_map: rest\[0\] does not have the structure of tree: tree is "
      r"\{'a': \*, 'b': \*\}, rest\[0\] is \{'a': \*, 'c': \*\}")
def _():
  tfspmd.tree_util.tree_map(lambda x, y: x, {"a": 1, "b": 2}, {"a": 1, "c": 2})


@case("dataclass-one-field-list", PYTREES,
      "register_dataclass with data_fields but no meta_fields", TypeError,
      r"register_dataclass: give both data_fields and meta_fields or neither; "
      r"got data_fields=\['x'\], meta_fields=None")
def _():
  tfspmd.tree_util.register_dataclass(
      dataclasses.make_dataclass("OneList", ["x"]), data_fields=["x"])


@case("dataclass-not-a-dataclass", PYTREES,
      "register_dataclass of a plain class without its fields", TypeError,
      r"register_dataclass: data_fields and meta_fields are needed when "
      r"nodetype is not a dataclass")
def _():
  tfspmd.tree_util.register_dataclass(type("Plain", (), {}))


@case("dataclass-fields-missing", PYTREES,
      "register_dataclass fields that leave out a dataclass field", ValueError,
      r"must name every field of Partial with init=True .*; missing \['y'\], "
      r"unexpected \[\]")
def _():
  tfspmd.tree_util.register_dataclass(
      dataclasses.make_dataclass("Partial", ["x", "y"]), data_fields=["x"],
      meta_fields=[])


@case("dataclass-fields-overlap", PYTREES,
      "register_dataclass naming a field as data and meta", ValueError,
      r"data_fields and meta_fields must not overlap; both name \['x'\]")
def _():
  tfspmd.tree_util.register_dataclass(type("Overlap", (), {}),
                                      data_fields=["x"], meta_fields=["x"])


# --- several processes: what one process can show (the rest below) ------------

INIT = tfspmd.distributed.initialize
TWO_ADDRESSES = ["localhost:9000", "localhost:9001"]


@case("initialize-after-devices", PROCESSES,
      "tfspmd.distributed.initialize() after TensorFlow started its devices",
      RuntimeError, r"initialize\(\) came too late: TensorFlow has already "
      r"started its devices")
def _():
  P(lambda x: x)(np.zeros(2))
  INIT(process_addresses=TWO_ADDRESSES, process_id=0)


@case("initialize-no-addresses", PROCESSES,
      "initialize(num_processes=2) without a coordinator or the processes' "
      "addresses",
      ValueError, r"num_processes=2, process_id=None, but neither a "
      r"coordinator address nor process addresses were given. Pass "
      r"coordinator_address=")
def _():
  INIT(num_processes=2)


@case("initialize-coordinator-without-process-id", PROCESSES,
      "initialize(coordinator_address=..., num_processes=2) without "
      "process_id", ValueError,
      r"num_processes=2 lists 2 processes but nothing says which one this is: "
      r"pass process_id=")
def _():
  INIT(coordinator_address="localhost:1234", num_processes=2)


@case("initialize-no-process-id", PROCESSES,
      "initialize(process_addresses=[...]) without process_id", ValueError,
      r"process_addresses lists 2 processes but nothing says which one this "
      r"is: pass process_id=")
def _():
  INIT(process_addresses=TWO_ADDRESSES)


@case("initialize-process-id-range", PROCESSES,
      "initialize(process_addresses=[two], process_id=2)", ValueError,
      r"process_id=2 is out of range for the 2 processes")
def _():
  INIT(process_addresses=TWO_ADDRESSES, process_id=2)


@case("initialize-timeout", PROCESSES, "initialize(initialization_timeout=0)",
      ValueError, r"`initialization_timeout` must be a positive, finite "
      r"number of seconds, got 0")
def _():
  INIT(initialization_timeout=0)


@case("initialize-local-device-ids-cpu", PROCESSES,
      "initialize(local_device_ids=[0]) on CPU", ValueError,
      r"`local_device_ids` picks physical GPUs, but the platform is 'cpu'")
def _():
  INIT(local_device_ids=[0], backend="cpu")


@case("initialize-coordinator-not-a-string", PROCESSES,
      "initialize(coordinator_address=('localhost', 1234))", TypeError,
      r"coordinator_address must be a 'host:port' string, got tuple "
      r"\('localhost', 1234\), such as 'host0:1234'")
def _():
  INIT(coordinator_address=("localhost", 1234), num_processes=2, process_id=1)


@case("initialize-coordinator-url", PROCESSES,
      "initialize(coordinator_address='http://host0:1234')", ValueError,
      r"coordinator_address must be 'host:port', got 'http://host0:1234': a "
      r"host name or IP address, ':', and a port in 1\.\.65535, with no "
      r"scheme")
def _():
  INIT(coordinator_address="http://host0:1234", num_processes=2, process_id=1)


@case("initialize-coordinator-port-range", PROCESSES,
      "initialize(coordinator_address='localhost:70000')", ValueError,
      r"coordinator_address must be 'host:port', got 'localhost:70000': .*a "
      r"port in 1\.\.65535")
def _():
  INIT(coordinator_address="localhost:70000", num_processes=2, process_id=1)


@case("initialize-num-processes-string", PROCESSES,
      "initialize(num_processes='2'), read from the environment as a string",
      TypeError, r"`num_processes` must be an int, got str '2'; write "
      r"num_processes=int\(\.\.\.\)")
def _():
  INIT(coordinator_address="localhost:1234", num_processes="2", process_id=1)


@case("initialize-num-processes-zero", PROCESSES,
      "initialize(num_processes=0)", ValueError,
      r"`num_processes` must be a positive int, got 0")
def _():
  INIT(num_processes=0)


@case("initialize-process-id-string", PROCESSES,
      "initialize(process_id='1')", TypeError,
      r"`process_id` must be an int, got str '1'")
def _():
  INIT(coordinator_address="localhost:1234", num_processes=2, process_id="1")


@case("initialize-timeout-infinite", PROCESSES,
      "initialize(initialization_timeout=float('inf'))", ValueError,
      r"`initialization_timeout` must be a positive, finite number of "
      r"seconds, got inf")
def _():
  INIT(initialization_timeout=float("inf"))


@case("initialize-address-not-a-string", PROCESSES,
      "initialize(process_addresses=[('localhost', 9000), ...])", TypeError,
      r"every process address \(from process_addresses\) must be a "
      r"'host:port' string, got tuple \('localhost', 9000\)")
def _():
  INIT(process_addresses=[("localhost", 9000), ("localhost", 9001)],
       process_id=0)


@case("initialize-addresses-repeated", PROCESSES,
      "one address twice in process_addresses", ValueError,
      r"process_addresses lists \['localhost:9000'\] more than once: "
      r"\['localhost:9000', 'localhost:9000'\]\. Give every process its own "
      r"'host:port'")
def _():
  INIT(process_addresses=["localhost:9000", "localhost:9000"], process_id=0)


@case("initialize-heartbeat-twice", PROCESSES,
      "initialize with heartbeat_timeout_seconds and heartbeat_timeout",
      TypeError, r"give `heartbeat_timeout_seconds` \(JAX's name\) or "
      r"`heartbeat_timeout` \(its earlier name\), not both; got 5 and 7")
def _():
  INIT(heartbeat_timeout_seconds=5, heartbeat_timeout=7)


@case("initialize-cluster-detection-method", PROCESSES,
      "initialize(cluster_detection_method='mpi4py')", ValueError,
      r"`cluster_detection_method` must be None .* or 'deactivate', got "
      r"'mpi4py'")
def _():
  INIT(cluster_detection_method="mpi4py")


@case("initialize-slice-index", PROCESSES, "initialize(slice_index=1)",
      ValueError, r"`slice_index` must be None, got 1: DTensor's runtime "
      r"numbers processes only")
def _():
  INIT(slice_index=1)


@case("initialize-shutdown-timeout", PROCESSES,
      "initialize(shutdown_timeout_seconds=-1)", ValueError,
      r"`shutdown_timeout_seconds` must be a positive, finite number of "
      r"seconds, got -1")
def _():
  INIT(shutdown_timeout_seconds=-1)


@case("initialize-bind-address", PROCESSES,
      "initialize(coordinator_bind_address='9000')", ValueError,
      r"coordinator_bind_address")
def _():
  INIT(coordinator_address="localhost:9000", num_processes=2, process_id=0,
       coordinator_bind_address="9000")


def _as_two_processes(trigger):
  """`trigger` run as process 0 of 2, its devices the first 2 of 4.

  Nested pmaps whose axis crosses processes raise these errors while the
  program traces, before any device would wait on the other process.
  """
  def run():
    theirs = [dataclasses.replace(d, process_index=1)
              for d in tfspmd.devices()[2:4]]
    with mock.patch.object(devices_lib, "process_count", return_value=2):
      trigger(list(tfspmd.devices()[:2]) + theirs)
  return run


def _psum_over(name, axis_size):
  return P(lambda v: lax.psum(v, name), name, axis_size=axis_size)


@case("nested-crossing-axis-size", PROCESSES,
      "with 2 processes, a nested pmap's axis_size=3 where each process "
      "passes 2 positions of its axis", ValueError,
      r"pmap was given axis_size=3, but its mapped arguments have size 2 "
      r"along the mapped axis\. With several processes a nested pmap's "
      r"axis_size is the global size of its axis.*a divisor of axis_size")
@_as_two_processes
def _(devices):
  del devices
  P(_psum_over("i", 3), "o")(np.zeros((1, 2)))


@case("nested-crossing-grid", PROCESSES,
      "with 2 processes passing 1 x 2 positions, a nested axis_size=6, which "
      "does not divide the grid's 4 positions", ValueError,
      r"the nested axes crossing processes, 'i' \(6\), have global sizes "
      r"whose product 6 does not divide the 4 grid positions.*axis_size= "
      r"values whose product divides 4")
@_as_two_processes
def _(devices):
  del devices
  P(_psum_over("i", 6), "o")(np.zeros((1, 2)))


@case("nested-crossing-not-an-input", PROCESSES,
      "with 2 processes, a nested pmap whose axis crosses processes mapping a "
      "value computed inside the outer function", ValueError,
      r"the nested pmap over axis 'i' has global size 4, which crosses "
      r"processes, but a mapped argument has size 2 and is not an input of "
      r"the outermost pmap.*map the inputs of the outermost pmap")
@_as_two_processes
def _(devices):
  del devices
  P(lambda x: _psum_over("i", 4)(x * 2), "o")(np.zeros((1, 2)))


@case("nested-crossing-one-depth", PROCESSES,
      "with 2 processes, nested pmaps at one depth whose axes cross processes "
      "with axis_size=4 and axis_size=8", ValueError,
      r"the nested pmaps over axes 'i' and 'j' run at one depth, so they "
      r"share a mesh dimension, but their axes cross processes differently: "
      r"the inputs of 'i' hold 2 of its 4 positions, those of 'j' 2 of 8\. "
      r"Give the nested pmaps at one depth the same axis_size")
@_as_two_processes
def _(devices):
  del devices
  P(lambda x, y: (_psum_over("i", 4)(x), _psum_over("j", 8)(y)), "o")(
      np.zeros((1, 2)), np.zeros((1, 2)))


@case("nested-crossing-devices", PROCESSES,
      "with 2 processes, devices= on the outermost pmap of a nested pmap "
      "whose axis crosses processes", ValueError,
      r"the nested pmap over axis 'i' has global size 4, of which its inputs "
      r"hold 2 positions, so its axis crosses processes; an axis crossing "
      r"processes needs the outermost pmap without devices=\. Leave devices= "
      r"out")
@_as_two_processes
def _(devices):
  P(_psum_over("i", 4), "o", devices=devices)(np.zeros((1, 2)))

# --- shardings and device_put --------------------------------------------------


@case("named-sharding-unknown-axis", SHARDINGS,
      "NamedSharding(mesh, P('z')) on a mesh without 'z'", ValueError,
      r"NamedSharding: `spec` PartitionSpec\('z'\) names the axis 'z', "
      r"which is not an axis of the mesh \(axes: \('x',\)\)")
def _():
  tfspmd.sharding.NamedSharding(tfspmd.make_mesh((8,), ("x",)),
                                tfspmd.P("z"))


@case("named-sharding-spec-tuple", SHARDINGS,
      "NamedSharding(mesh, ('x',)): a tuple, not a PartitionSpec", TypeError,
      r"NamedSharding: `spec` must be a tfspmd.PartitionSpec \(tfspmd.P\(...\)\), "
      r"got tuple \('x',\)")
def _():
  tfspmd.sharding.NamedSharding(tfspmd.make_mesh((8,), ("x",)), ("x",))


@case("single-device-sharding-not-a-device", SHARDINGS,
      "SingleDeviceSharding('cpu:0')", TypeError,
      r"SingleDeviceSharding: `device` must be a tfspmd.Device")
def _():
  tfspmd.sharding.SingleDeviceSharding("cpu:0")


@case("device-put-indivisible", SHARDINGS,
      "device_put of 6 rows split 8 ways", ValueError,
      r"x\['w'\] of shape \(6,\): NamedSharding\(.*\) splits dimension 0 8 "
      r"ways, which does not evenly divide its size 6")
def _():
  tfspmd.device_put({"w": np.zeros(6)}, tfspmd.sharding.NamedSharding(
      tfspmd.make_mesh((8,), ("x",)), tfspmd.P("x")))


@case("device-put-spec-too-long", SHARDINGS,
      "device_put of a vector with a spec of two entries", ValueError,
      r"x of shape \(8,\) has rank 1, but NamedSharding\(.*\) splits 2 "
      r"dimensions")
def _():
  tfspmd.device_put(np.zeros(8), tfspmd.sharding.NamedSharding(
      tfspmd.make_mesh((8,), ("x",)), tfspmd.P("x", None)))


@case("device-put-target", SHARDINGS, "device_put(x, 'gpu')", TypeError,
      r"device_put: the `device` for x must be a NamedSharding, a "
      r"PartitionSpec, a SingleDeviceSharding, a tfspmd.Device or None, got "
      r"str 'gpu'")
def _():
  tfspmd.device_put(np.zeros(2), "gpu")


@case("device-put-spec-without-mesh", SHARDINGS,
      "device_put(x, P('x')) with no mesh set", TypeError,
      r"device_put: the `device` for x is the PartitionSpec "
      r"PartitionSpec\('x'\), which needs a mesh: set one first")
def _():
  tfspmd.device_put(np.zeros(2), tfspmd.P("x"))


@case("device-put-src", SHARDINGS, "device_put(x, src=a device)", ValueError,
      r"device_put: `src` must be None")
def _():
  tfspmd.device_put(np.zeros(2), src=tfspmd.devices()[0])


@case("device-put-sharded-count", SHARDINGS,
      "device_put_sharded of 3 shards onto 2 devices", ValueError,
      r"device_put_sharded: `shards` has 3 entries but `devices` 2")
def _():
  tfspmd.device_put_sharded([np.zeros(2)] * 3, tfspmd.devices()[:2])


@case("device-put-sharded-shapes", SHARDINGS,
      "device_put_sharded of shards of different shapes", ValueError,
      r"device_put_sharded: shards\[1\]\['w'\] has shape \[3\] and dtype "
      r"float64, shards\[0\]\['w'\] \[2\] and float64")
def _():
  tfspmd.device_put_sharded([{"w": np.zeros(2)}, {"w": np.zeros(3)}],
                            tfspmd.devices()[:2])


@case("device-put-sharded-structures", SHARDINGS,
      "device_put_sharded of shards of different structures", ValueError,
      r"device_put_sharded: shards\[1\] has the structure \(\*, \*\), "
      r"shards\[0\] \(\*,\)")
def _():
  tfspmd.device_put_sharded([(np.zeros(2),), (np.zeros(2), np.zeros(2))],
                            tfspmd.devices()[:2])


@case("device-put-replicated-devices", SHARDINGS,
      "device_put_replicated(x, ['cpu:0'])", TypeError,
      r"device_put_replicated: `devices` must be a non-empty sequence of "
      r"tfspmd devices")
def _():
  tfspmd.device_put_replicated(np.zeros(2), ["cpu:0"])


@case("device-put-sharded-device-twice", SHARDINGS,
      "device_put_sharded onto one device twice", ValueError,
      r"device_put_sharded: a device appears more than once in `devices`")
def _():
  tfspmd.device_put_sharded([np.zeros(2)] * 2, [tfspmd.devices()[0]] * 2)


@case("local-devices-process-index", DEVICES,
      "local_devices(process_index=3) in one process", ValueError,
      r"local_devices: `process_index` must be the index of a process, an "
      r"int from 0 to 0 \(1 process\(es\)\), got 3")
def _():
  tfspmd.local_devices(process_index=3)


@case("jax-enable-x64-invalid", STATE, "JAX_ENABLE_X64=maybe in the environment",
      ValueError, r"JAX_ENABLE_X64 must be one of .*'true'.*'false'.* to turn "
      r"tfspmd_enable_x64 on or off, got 'maybe'")
def _():
  with mock.patch.dict(os.environ, {"JAX_ENABLE_X64": "maybe"}):
    config_lib.Config()


@case("vmap-spmd-axis-name-unhashable", NAMES,
      "vmap(spmd_axis_name=['i'])", TypeError,
      r"vmap: `spmd_axis_name` must be None, an axis name or a tuple of axis "
      r"names, got \['i'\]")
def _():
  tfspmd.vmap(lambda x: x, spmd_axis_name=["i"])



def _tf_config(text):
  """Runs initialize() with `text` as the TF_CONFIG a launcher set."""
  with mock.patch.dict(os.environ, {"TF_CONFIG": text}):
    INIT()


@case("tf-config-not-json", PROCESSES,
      "TF_CONFIG that is not JSON (unquoted keys)", ValueError,
      r"TF_CONFIG is not JSON \(Expecting property name enclosed in double "
      r"quotes: .*\): it must be like \{\"cluster\": \{\"worker\": "
      r"\[\"host:port\", \.\.\.\]\}, \"task\": \{\"type\": \"worker\", "
      r"\"index\": 0\}\}")
def _():
  _tf_config("{cluster: {worker: ['h0:2222']}}")


@case("tf-config-not-an-object", PROCESSES,
      "TF_CONFIG whose \"cluster\" is not an object", ValueError,
      r"TF_CONFIG must be a JSON object with a \"cluster\" object, got "
      r"'\{\"cluster\": \[\"h0:2222\"\]\}'")
def _():
  _tf_config('{"cluster": ["h0:2222"]}')


@case("tf-config-job-not-a-list", PROCESSES,
      "TF_CONFIG whose \"worker\" job is one string of addresses", ValueError,
      r"TF_CONFIG's 'worker' job must be a list of 'host:port' strings, got "
      r"'h0:2222,h1:2222'")
def _():
  _tf_config('{"cluster": {"worker": "h0:2222,h1:2222"}, '
             '"task": {"type": "worker", "index": 0}}')


@case("tf-config-task-type", PROCESSES,
      "TF_CONFIG whose task is an \"evaluator\" (or \"ps\")", ValueError,
      r"TF_CONFIG's task is \{'type': 'evaluator', 'index': 0\}, but the "
      r"processes that run a pmap together are the cluster's \"chief\" and "
      r"\"worker\" tasks: give this process \"task\": \{\"type\": \"worker\" "
      r"\(or \"chief\"\), \"index\": \.\.\.\}, or do not call "
      r"tfspmd\.distributed\.initialize in it")
def _():
  _tf_config('{"cluster": {"worker": ["h0:2222", "h1:2222"], '
             '"evaluator": ["e0:2222"]}, '
             '"task": {"type": "evaluator", "index": 0}}')


@case("tf-config-index-range", PROCESSES,
      "TF_CONFIG whose task index is past its job's tasks", ValueError,
      r"TF_CONFIG's task index 2 is out of range for its 'worker' job of 2 "
      r"task\(s\)")
def _():
  _tf_config('{"cluster": {"worker": ["h0:2222", "h1:2222"]}, '
             '"task": {"type": "worker", "index": 2}}')

# --- adapters: checkpoints ---------------------------------------------------


def _saved(state, **trackables):
  """A checkpoint of `state` in a fresh directory."""
  return checkpoint.save(os.path.join(tempfile.mkdtemp(), "ckpt"), state,
                         **trackables)


_PARAMS = {"bias": np.zeros(3, np.float32),
           "kernel": np.zeros((4, 3), np.float32)}


@case("checkpoint-none-leaf", CHECKPOINTS, "checkpoint.save of a None leaf",
      TypeError, r"checkpoint\.save: state\['opt'\]\[1\] is None, which a "
      r"checkpoint cannot hold: leave the leaf out of the state, or put an "
      r"empty array \(np\.zeros\(0\)\) in its place")
def _():
  checkpoint.save(os.path.join(tempfile.mkdtemp(), "ckpt"),
                  {"w": np.zeros(2), "opt": [np.zeros(2), None]})


@case("checkpoint-not-an-array", CHECKPOINTS,
      "checkpoint.save of a leaf that is no array (a str)", TypeError,
      r"checkpoint\.save: state\['name'\] is a str, which a checkpoint cannot "
      r"hold: the leaves must be tfspmd\.ShardedArrays, tensors, NumPy arrays "
      r"or numbers")
def _():
  checkpoint.save(os.path.join(tempfile.mkdtemp(), "ckpt"),
                  {"w": np.zeros(2), "name": "run-3"})


@case("checkpoint-renamed-leaf", CHECKPOINTS,
      "checkpoint.restore into a `like` with a key renamed", ValueError,
      r"checkpoint\.restore: `like` does not have the leaves of the saved "
      r"state: the checkpoint has no value for like\['weights'\]; `like` has "
      r"no place for the saved state\['kernel'\], which would be lost\. The "
      r"checkpoint holds state\['bias'\], state\['kernel'\]")
def _():
  checkpoint.restore(_saved(_PARAMS), like={"bias": _PARAMS["bias"],
                                            "weights": _PARAMS["kernel"]})


@case("checkpoint-extra-leaf", CHECKPOINTS,
      "checkpoint.restore into a `like` with a key the checkpoint lacks",
      ValueError, r"the checkpoint has no value for like\['scale'\]\. The "
      r"checkpoint holds state\['bias'\], state\['kernel'\]")
def _():
  checkpoint.restore(_saved(_PARAMS), like={**_PARAMS, "scale": np.zeros(3)})


@case("checkpoint-missing-leaf", CHECKPOINTS,
      "checkpoint.restore into a `like` without one of the saved keys",
      ValueError, r"`like` has no place for the saved state\['bias'\], which "
      r"would be lost")
def _():
  checkpoint.restore(_saved(_PARAMS), like={"kernel": _PARAMS["kernel"]})


@case("checkpoint-shape", CHECKPOINTS,
      "checkpoint.restore into a leaf of another global shape", ValueError,
      r"like\['kernel'\] has shape \(3, 4\) on the host, but the checkpoint "
      r"saved state\['kernel'\] as shape \(4, 3\) on the host\. A restored "
      r"array keeps its saved global shape, split over any devices: restore "
      r"into a `like` of shape \(4, 3\)")
def _():
  checkpoint.restore(_saved(_PARAMS), like={"bias": _PARAMS["bias"],
                                            "kernel": np.zeros((3, 4))})


@case("checkpoint-dtype", CHECKPOINTS,
      "checkpoint.restore into a leaf of another dtype", ValueError,
      r"like\['bias'\] has dtype float64, but the checkpoint saved "
      r"state\['bias'\] as float32\. Restore into a `like` of dtype float32")
def _():
  checkpoint.restore(_saved(_PARAMS), like={"bias": np.zeros(3),
                                            "kernel": _PARAMS["kernel"]})


@case("checkpoint-per-device-count", CHECKPOINTS,
      "checkpoint.restore of a per-device pmap value from 8 devices onto 4",
      ValueError, r"like\['s'\] has shape \(4, 2\) split over 4 devices, but "
      r"the checkpoint saved state\['s'\] as shape \(8, 2\) split over 8 "
      r"devices, one row of axis 0 per device\. .*restore it into a NumPy "
      r"`like` of shape \(8, 2\) to get the 8 saved rows")
def _():
  path = _saved({"s": P(lambda x: x + 1)(np.zeros((8, 2)))})
  checkpoint.restore(path, like={"s": P(lambda x: x + 1)(np.zeros((4, 2)))})


@case("checkpoint-not-found", CHECKPOINTS,
      "checkpoint.restore of a path with no checkpoint", FileNotFoundError,
      r"checkpoint\.restore: there is no checkpoint at '/nonexistent/ckpt'\. "
      r"Pass the path given to checkpoint\.save, or the prefix it returned\.")
def _():
  checkpoint.restore("/nonexistent/ckpt", like=_PARAMS)


@case("checkpoint-replaced", CHECKPOINTS,
      "checkpoint.restore of a prefix save returned, after a later save to "
      "the same path", FileNotFoundError,
      r"there is no checkpoint at '/tmp/run/ckpt\.tfspmd-<32 hex digits>': a "
      r"later checkpoint\.save to '/tmp/run/ckpt' replaced it\. Restore "
      r"'/tmp/run/ckpt' for the latest checkpoint saved there\.")
def _():
  path = os.path.join(tempfile.mkdtemp(), "ckpt")
  first = checkpoint.save(path, _PARAMS)
  checkpoint.save(path, _PARAMS)
  checkpoint.restore(first, like=_PARAMS)


def _damaged(damage):
  """The path of a checkpoint of `_PARAMS`, after `damage(path, prefix)`.

  `_PARAMS` is 60 bytes of numbers (3 + 12 float32s); `prefix` is the one
  `save` returned, whose files the pointer at `path` names.
  """
  path = os.path.join(tempfile.mkdtemp(), "ckpt")
  damage(path, checkpoint.save(path, _PARAMS))
  return path


def _truncate(file, size):
  with open(file, "r+b") as opened:
    opened.truncate(size)


def _overwrite(file, contents):
  with open(file, "wb") as opened:
    opened.write(contents)


def _flip_last_byte(file):
  with open(file, "r+b") as opened:
    opened.seek(-1, os.SEEK_END)
    last = opened.read(1)[0]
    opened.seek(-1, os.SEEK_END)
    opened.write(bytes([last ^ 0xFF]))


_DATA = ".data-00000-of-00001"


@case("checkpoint-data-cut-short", CHECKPOINTS,
      "checkpoint.restore of a checkpoint whose data file was cut short",
      ValueError, r"checkpoint\.restore: the data file '/tmp/run/ckpt\.tfspmd-"
      r"<32 hex digits>\.data-00000-of-00001' is 10 bytes, shorter than the 60 "
      r"the index says it holds: the checkpoint at '/tmp/run/ckpt' is "
      r"damaged; restore an earlier one\.")
def _():
  path = _damaged(lambda path, prefix: _truncate(prefix + _DATA, 10))
  checkpoint.restore(path, like=_PARAMS)


@case("checkpoint-data-cut-by-a-byte", CHECKPOINTS,
      "checkpoint.restore of a checkpoint whose data file lost its last byte",
      ValueError, r"checkpoint\.restore: the data file '/tmp/run/ckpt\.tfspmd-"
      r"<32 hex digits>\.data-00000-of-00001' is shorter than the index "
      r"'/tmp/run/ckpt\.tfspmd-<32 hex digits>\.index' says: the checkpoint at "
      r"'/tmp/run/ckpt' is damaged; restore an earlier one\.")
def _():
  path = _damaged(lambda path, prefix: _truncate(
      prefix + _DATA, os.path.getsize(prefix + _DATA) - 1))
  checkpoint.restore(path, like=_PARAMS)


@case("checkpoint-data-changed", CHECKPOINTS,
      "checkpoint.restore of a checkpoint whose data file was changed",
      ValueError, r"checkpoint\.restore: the data file '/tmp/run/ckpt\.tfspmd-"
      r"<32 hex digits>\.data-00000-of-00001' does not match the checksums of "
      r"the index '/tmp/run/ckpt\.tfspmd-<32 hex digits>\.index': the "
      r"checkpoint at '/tmp/run/ckpt' is damaged; restore an earlier one\.")
def _():
  path = _damaged(lambda path, prefix: _flip_last_byte(prefix + _DATA))
  checkpoint.restore(path, like=_PARAMS)


@case("checkpoint-data-missing", CHECKPOINTS,
      "checkpoint.restore of a checkpoint whose data file was removed",
      ValueError, r"checkpoint\.restore: the data file '/tmp/run/ckpt\.tfspmd-"
      r"<32 hex digits>\.data-00000-of-00001' is missing: the checkpoint at "
      r"'/tmp/run/ckpt' is damaged; restore an earlier one\.")
def _():
  path = _damaged(lambda path, prefix: os.remove(prefix + _DATA))
  checkpoint.restore(path, like=_PARAMS)


@case("checkpoint-index-garbage", CHECKPOINTS,
      "checkpoint.restore of a checkpoint whose index is no index",
      ValueError, r"checkpoint\.restore: the index file '/tmp/run/ckpt\.tfspmd-"
      r"<32 hex digits>\.index' is not a checkpoint index: the checkpoint at "
      r"'/tmp/run/ckpt' is damaged; restore an earlier one\.")
def _():
  path = _damaged(lambda path, prefix: _overwrite(prefix + ".index",
                                                  b"not an index"))
  checkpoint.restore(path, like=_PARAMS)


@case("checkpoint-index-missing", CHECKPOINTS,
      "checkpoint.restore of a checkpoint whose index was removed",
      ValueError, r"checkpoint\.restore: the index file '/tmp/run/ckpt\.tfspmd-"
      r"<32 hex digits>\.index', which '/tmp/run/ckpt\.tfspmd' names, is "
      r"missing: the checkpoint at '/tmp/run/ckpt' is damaged; restore an "
      r"earlier one\.")
def _():
  path = _damaged(lambda path, prefix: os.remove(prefix + ".index"))
  checkpoint.restore(path, like=_PARAMS)


@case("checkpoint-pointer-garbage", CHECKPOINTS,
      "checkpoint.restore of a path whose .tfspmd file names no checkpoint",
      ValueError, r"checkpoint\.restore: '/tmp/run/ckpt\.tfspmd', the file "
      r"that names the current checkpoint files of '/tmp/run/ckpt', names "
      r"none: the checkpoint at '/tmp/run/ckpt' is damaged; restore an "
      r"earlier one\.")
def _():
  path = _damaged(lambda path, prefix: _overwrite(path + ".tfspmd", b"{"))
  checkpoint.restore(path, like=_PARAMS)


@case("checkpoint-not-from-save", CHECKPOINTS,
      "checkpoint.restore of a checkpoint not written by checkpoint.save",
      ValueError, r"the checkpoint holds no state written by "
      r"tfspmd\.adapters\.checkpoint\.save with its leaves' paths")
def _():
  path = tf.train.Checkpoint(state=[tf.Variable(1.)]).write(
      os.path.join(tempfile.mkdtemp(), "ckpt"))
  checkpoint.restore(path, like=[np.float32(0)])


@case("checkpoint-trackable-absent", CHECKPOINTS,
      "checkpoint.restore with a trackable that was not saved", ValueError,
      r"the checkpoint holds nothing for the trackables \['epoch'\]; beside "
      r"the state it holds \['step'\]")
def _():
  path = _saved(_PARAMS, step=tf.Variable(3))
  checkpoint.restore(path, like=_PARAMS, epoch=tf.Variable(0))


@case("checkpoint-trackable-mismatch", CHECKPOINTS,
      "checkpoint.restore with a trackable of another shape than saved",
      ValueError, r"the trackables \['step'\] do not match what the "
      r"checkpoint holds under those names")
def _():
  path = _saved(_PARAMS, step=tf.Variable(3))
  checkpoint.restore(path, like=_PARAMS, step=tf.Variable([0, 0]))


# --- adapters: Keras and tf.data ---------------------------------------------

# pylint: disable=g-import-not-at-top,wrong-import-position
import keras
from tfspmd.adapters import keras_training
from tfspmd.adapters import tf_data
# pylint: enable=g-import-not-at-top,wrong-import-position


def _tiny_model(loss="mse", metrics=None):
  # Fixed names: Keras numbers unnamed layers per process, and the messages
  # name the variables.
  model = keras.Sequential(
      [keras.Input((2,)), keras.layers.Dense(1, name="dense")], name="tiny")
  model.compile(optimizer="sgd", loss=loss, metrics=metrics)
  return model


def _xy(rows=8):
  return np.ones((rows, 2), np.float32), np.ones((rows, 1), np.float32)


def _fit(**kwargs):
  x, y = _xy()
  arguments = dict(y=y, batch_size=8, verbose=0)
  arguments.update(kwargs)
  keras_training.KerasTrainer(_tiny_model()).fit(x, **arguments)


def _model_overriding(step):
  """A compiled functional model whose class replaces Keras' `step`."""
  custom = type("CustomStep", (keras.Model,), {
      step: lambda self, data: getattr(keras.Model, step)(self, data)})
  inputs = keras.Input((2,))
  model = custom(inputs, keras.layers.Dense(1, name="dense")(inputs),
                 name="custom")
  model.compile(optimizer="sgd", loss="mse")
  return model


def _built_trainer():
  trainer = keras_training.KerasTrainer(_tiny_model())
  trainer.build(tf.data.Dataset.from_tensors(_xy()))
  return trainer, tuple(list(part) for part in trainer.state)


@case("keras-not-a-keras-model", KERAS, "KerasTrainer of a tf.Module",
      TypeError, r"`model` must be a Keras 3 `keras.Model`, got "
      r"tensorflow.*Module")
def _():
  keras_training.KerasTrainer(tf.Module())


@case("keras-uncompiled", KERAS, "KerasTrainer of a model never compiled",
      ValueError, r"the model '.*' is not compiled with an optimizer")
def _():
  keras_training.KerasTrainer(keras.Sequential(
      [keras.Input((2,)), keras.layers.Dense(1)], name="uncompiled"))


@case("keras-x-only-with-loss", KERAS,
      "fit on a dataset of x alone for a model compiled with a loss",
      ValueError, r"KerasTrainer.fit: the batches have no targets `y`, but "
      r"the model was compiled with a loss")
def _():
  keras_training.KerasTrainer(_tiny_model()).fit(
      tf.data.Dataset.from_tensors(_xy()[0]), verbose=0)


@case("keras-string-input", KERAS, "fit on string inputs", ValueError,
      r"x\['text'\] holds strings, which cannot go onto the devices.*"
      r"StringLookup")
def _():
  keras_training.KerasTrainer(_tiny_model()).fit(
      tf.data.Dataset.from_tensors(({"text": tf.constant([["a"]] * 8)},
                                    _xy()[1])), verbose=0)


@case("keras-sample-weight-shape", KERAS,
      "sample weights of shape (batch, 3) for targets of shape (batch, 1)",
      ValueError, r"sample_weight has shape \(8, 3\), which does not fit y of "
      r"shape \(8, 1\)")
def _():
  x, y = _xy()
  keras_training.KerasTrainer(_tiny_model()).fit(
      tf.data.Dataset.from_tensors((x, y, np.ones((8, 3), np.float32))),
      verbose=0)


@case("keras-elements-of-4", KERAS, "fit on elements (x, y, w, extra)",
      ValueError, r"elements must be `x`, `\(x,\)`, `\(x, y\)` or `\(x, y, "
      r"sample_weight\)`; got a tuple of 4")
def _():
  x, y = _xy()
  keras_training.KerasTrainer(_tiny_model()).fit(
      tf.data.Dataset.from_tensors((x, y, y[:, 0], y)), verbose=0)


@case("keras-dataset-and-y", KERAS, "fit on a dataset, with y too",
      ValueError, r"with a tf.data.Dataset, give no `y`")
def _():
  x, y = _xy()
  keras_training.KerasTrainer(_tiny_model()).fit(
      tf.data.Dataset.from_tensors((x, y)), y, verbose=0)


@case("keras-arrays-without-batch-size", KERAS, "fit on arrays, no batch_size",
      ValueError, r"arrays `x` and `y` with the global `batch_size`")
def _():
  _fit(batch_size=None)


@case("keras-arrays-of-different-lengths", KERAS,
      "fit on x of 8 rows and y of 6", ValueError,
      r"the arrays have different numbers of examples \(x: 8, y: 6\)")
def _():
  _fit(y=np.ones((6, 1), np.float32))


@case("keras-x-scalar-tensor", KERAS, "fit on a scalar tensor as x",
      ValueError, r"`x` must be an array \(or a structure of arrays\) with the "
      r"examples along axis 0, or a tf.data.Dataset; got EagerTensor")
def _():
  keras_training.KerasTrainer(_tiny_model()).fit(
      tf.constant(1.), _xy()[1], batch_size=8, verbose=0)


@case("keras-batch-size-zero", KERAS, "fit(batch_size=0)", ValueError,
      r"`batch_size` must be an int >= 1, got 0")
def _():
  _fit(batch_size=0)


@case("keras-epochs-string", KERAS, "fit(epochs='3')", ValueError,
      r"`epochs` must be an int >= 0, got '3'")
def _():
  _fit(epochs="3")


@case("keras-steps-per-epoch-zero", KERAS, "fit(steps_per_epoch=0)",
      ValueError, r"`steps_per_epoch` must be an int >= 1 or None, got 0")
def _():
  _fit(steps_per_epoch=0)


@case("keras-verbose", KERAS, "fit(verbose=3)", ValueError,
      r"`verbose` must be 'auto', 0, 1 or 2, got 3")
def _():
  _fit(verbose=3)


@case("keras-callbacks-not-a-list", KERAS, "fit(callbacks=one_callback)",
      TypeError, r"`callbacks` must be a list of keras.callbacks.Callback, got "
      r"a History")
def _():
  _fit(callbacks=keras.callbacks.History())


@case("keras-callback-not-keras", KERAS, "fit(callbacks=[a function])",
      TypeError, r"callbacks\[0\] is a builtins.function, not a Keras 3")
def _():
  _fit(callbacks=[lambda logs: None])


@case("keras-remainder", KERAS, "fit(remainder='drop')", ValueError,
      r"KerasTrainer.fit: `remainder` must be 'error' or 'pad', got 'drop'")
def _():
  _fit(remainder="drop")


@case("keras-steps-per-epoch-multiple", KERAS,
      "steps_per_epoch not a multiple of steps_per_execution", ValueError,
      r"steps_per_epoch=3 must be a multiple of the model's "
      r"steps_per_execution=2")
def _():
  model = _tiny_model()
  model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
  x, y = _xy()
  keras_training.KerasTrainer(model).fit(x, y, batch_size=8,
                                         steps_per_epoch=3, shuffle=False,
                                         verbose=0)


@case("keras-state-before-build", KERAS, "setting state before any fit",
      ValueError, r"KerasTrainer.state can be set only once the model is "
      r"built")
def _():
  keras_training.KerasTrainer(_tiny_model()).state = ([], [], [], [])


@case("keras-state-dtype", KERAS, "a state value of the wrong dtype",
      TypeError, r"KerasTrainer.state\[0\]\[0\] \('.*kernel'\) must have "
      r"dtype float32, got float64")
def _():
  trainer, state = _built_trainer()
  trainer.state = ([np.zeros((2, 1))] + state[0][1:],) + state[1:]


@case("keras-state-shape", KERAS, "a state value of the wrong shape",
      ValueError, r"KerasTrainer.state\[0\]\[0\] \('.*kernel'\) must have "
      r"shape \(2, 1\), got \(3, 1\)")
def _():
  trainer, state = _built_trainer()
  trainer.state = ([np.zeros((3, 1), np.float32)] + state[0][1:],) + state[1:]


@case("keras-state-structure", KERAS, "a state of 3 parts", ValueError,
      r"KerasTrainer.state: expected 4 lists with \[2, 0, 2, 2\] values.*got "
      r"3 parts")
def _():
  trainer, state = _built_trainer()
  trainer.state = state[:3]


@case("keras-own-step-undivided-batch", KERAS,
      "fit of a model with its own train_step on a batch the devices do "
      "not divide", ValueError,
      r"batch 0 has 12 examples, which does not divide by the 8 devices.*"
      r"CustomStep has its own train_step, which runs on every row it is "
      r"given, so no padding rows can be added")
def _():
  x, y = _xy(12)
  keras_training.KerasTrainer(_model_overriding("train_step")).fit(
      x, y, batch_size=12, remainder="pad", verbose=0)


@case("keras-own-step-stray-variable", KERAS,
      "a model's own train_step assigning a variable the model does not "
      "hold", ValueError,
      r"StrayAssign.train_step assigns variables that are not the model's, "
      r"its optimizer's or its metrics' \(a variable outside the model\)")
def _():
  counter = keras.Variable(0.0, name="counter")

  def train_step(self, data):
    counter.assign_add(1.0)
    return keras.Model.train_step(self, data)

  custom = type("StrayAssign", (keras.Model,), {"train_step": train_step})
  inputs = keras.Input((2,))
  model = custom(inputs, keras.layers.Dense(1)(inputs))
  model.compile(optimizer="sgd", loss="mse")
  keras_training.KerasTrainer(model).fit(*_xy(), batch_size=8, verbose=0)


@case("keras-own-step-own-optimizers", KERAS,
      "a model's own train_step applying an optimizer of its own (a "
      "GAN's)", ValueError,
      r"TwoOptimizers.train_step applies the optimizer self.d_optimizer: on "
      r"several devices only the optimizer given to compile\(optimizer="
      r"\.\.\.\) has its gradients combined")
def _():
  class TwoOptimizers(keras.Model):

    def compile(self, d_optimizer, g_optimizer):
      super().compile(loss="mse")
      self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer

    def train_step(self, data):
      x, y = data
      with tf.GradientTape() as tape:
        loss = tf.reduce_mean((self(x) - y) ** 2)
      grads = tape.gradient(loss, self.trainable_weights)
      self.d_optimizer.apply(grads, self.trainable_weights)
      return {"loss": loss}

  inputs = keras.Input((2,))
  model = TwoOptimizers(inputs, keras.layers.Dense(1)(inputs))
  model.compile(keras.optimizers.Adam(), keras.optimizers.Adam())
  keras_training.KerasTrainer(model).fit(*_xy(), batch_size=8, verbose=0)


@case("keras-validation-data-tuple", KERAS,
      "fit(validation_data=(x,)), a tuple of 1", ValueError,
      r"`validation_data` must be a tuple \(x, y\) or \(x, y, "
      r"sample_weight\) of arrays, or a tf.data.Dataset of global batches; "
      r"got a tuple of 1")
def _():
  _fit(validation_data=(_xy()[0],))


@case("keras-validation-split-range", KERAS, "fit(validation_split=1.5)",
      ValueError, r"`validation_split` must be a float between 0 and 1 .*got "
      r"1.5")
def _():
  _fit(validation_split=1.5)


@case("keras-validation-split-dataset", KERAS,
      "fit(validation_split=...) on a tf.data.Dataset", ValueError,
      r"`validation_split` splits in-memory arrays; with a tf.data.Dataset "
      r"give `validation_data`")
def _():
  keras_training.KerasTrainer(_tiny_model()).fit(
      tf.data.Dataset.from_tensors(_xy()), validation_split=0.5, verbose=0)


@case("keras-validation-split-too-few-rows", KERAS,
      "fit(validation_split=0.95) of 8 rows", ValueError,
      r"validation_split=0.95 of 8 rows leaves no rows to train on")
def _():
  _fit(validation_split=0.95)


@case("keras-validation-freq", KERAS, "fit(validation_freq=0)", ValueError,
      r"`validation_freq` must be an int >= 1 \(validate every that many "
      r"epochs\) or a list of epochs \(counted from 1\), got 0")
def _():
  _fit(validation_data=_xy(), validation_freq=0)


@case("keras-shuffle-dataset", KERAS, "fit(dataset, shuffle=True)",
      ValueError, r"with a tf.data.Dataset, give no `shuffle`.*shuffle its "
      r"rows in the pipeline")
def _():
  keras_training.KerasTrainer(_tiny_model()).fit(
      tf.data.Dataset.from_tensors(_xy()), shuffle=True, verbose=0)


@case("keras-class-weight-type", KERAS, "fit(class_weight=[1.0, 2.0])",
      TypeError, r"`class_weight` must be a dict from class index \(an int "
      r">= 0\) to the weight of that class's rows, got \[1.0, 2.0\]")
def _():
  _fit(class_weight=[1.0, 2.0])


@case("keras-class-weight-and-sample-weight", KERAS,
      "fit(class_weight=..., sample_weight=...)", ValueError,
      r"give `class_weight` or sample weights, not both \(as model.fit\)")
def _():
  _fit(class_weight={0: 2.0}, sample_weight=np.ones(8, np.float32))


@case("keras-class-weight-several-targets", KERAS,
      "fit(class_weight=...) with several targets", ValueError,
      r"`class_weight` weighs the rows by a single target `y`; these batches "
      r"have several")
def _():
  x, y = _xy()
  keras_training.KerasTrainer(_tiny_model()).fit(
      tf.data.Dataset.from_tensors((x, {"a": y, "b": y})),
      class_weight={0: 2.0}, verbose=0)


@case("keras-predict-batch-size", KERAS, "predict(batch_size=0)",
      ValueError, r"KerasTrainer.predict: `batch_size` must be an int >= 1, "
      r"got 0")
def _():
  keras_training.KerasTrainer(_tiny_model()).predict(_xy()[0], batch_size=0)


@case("device-batches-unbatched", KERAS, "device_batches of an unbatched "
      "dataset", ValueError, r"element\[1\] of `dataset` is a scalar .* "
      r"Batch it, e.g. `dataset.batch\(n\)`")
def _():
  x, y = _xy()
  tf_data.device_batches(tf.data.Dataset.from_tensor_slices((x, y[:, 0])))


@case("device-batches-sparse", KERAS, "device_batches of sparse elements",
      ValueError, r"element\[0\] of `dataset` is a sparse tensor .* "
      r"tf.sparse.to_dense")
def _():
  tf_data.device_batches(tf.data.Dataset.from_tensors(
      (tf.sparse.from_dense(np.eye(8)), np.zeros(8))))


@case("device-batches-ragged", KERAS, "device_batches of ragged elements",
      ValueError, r"element\[0\] of `dataset` is a ragged tensor .*"
      r"t.to_tensor\(\)")
def _():
  tf_data.device_batches(tf.data.Dataset.from_tensors(
      (tf.ragged.constant([[1.0], [2.0, 3.0]] * 4), np.zeros(8))))


@case("device-batches-not-divisible", KERAS,
      "a global batch of 4 rows on 8 devices", ValueError,
      r"batch 0 has 4 examples, which does not divide by the 8 devices.*"
      r"remainder='pad'")
def _():
  list(tf_data.device_batches(tf.data.Dataset.from_tensors(np.ones((4, 2)))))


@case("device-batches-pad-needs-x-y", KERAS,
      "remainder='pad' on elements that are not (x, y[, w])", ValueError,
      r"remainder='pad'\) needs elements `\(x, y\)` or `\(x, y, "
      r"sample_weight\)`")
def _():
  tf_data.device_batches(tf.data.Dataset.from_tensors(np.ones((4, 2))),
                         remainder="pad")


# Mistakes whose errors need several real processes, listed in the doc so
# that it is the one place to look; tests/test_multiprocess.py raises each.
PLACEHOLDERS = [
    (PROCESSES, "a process of the cluster never starts",
     "the others' initialize() raises TimeoutError naming it and its address "
     "after initialization_timeout (docs/multiprocess.md, Faults and "
     "timeouts)"),
    (PROCESSES, "a peer process exits or stops answering during a run",
     "the call, or the read of its results, raises "
     "tfspmd.distributed.PeerFailedError naming it (docs/multiprocess.md)"),
    (PROCESSES, "initialize() twice", "RuntimeError: tfspmd.distributed."
     "initialize() was already called in this process (process 1 of 2); call "
     "it once."),
    (PROCESSES, "a plain tensor passed to your tf.function that calls a "
     "pmap, with several processes", "TensorFlow's InvalidArgumentError "
     "\"No OpKernel was registered to support Op 'Relayout'\" when the "
     "tf.function runs: it traces a tensor and a DTensor alike, so tfspmd "
     "cannot tell them apart while tracing, and one device holds only this "
     "process's part. Pass the pmap's result (a ShardedArray) or its "
     "`.dtensor_value` (README, inside your own tf.function); in one process "
     "plain tensors run on one device"),
    (PROCESSES, "DTENSOR_JOBS names several processes but initialize() was "
     "not called", "RuntimeError at the first device query: DTENSOR_JOBS "
     "names 2 processes, but the multi-process runtime was not started: call "
     "tfspmd.distributed.initialize() first thing in every process, before "
     "any TensorFlow op."),
    (PROCESSES, "processes started with different num_processes, or two "
     "with one process_id", "ValueError in every process at once, from the "
     "coordinator exchange: \"process 1 was started with num_processes=3, "
     "the coordinator (process 0) with num_processes=2; give every process "
     "the same num_processes.\" / \"two processes registered as process 1; "
     "give each process its own process_id (0..2).\"; a second process 0 "
     "gets OSError: it cannot listen on the coordinator's port"),
    (PROCESSES, "processes with different numbers of devices (another "
     "TFSPMD_NUM_CPU_DEVICES)", "ValueError from initialize() in every "
     "process: \"the processes have different numbers of CPU devices: "
     "process 0 has 2, process 1 has 1. ...\""),
    (PROCESSES, "processes passing one pmap different mapped sizes, "
     "per-device shapes or dtypes", "ValueError at the call or at the read "
     "of its result: \"The processes disagree on this pmapped call: one "
     "process's call spans 4 devices, another's 2 ...\" (or the shapes, or "
     "the dtypes); the other process may get RuntimeError \"... was "
     "cancelled: a collective of it failed in another process first\". "
     "Restart every process"),
    (PROCESSES, "a process finishes its program without a pmap the others "
     "call", "the others' call raises tfspmd.distributed.PeerFailedError "
     "\"process 1 (...) finished its program while process 0 waited on it "
     "in a collective: it never called this pmap.\" after "
     "initialization_timeout"),
    (PROCESSES, "a shard_map over a mesh whose devices of one process are "
     "not a block of it, or that holds none of a process's", "ValueError: "
     "\"shard_map: the devices of process 0 are not a block of the mesh "
     "Mesh({'p': 2, 'd': 4}): they lie at positions [(0, 0), (0, 1), (0, 2), "
     "(1, 0)]. ... make the mesh over tfspmd.devices() in process order "
     "(tfspmd.make_mesh(shape, names)).\" (docs/multiprocess.md, shard_map "
     "with several processes)"),
    (PROCESSES, "a shard_map spec splitting a dimension over several mesh "
     "axes of which a later one crosses processes", "ValueError: "
     "\"shard_map: in spec PartitionSpec(('d', 'p')) for args[0] splits "
     "dimension 0 over ('d', 'p'), and the later axis 'p' crosses processes; "
     "with several processes only the first axis splitting a dimension may. "
     "Name 'p' first there, or split another dimension over it.\""),
    (PROCESSES, "a shard_map input whose part in this process does not split "
     "into its devices' blocks", "ValueError: \"shard_map: this process's "
     "part of args[0] has size 3 along dimension 0, which the in spec "
     "PartitionSpec('x') splits into the blocks of this process's mesh "
     "positions (4 along 'x'): 3 is not divisible by 4. ...\""),
    (PROCESSES, "nested pmaps whose axes cross processes, where a "
     "process's devices are not a block of the grid of the shape it passes",
     "ValueError: \"pmap: with several processes the nested pmaps' axes 'o' "
     "(2) x 'i' (4) form a grid over tfspmd.devices() in process order "
     "(outer axis slowest), and process 0's devices lie at its positions "
     "[(0, 0), (0, 1)]: they hold [1, 2] positions along the axes, but its "
     "inputs hold [2, 1]. Pass, for each mapped input, arrays of leading "
     "shape (1, 2): ...\" (or: they are not a block of it ... Choose sizes "
     "for which each process's 3 devices are a block ...; "
     "docs/multiprocess.md, Nested pmaps with several processes)"),
    (PROCESSES, "nested pmaps whose inputs hold more positions than the "
     "process has devices, or a crossing axis's sizes that do not fit",
     "ValueError: \"compiling computation that requires 12 replicas ... "
     "With several processes each process passes, for each mapped input, "
     "the block of the global array its own devices hold: this process's "
     "inputs hold 6 positions of the nested pmaps' grid, but it has 3 "
     "devices. Pass the positions of its devices only, and give a nested "
     "pmap whose axis crosses processes its global size as axis_size= "
     "...\""),
    (PROCESSES, "processes calling pmaps in different orders, or giving "
     "devices= different lists", "not detected: matching collectives give "
     "wrong values, others raise the errors above (docs/multiprocess.md, "
     "Mistakes)"),
]

# --- the tests ----------------------------------------------------------------------

_raised = {}


def raised(entry):
  """The exception `entry` raises (run once per process), or None."""
  if entry.id not in _raised:
    try:
      entry.trigger()
      _raised[entry.id] = None
    except Exception as e:  # pylint: disable=broad-except
      _raised[entry.id] = e
  return _raised[entry.id]


def message(error):
  """The message as docs/errors.md shows it: no addresses, paths or lines.

  A checkpoint in a fresh temporary directory shows as one in /tmp/run, its
  files' unique names as `<32 hex digits>`.
  """
  text = str(error)
  # Paths first: a temporary directory's random name may hold "0x5".
  text = re.sub(re.escape(os.path.join(tempfile.gettempdir(), "tmp")) +
                r"[\w-]+", "/tmp/run", text)
  text = re.sub(r"0x[0-9a-f]+", "0x...", text)
  text = re.sub(r"\.tfspmd-[0-9a-f]{32}", ".tfspmd-<32 hex digits>", text)
  return re.sub(r"\S*(tests/test_errors\.py):\d+", r"\1:LINE", text)


def test_catalogue_has_at_least_40_kinds_with_distinct_ids():
  assert len(CATALOGUE) >= 40
  assert len({entry.id for entry in CATALOGUE}) == len(CATALOGUE)


@pytest.mark.parametrize("entry", CATALOGUE, ids=lambda entry: entry.id)
def test_bad_input_raises_a_specific_error(entry):
  error = raised(entry)
  assert error is not None, f"{entry.what}: nothing was raised"
  assert type(error) is entry.error, (  # pylint: disable=unidiomatic-typecheck
      f"{entry.what}: raised {type(error).__name__}: {error}")
  assert re.search(entry.match, message(error), re.S), message(error)
  # Raised inside a traced function, TensorFlow would wrap it with its trace.
  assert "in user code" not in message(error), message(error)


def render_doc():
  """docs/errors.md, from the catalogue and the messages raised now."""
  lines = [
      "# Errors: what each mistake raises",
      "",
      "Every kind of bad input tfspmd knows raises one specific exception "
      "whose message names",
      "the argument (its pytree path, such as `args[0]['w']` or "
      "`kwargs['x']`), what was",
      "expected and what was given; a mistake the call can go on from gives "
      "a warning instead,",
      "marked as one. This page is written from the catalogue in",
      "`tests/test_errors.py`, with the message each case raises, and a "
      "test keeps it equal",
      "to what the code raises (rewrite it with",
      "`TFSPMD_WRITE_ERRORS_DOC=1 .venv/bin/python -m pytest -q "
      "tests/test_errors.py`).",
      "",
      f"{len(CATALOGUE)} kinds of bad input.",
  ]
  groups = {}
  for entry in CATALOGUE:
    groups.setdefault(entry.group, []).append(entry)
  for group, entries in groups.items():
    lines += ["", f"## {group}", "", "| what you did | raises | message |",
              "| --- | --- | --- |"]
    for entry in entries:
      error = raised(entry)
      text = message(error) if error is not None else "(nothing raised)"
      kind = f"`{entry.error.__name__}`"
      if issubclass(entry.error, Warning):
        kind += " (a warning: the call goes on)"
      lines.append(f"| {_cell(entry.what)} | {kind} | {_cell(text)} |")
  lines += ["", "## Elsewhere", "", "| what you did | where |", "| --- | --- |"]
  for group, what, where in PLACEHOLDERS:
    lines.append(f"| {_cell(what)} ({group}) | {_cell(where)} |")
  return "\n".join(lines) + "\n"


def _cell(text):
  """`text` in a Markdown table cell: `<lambda>` is not a tag, `|` no column."""
  for raw, escaped in (("&", "&amp;"), ("<", "&lt;"), (">", "&gt;"),
                       ("|", "\\|")):
    text = text.replace(raw, escaped)
  return text.replace("\n", "<br>")


def test_docs_list_every_case():
  expected = render_doc()
  if os.environ.get("TFSPMD_WRITE_ERRORS_DOC"):
    with open(DOC_PATH, "w", encoding="utf-8") as f:
      f.write(expected)
  with open(DOC_PATH, encoding="utf-8") as f:
    assert f.read() == expected, (
        "docs/errors.md differs from the catalogue; rewrite it with "
        "TFSPMD_WRITE_ERRORS_DOC=1 .venv/bin/python -m pytest -q "
        "tests/test_errors.py")
