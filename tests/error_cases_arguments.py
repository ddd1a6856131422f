"""Mistakes in a pmap's arguments: sizes, in_axes and out_axes, static and donated
arguments, argument leaves, outputs.

Rows of the error catalogue (`error_catalogue`); tests/test_errors.py runs them.
"""

import collections
import fractions

import numpy as np
import tensorflow as tf

import tfspmd
from tfspmd import lax

from error_catalogue import case, P, SIZES, AXES, STATIC, LEAVES, OUTPUTS


@case("mismatched-sizes", SIZES,
      "mapped arguments disagree on the mapped size", ValueError,
      r"inconsistent sizes.*\n  args\[0\] of shape \(4, 2\) mapped along axis 0 "
      r"has size 4\n  args\[1\]\['w'\] of shape \(3, 2\) mapped along axis 0 "
      r"has size 3")
def mismatched_sizes():
  P(lambda a, b: a)(np.zeros((4, 2)), {"w": np.zeros((3, 2))})


@case("too-many-replicas", SIZES, "a mapped size above the device count",
      ValueError, r"requires 9 replicas, but only 8 devices are available")
def too_many_replicas():
  P(lambda x: x)(np.zeros(9))


@case("too-many-replicas-nested", SIZES,
      "nested pmaps whose product exceeds the device count", ValueError,
      r"requires 12 replicas \(4 x 3 nested pmaps\), but only 8 devices")
def too_many_replicas_nested():
  P(P(lambda x: x, axis_name="c"), axis_name="r")(np.zeros((4, 3)))


@case("zero-size", SIZES, "a mapped axis of size 0", ValueError,
      r"maps axis 0 of args\[0\], of shape \(0, 3\), which has size 0.*size >= 1")
def zero_size():
  P(lambda x: x)(np.zeros((0, 3)))


@case("nested-sizes-disagree", SIZES,
      "two nested pmaps at the same depth with different sizes", ValueError,
      r"axis 'd' has size 4, another pmap at that depth has size 2")
def nested_sizes_disagree():
  P(lambda x, y: (P(lambda a: a, "c")(x), P(lambda a: a, "d")(y)), "r")(
      np.zeros((2, 2)), np.zeros((2, 4)))


@case("axis-size-negative", SIZES, "axis_size=-1", ValueError,
      r"`axis_size` must be a positive int or None, got -1")
def axis_size_negative():
  P(lambda x: x, axis_size=-1)


@case("no-mapped-argument", SIZES,
      "nothing mapped (every in_axes None) and no axis_size", ValueError,
      r"no mapped argument to take the axis size from.*pass axis_size=")
def no_mapped_argument():
  P(lambda x: x, in_axes=None)(np.zeros(2))


@case("axis-size-disagrees", SIZES,
      "axis_size different from the mapped arguments' size", ValueError,
      r"axis_size=3, but its mapped arguments have size 2")
def axis_size_disagrees():
  P(lambda x: x, axis_size=3)(np.zeros(2))

# --- in_axes and out_axes ----------------------------------------------------


@case("in-axes-out-of-range", AXES, "in_axes=2 for a rank-2 argument",
      ValueError, r"in_axes maps axis 2 of argument args\[0\], which has rank 2: "
      r"the axis must be in \[-2, 2\)")
def in_axes_out_of_range():
  P(lambda x: x, in_axes=2)(np.zeros((2, 2)))


@case("in-axes-negative-out-of-range", AXES,
      "in_axes=-3 for a rank-2 argument", ValueError,
      r"in_axes maps axis -3 of argument args\[0\], which has rank 2: the axis "
      r"must be in \[-2, 2\)")
def in_axes_negative_out_of_range():
  P(lambda x: x, in_axes=-3)(np.zeros((2, 2)))


@case("mapping-a-scalar", AXES, "a scalar argument mapped over axis 0",
      ValueError, r"in_axes maps axis 0 of argument args\[1\], but it is a "
      r"scalar \(rank 0\).*in_axes=None")
def mapping_a_scalar():
  P(lambda a, b: a + b)(np.zeros(2), 3.0)


@case("mapping-a-scalar-keyword", AXES,
      "a scalar keyword argument (keyword arguments are mapped over axis 0)",
      ValueError, r"axis 0 of argument kwargs\['x'\], but it is a scalar")
def mapping_a_scalar_keyword():
  P(lambda x: x)(x=3.0)


@case("out-axes-out-of-range", AXES, "out_axes=3 for a rank-2 result",
      ValueError, r"out_axes puts the mapped axis at 3 of output\[1\], whose "
      r"result has rank 2 .*\[-2, 2\)")
def out_axes_out_of_range():
  P(lambda x: (x, x), out_axes=(0, 3))(np.zeros((2, 2)))


@case("out-axes-negative-out-of-range", AXES,
      "out_axes=-3 for a rank-2 result", ValueError,
      r"out_axes puts the mapped axis at -3 of output, whose result has rank 2")
def out_axes_negative_out_of_range():
  P(lambda x: x, out_axes=-3)(np.zeros((2, 2)))


@case("in-axes-length", AXES,
      "in_axes with fewer entries than positional arguments", ValueError,
      r"in_axes has 1 entries, but the function was called with 2 positional")
def in_axes_length():
  P(lambda a, b: a, in_axes=(0,))(np.zeros(2), np.zeros(2))


@case("in-axes-dict-keys", AXES, "an in_axes dict with other keys",
      ValueError, r"in_axes specification at args\[0\] has keys \['a'\], but "
      r"the value there has keys \['b'\]")
def in_axes_dict_keys():
  P(lambda a: a, in_axes=({"a": 0},))({"b": np.zeros(2)})


@case("in-axes-not-a-prefix", AXES,
      "an in_axes container where the argument is a leaf", ValueError,
      r"in_axes specification must be a tree prefix .* got specification "
      r"\(0, 0\) for value tree \* at args\[0\]")
def in_axes_not_a_prefix():
  P(lambda a: a, in_axes=((0, 0),))(np.zeros(2))


@case("out-axes-wrong-tree", AXES,
      "out_axes with more entries than the outputs", ValueError,
      r"out_axes specification at output has 3 entries, but the value there "
      r"has 2")
def out_axes_wrong_tree():
  P(lambda a: (a, a), out_axes=(0, 0, 0))(np.zeros(2))


@case("in-axes-bool", AXES, "in_axes=True", TypeError,
      r"in_axes must be an int, None, or a container of those; got the bool "
      r"True")
def in_axes_bool():
  P(lambda a: a, in_axes=True)


@case("out-axes-bool", AXES, "out_axes=False", TypeError,
      r"out_axes must be an int, None, or a container of those; got the bool "
      r"False")
def out_axes_bool():
  P(lambda a: a, out_axes=False)


@case("in-axes-string", AXES, "in_axes='0'", TypeError,
      r"in_axes must be an int, None, or a \(nested\) tuple/list/dict of "
      r"those; got str '0'")
def in_axes_string():
  P(lambda a: a, in_axes="0")


@case("in-axes-float", AXES, "in_axes=(1.5,)", TypeError,
      r"in_axes must be an int, None, .* got float 1.5")
def in_axes_float():
  P(lambda a: a, in_axes=(1.5,))


@case("out-axes-set", AXES, "out_axes={0}", TypeError,
      r"out_axes must be an int, None, .* got set \{0\}")
def out_axes_set():
  P(lambda a: a, out_axes={0})


@case("out-axes-none-varying", AXES,
      "out_axes=None for an output that differs between devices", ValueError,
      r"out_axes=None for output\[1\], but that output varies across the "
      r"devices of axis 'i'.*Give it an integer out_axes")
def out_axes_none_varying():
  P(lambda x: (lax.psum(x, "i"), x), "i", out_axes=None)(np.zeros(2))

# --- static and donated arguments ---------------------------------------------


@case("unhashable-static", STATIC, "a list as a static argument",
      ValueError, r"static argument args\[1\] of the pmapped function is not "
      r"hashable: list \[1, 2\]")
def unhashable_static():
  P(lambda x, n: x, static_broadcasted_argnums=1)(np.zeros(2), [1, 2])


@case("missing-static", STATIC, "a static argument left out of the call",
      ValueError, r"static_broadcasted_argnums=\(1,\), but was called with "
      r"only 1 positional argument")
def missing_static():
  P(lambda x, n=2: x, static_broadcasted_argnums=1)(np.zeros(2))


@case("static-and-donated", STATIC,
      "one argument both static and donated", ValueError,
      r"arguments \[0\] are both static .* and donated")
def static_and_donated():
  P(lambda x: x, static_broadcasted_argnums=0, donate_argnums=0)


@case("static-argnums-type", STATIC, "static_broadcasted_argnums='0'",
      TypeError, r"static_broadcasted_argnums must be an int or a collection "
      r"of ints, got '0'")
def static_argnums_type():
  P(lambda x: x, static_broadcasted_argnums="0")


@case("donate-argnums-type", STATIC, "donate_argnums=[0.5]", TypeError,
      r"donate_argnums must be an int or a collection of ints, got \[0.5\]")
def donate_argnums_type():
  P(lambda x: x, donate_argnums=[0.5])


@case("donate-out-of-range", STATIC,
      "donate_argnums naming an argument the call does not pass", ValueError,
      r"donate_argnums=\(3,\), but was called with only 1 positional "
      r"argument.*argument 3 cannot be donated")
def donate_out_of_range():
  P(lambda x: x, donate_argnums=3)(np.zeros(2))


@case("donated-used-again", STATIC,
      "a donated ShardedArray used after the call", RuntimeError,
      r"argument args\[0\] is a ShardedArray that was donated to an earlier "
      r"call \(donate_argnums\), which deleted it")
def donated_used_again():
  x = P(lambda v: v)(np.zeros(2))
  P(lambda v: v + 1, donate_argnums=(0,))(x)
  P(lambda v: v)(x)

# --- argument leaves -----------------------------------------------------------


@case("function-leaf", LEAVES, "a function inside an argument", TypeError,
      r"argument args\[0\]\['f'\] is a builtin_function_or_method \(<built-in "
      r"function print>\), not an array.*static_broadcasted_argnums")
def function_leaf():
  P(lambda d: d)({"f": print, "x": np.zeros(2)})


@case("str-leaf", LEAVES, "a Python str as an argument", TypeError,
      r"argument args\[0\] is a str \('ab'\), not an array")
def str_leaf():
  P(lambda x: x)("ab")


@case("fraction-leaf", LEAVES, "a fractions.Fraction as an argument",
      TypeError, r"argument args\[1\] is a Fraction \(Fraction\(1, 3\)\), not an "
      r"array.*Python bool, int, float or complex")
def fraction_leaf():
  P(lambda x, y: x, in_axes=(0, None))(np.zeros(2), fractions.Fraction(1, 3))


@case("ragged-leaf", LEAVES, "a tf.RaggedTensor as an argument", TypeError,
      r"argument args\[0\] is a RaggedTensor .*, not an array")
def ragged_leaf():
  P(lambda x: x)(tf.ragged.constant([[1], [2, 3]]))


@case("string-tensor", LEAVES, "a tf.string tensor", TypeError,
      r"argument args\[0\] has dtype string, which cannot be split over "
      r"devices; only numeric and bool arrays can")
def string_tensor():
  P(lambda s: s)(tf.constant(["a", "b"]))


@case("numpy-str-array", LEAVES, "a NumPy array of str", TypeError,
      r"argument args\[0\]\.text has dtype str, which cannot be split")
def numpy_str_array():
  Batch = collections.namedtuple("Batch", ["x", "text"])
  P(lambda b: b.x)(Batch(np.zeros(2), np.array(["a", "b"])))


@case("numpy-object-array", LEAVES, "a NumPy array of Python objects",
      TypeError, r"argument args\[0\] has dtype object, which cannot be split")
def numpy_object_array():
  P(lambda x: x)(np.array([None, 1], dtype=object))


@case("numpy-datetime-array", LEAVES, "a NumPy datetime64 array", TypeError,
      r"argument kwargs\['t'\] has dtype datetime64, which cannot be split")
def numpy_datetime_array():
  P(lambda t: t)(t=np.array(["2020-01-01", "2020-01-02"], dtype="datetime64[D]"))


@case("quantized-tensor", LEAVES, "a quantized (tf.qint8) tensor", TypeError,
      r"argument args\[0\] has dtype qint8, which cannot be split")
def quantized_tensor():
  P(lambda x: x)(tf.constant([1, 2], tf.qint8))


@case("int-overflow", LEAVES, "a Python int too large for int32",
      OverflowError, r"argument args\[1\] is the Python int 1099511627776, "
      r"which does not fit int32.*np.int64")
def int_overflow():
  P(lambda x, n: x, in_axes=(0, None))(np.zeros(2), 2 ** 40)


@case("unsortable-dict-keys", LEAVES, "a dict whose keys cannot be sorted",
      TypeError, r"dict at \[0\]\[0\] has keys that cannot be sorted "
      r"\(\[1, 'a'\]\)")
def unsortable_dict_keys():
  P(lambda d: d)({1: np.zeros(2), "a": np.zeros(2)})


@case("sharded-array-into-nested", LEAVES,
      "a ShardedArray from outside passed to a nested pmap", TypeError,
      r"nested pmap argument args\[0\] is a ShardedArray from outside the "
      r"enclosing pmap")
def sharded_array_into_nested():
  outside = P(lambda v: v)(np.zeros((2, 2)))
  P(lambda x: P(lambda a: a)(outside), "r")(np.zeros(2))

# --- outputs ---------------------------------------------------------------------


@case("output-not-a-tensor", OUTPUTS, "an object() returned", TypeError,
      r"returned a object at output\[1\], which is not convertible to a tensor")
def output_not_a_tensor():
  P(lambda x: (x, object()))(np.zeros(2))


@case("output-a-string", OUTPUTS, "a Python str returned", TypeError,
      r"the pmapped function returned the string 'label' at output\['name'\]; "
      r"outputs must be numbers or bools")
def output_a_string():
  P(lambda x: {"value": x, "name": "label"})(np.zeros(2))


@case("output-unknown-rank", OUTPUTS,
      "an output of unknown rank (tf.numpy_function)", ValueError,
      r"returned output of unknown rank .* tf.ensure_shape")
def output_unknown_rank():
  P(lambda x: tf.numpy_function(lambda a: a, [x], tf.float64))(np.zeros(2))


@case("step-not-a-pair", OUTPUTS,
      "a steps= function returning one value, not (carry, y)", TypeError,
      r"steps=2: the step function must return a pair \(carry, output\)")
def step_not_a_pair():
  P(lambda c, x: c, steps=2)(np.zeros(2), np.zeros((2, 2)))


@case("carry-changes-shape", OUTPUTS,
      "a steps= function whose carry changes shape", TypeError,
      r"carry leaf args\[0\] with per-device shape \[2\] and dtype float64, "
      r"but was given shape \[\] ")
def carry_changes_shape():
  P(lambda c, x: (c + x, c), steps=2)(np.zeros(2), np.zeros((2, 2, 2)))


@case("output-data-dependent-size", OUTPUTS,
      "an output whose size depends on the data (tf.unique)", ValueError,
      r"returned output of shape \(2, None\) \(with the mapped axis\), whose "
      r"size depends on the data .* pad it to its largest size")
def output_data_dependent_size():
  P(lambda x, w: tf.unique(w)[0] + x[0], in_axes=(0, None))(
      np.zeros((2, 3)), np.array([1., 1., 2.]))


@case("data-dependent-shape-inside", OUTPUTS,
      "tf.boolean_mask with the same mask on every device, then a sum",
      ValueError, r"makes a tensor whose size depends on the data: the op "
      r"Where \(boolean_mask/Where\) gives shape \(None, 1\).*keep the full "
      r"size and mask instead")
def data_dependent_shape_inside():
  P(lambda x, m: tf.reduce_sum(tf.boolean_mask(x, m)), in_axes=(0, None))(
      np.ones((2, 3)), np.array([True, False, True]))


@case("sharded-array-captured", OUTPUTS,
      "a ShardedArray captured by closure inside the mapped function",
      TypeError, r"A ShardedArray \(shape \[2\], float64\) is used while a "
      r"function is traced .* pass it to the pmap \(in_axes=None")
def sharded_array_captured():
  earlier = P(lambda x: x)(np.zeros(2))
  P(lambda x: x + earlier)(np.zeros(2))


@case("tf-function-variable-on-every-device", OUTPUTS,
      "a tf.function given ShardedArrays updates a tf.Variable (DTensor's "
      "executor, which runs it on every device; on the host executor it "
      "runs once)",
      ValueError, r"the tf.function '<lambda>' was given ShardedArrays \(or "
      r"DTensors\) and runs on every device of their mesh, so its update of "
      r"'calls:0' would happen once per device. Compute the new values")
def tf_function_variable_on_every_device():
  before = tfspmd.config.tfspmd_executor
  tfspmd.config.update("tfspmd_executor", "dtensor")
  try:
    calls = tf.Variable(0, name="calls")
    counted = tf.function(lambda a: calls.assign_add(1) + tf.size(a))
    counted(P(lambda x: x)(np.zeros((8, 2))))
  finally:
    tfspmd.config.update("tfspmd_executor", before)


@case("tf-function-two-meshes", OUTPUTS,
      "ShardedArrays on a 4-device and an 8-device mesh into one tf.function "
      "(DTensor's executor; on the host executor the function takes both "
      "whole)",
      ValueError, r"a tf.function was called with ShardedArrays on different "
      r"meshes: one of shape \[4, 2\] on Mesh\(\{'axis_0': 4\}\) \(devices "
      r"\[0, 1, 2, 3\]\), another of shape \[8, 2\] .* "
      r"`tfspmd.device_put\(b, a.sharding\)`")
def tf_function_two_meshes():
  before = tfspmd.config.tfspmd_executor
  tfspmd.config.update("tfspmd_executor", "dtensor")
  try:
    four = P(lambda x: x, devices=tfspmd.devices()[:4])(np.zeros((4, 2)))
    eight = P(lambda x: x)(np.zeros((8, 2)))
    tf.function(lambda a, b: a + b)(four, eight)
  finally:
    tfspmd.config.update("tfspmd_executor", before)
