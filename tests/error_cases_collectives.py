"""Mistakes in collectives' arguments and in the ops of the mapped function.

Rows of the error catalogue (`error_catalogue`); tests/test_errors.py runs them.
"""

import numpy as np
import tensorflow as tf

import tfspmd
from tfspmd import lax

from error_catalogue import case, P, COLLECTIVES, OPS


@case("psum-string", COLLECTIVES, "psum of strings", TypeError,
      r"psum: x\[1\] has dtype string, but psum takes numbers .*tf.cast")
def psum_string():
  P(lambda x: lax.psum((x, tf.strings.as_string(x)), "i"), "i")(np.zeros(2))


@case("pmax-complex", COLLECTIVES, "pmax of complex numbers", TypeError,
      r"pmax: x has dtype complex64, but pmax takes real numbers")
def pmax_complex():
  P(lambda x: lax.pmax(x, "i"), "i")(np.zeros(2, np.complex64))


@case("collective-of-non-array", COLLECTIVES, "psum of an object()",
      TypeError, r"psum: x\['b'\] is of type object, which is not convertible "
      r"to a tensor")
def collective_of_non_array():
  P(lambda x: lax.psum({"a": x, "b": object()}, "i"), "i")(np.zeros(2))


@case("all-gather-axis-out-of-range", COLLECTIVES,
      "all_gather with axis=3 for a rank-1 value", ValueError,
      r"all_gather: `axis`=3 is out of range for the gathered result of rank 2 "
      r"\(a per-device value of rank 1 and the new axis\); it must be in "
      r"\[-2, 2\)")
def all_gather_axis_out_of_range():
  P(lambda v: lax.all_gather(v, "i", axis=3), "i")(np.zeros((2, 2)))


@case("all-gather-axis-float", COLLECTIVES, "all_gather with axis=1.5",
      TypeError, r"all_gather: `axis` must be an int, got float 1.5")
def all_gather_axis_float():
  P(lambda v: lax.all_gather(v, "i", axis=1.5), "i")(np.zeros(2))


@case("all-gather-tiled-scalar", COLLECTIVES,
      "all_gather(tiled=True) of a scalar", ValueError,
      r"all_gather: tiled=True .* needs a per-device value of rank >= 1, but got "
      r"a scalar")
def all_gather_tiled_scalar():
  P(lambda v: lax.all_gather(v, "i", tiled=True), "i")(np.zeros(2))


@case("psum-scatter-size", COLLECTIVES,
      "psum_scatter over a dimension whose size is not the axis size",
      ValueError, r"psum_scatter: the dimension `scatter_dimension` has size 3, "
      r"but must equal the axis size 2")
def psum_scatter_size():
  P(lambda v: lax.psum_scatter(v, "i"), "i")(np.zeros((2, 3)))


@case("psum-scatter-tiled-divisible", COLLECTIVES,
      "psum_scatter(tiled=True) of a dimension the axis size does not divide",
      ValueError, r"psum_scatter: with tiled=True the dimension "
      r"`scatter_dimension` \(size 3\) must divide evenly by the axis size 2")
def psum_scatter_tiled_divisible():
  P(lambda v: lax.psum_scatter(v, "i", tiled=True), "i")(np.zeros((2, 3)))


@case("ppermute-not-pairs", COLLECTIVES, "ppermute with perm=[0, 1]",
      TypeError, r"ppermute: `perm` must be a sequence of \(source, "
      r"destination\) pairs, got \[0, 1\]")
def ppermute_not_pairs():
  P(lambda v: lax.ppermute(v, "i", [0, 1]), "i")(np.zeros(2))


@case("ppermute-negative-index", COLLECTIVES,
      "ppermute with a negative device index", ValueError,
      r"ppermute: `perm` entry \(-1, 0\) is out of range for an axis of size 2; "
      r"indices must be in \[0, 2\)")
def ppermute_negative_index():
  P(lambda v: lax.ppermute(v, "i", [(-1, 0)]), "i")(np.zeros(2))


@case("ppermute-repeated-source", COLLECTIVES,
      "ppermute sending from one device twice", ValueError,
      r"ppermute: `perm` is not a permutation: a source appears more than once")
def ppermute_repeated_source():
  P(lambda v: lax.ppermute(v, "i", [(0, 1), (0, 0)]), "i")(np.zeros(2))


@case("pshuffle-not-a-permutation", COLLECTIVES,
      "pshuffle with perm=[0, 0]", ValueError,
      r"pshuffle: `perm` must be a permutation of range\(2\), got \[0, 0\]")
def pshuffle_not_a_permutation():
  P(lambda v: lax.pshuffle(v, "i", [0, 0]), "i")(np.zeros(2))


@case("all-to-all-size", COLLECTIVES,
      "all_to_all splitting a dimension whose size is not the axis size",
      ValueError, r"all_to_all: the dimension `split_axis` has size 3, but must "
      r"equal the axis size 2")
def all_to_all_size():
  P(lambda v: lax.all_to_all(v, "i", 0, 0), "i")(np.zeros((2, 3)))


@case("pswapaxes-axis-out-of-range", COLLECTIVES,
      "pswapaxes with axis=5 for a rank-1 value", ValueError,
      r"pswapaxes: `axis`=5 is out of range for a per-device value of rank 1")
def pswapaxes_axis_out_of_range():
  P(lambda v: lax.pswapaxes(v, "i", 5), "i")(np.zeros((2, 2)))


@case("axis-index-groups-not-lists", COLLECTIVES,
      "psum with axis_index_groups=[0, 1] (not a list of lists)", TypeError,
      r"psum: axis_index_groups must be a list of lists of ints .*, got "
      r"\[0, 1\]")
def axis_index_groups_not_lists():
  P(lambda v: lax.psum(v, "i", axis_index_groups=[0, 1]), "i")(np.zeros(2))


@case("axis-index-groups-not-ints", COLLECTIVES,
      "all_gather with axis_index_groups holding a float", TypeError,
      r"all_gather: axis_index_groups must be a list of lists of ints")
def axis_index_groups_not_ints():
  P(lambda v: lax.all_gather(v, "i", axis_index_groups=[[0.0, 1]]), "i")(
      np.zeros(2))


@case("axis-index-groups-empty", COLLECTIVES,
      "pmean with axis_index_groups=[]", ValueError,
      r"pmean: axis_index_groups must hold at least one group, each of at "
      r"least one index, got \[\]")
def axis_index_groups_empty():
  P(lambda v: lax.pmean(v, "i", axis_index_groups=[]), "i")(np.zeros(2))


@case("axis-index-groups-out-of-range", COLLECTIVES,
      "psum with axis_index_groups naming index 5 on an axis of size 4",
      ValueError,
      r"psum: axis_index_groups has index 5, out of range for the axis 'i' of "
      r"size 4; indices must be in \[0, 4\)")
def axis_index_groups_out_of_range():
  P(lambda v: lax.psum(v, "i", axis_index_groups=[[0, 1], [2, 5]]), "i")(
      np.zeros(4))


@case("axis-index-groups-not-a-partition", COLLECTIVES,
      "pmax with axis_index_groups that repeat an index and leave one out",
      ValueError,
      r"pmax: axis_index_groups must cover all indices exactly once: every "
      r"index of the axis 'i' of size 4 in exactly one group, but got "
      r"\[\[0, 1\], \[1, 3\]\]")
def axis_index_groups_not_a_partition():
  P(lambda v: lax.pmax(v, "i", axis_index_groups=[[0, 1], [1, 3]]), "i")(
      np.zeros(4))


@case("axis-index-groups-unequal", COLLECTIVES,
      "psum_scatter with axis_index_groups of sizes 3 and 1", ValueError,
      r"psum_scatter: axis_index_groups must all be the same size, but got "
      r"groups of sizes \[1, 3\]")
def axis_index_groups_unequal():
  P(lambda v: lax.psum_scatter(v, "i", axis_index_groups=[[0, 1, 2], [3]]),
    "i")(np.zeros((4, 2)))


@case("axis-index-groups-tuple-of-axes", COLLECTIVES,
      "all_to_all over ('i', 'j') with axis_index_groups of the inner axis "
      "only", ValueError,
      r"all_to_all: axis_index_groups must cover all indices exactly once: "
      r"every index of the axes \('i', 'j'\) of size 4 \(their linear index, "
      r"the first name major\)")
def axis_index_groups_tuple_of_axes():
  P(P(lambda v: lax.all_to_all(v, ("i", "j"), 0, 0,
                               axis_index_groups=[[0], [1]]), "j"), "i")(
                                   np.zeros((2, 2, 1)))


@case("axis-index-groups-split-size", COLLECTIVES,
      "all_to_all with axis_index_groups, splitting a dimension whose size is "
      "the axis size, not the group size", ValueError,
      r"all_to_all: the dimension `split_axis` has size 4, but must equal the "
      r"size of each axis_index_groups group 2")
def axis_index_groups_split_size():
  P(lambda v: lax.all_to_all(v, "i", 0, 0, axis_index_groups=[[0, 1], [2, 3]]),
    "i")(np.zeros((4, 4)))

# --- ops inside the mapped function -------------------------------------------------


@case("per-device-size", OPS,
      "an op whose result size depends on per-device data (tf.unique)",
      ValueError,
      r"the op Unique \(Unique\) gets inputs that differ between devices and "
      r"gives a result of shape \(None,\), whose size depends on those inputs")
def per_device_size():
  P(lambda x: tf.unique(x)[0])(np.zeros((2, 3)))


@case("strided-slice-offset-step", OPS,
      "a strided slice with a step, at an offset that differs between "
      "devices", ValueError,
      r"starts at an offset that differs between devices, and tfspmd maps "
      r"such a slice only with steps of 1")
def strided_slice_offset_step():
  P(lambda x: x[lax.axis_index("i") % 2::2], "i")(np.zeros((2, 6)))


@case("slice-offset-unknown-size", OPS,
      "tf.slice to the end (-1) from an offset that differs between devices",
      ValueError,
      r"starts at an offset that differs between devices and has the size "
      r"\(None,\), not known when tracing")
def slice_offset_unknown_size():
  P(lambda x: tf.slice(x, tf.reshape(lax.axis_index("i"), [1]), [-1]),
    "i")(np.zeros((2, 6)))


@case("variable-assign", OPS, "assigning to a tf.Variable inside",
      ValueError, r"writes to a tf.Variable \(AssignAddVariableOp\).*Pass the "
      r"state as an argument and return its new value")
def variable_assign():
  v = tf.Variable(0., dtype=tf.float64)
  P(lambda x: v.assign_add(tf.reduce_sum(x)))(np.zeros(2))


@case("variable-created", OPS, "tf.Variable(...) created inside",
      ValueError, r"creates a tf.Variable \(scale\); a mapped function cannot "
      r"create variables. Create it outside the mapped function and pass its "
      r"value in as an argument")
def variable_created():
  P(lambda x: x * tf.Variable(2., name="scale"))(np.zeros(2, np.float32))


@case("python-if-on-a-tensor", OPS, "a Python `if` on a per-device value",
      TypeError, r"uses a tensor as a Python bool \(an `if`.*use tf.cond or "
      r"tf.where to choose between values")
def python_if_on_a_tensor():
  def f(x):
    if tf.reduce_sum(x) > 0:
      return x
    return -x
  P(f)(np.zeros((2, 3)))


@case("python-for-over-a-tensor", OPS, "a Python `for` over a per-device "
      "tensor", TypeError, r"iterates over a tensor with a Python for loop.*"
      r"tf.map_fn or tf.scan")
def python_for_over_a_tensor():
  P(lambda x: sum(row for row in x))(np.zeros((2, 3)))


@case("stateful-random", OPS, "tf.random.uniform inside", ValueError,
      r"uses the op RandomUniform, a stateful random op .*Use the stateless "
      r"random ops")
def stateful_random():
  P(lambda x: x + tf.random.uniform([3]), "i")(np.zeros((2, 3), np.float32))


@case("random-generator", OPS, "a tf.random.Generator drawn inside",
      ValueError,
      r"draws from a tf.random.Generator \(RngReadAndSkip\).*"
      r"generator.make_seeds\(n\)")
def random_generator():
  generator = tf.random.Generator.from_seed(5)
  P(lambda x: x + generator.normal([3]), "i")(np.zeros((2, 3), np.float32))


@case("collective-in-diverging-cond", OPS,
      "a psum in a tf.cond whose predicate differs between devices",
      ValueError,
      r"psum inside tf.cond whose predicate differs between the devices of "
      r"the mapped axis: .* would not all reach the psum.*pmax or psum")
def collective_in_diverging_cond():
  P(lambda x: tf.cond(tf.reduce_sum(x) > 0, lambda: lax.psum(x, "i"),
                      lambda: x), "i")(np.zeros((2, 3), np.float32))


@case("collective-in-diverging-loop", OPS,
      "a pmean in a tf.while_loop whose condition differs between devices",
      ValueError,
      r"pmean inside tf.while_loop whose condition differs between the "
      r"devices")
def collective_in_diverging_loop():
  P(lambda x: tf.while_loop(lambda k, v: k < lax.axis_index("i"),
                            lambda k, v: (k + 1, lax.pmean(v, "i")),
                            (0, x))[1], "i")(np.zeros((2, 3), np.float32))


@case("print-in-loop", OPS,
      "a tf.print or tf.debugging assertion inside a tf.while_loop",
      ValueError,
      r"tf.print or a tf.debugging assertion inside a tf.while_loop in the "
      r"function mapped over axis 'i'.*Move the print or assertion out of "
      r"the loop.*debug=True")
def print_in_loop():
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
def print_with_steps():
  def step(c, x):
    tf.debugging.assert_less(x, 1.0)
    return c, x
  P(step, steps=2)(np.zeros(2, np.float32), np.zeros((2, 2), np.float32))


@case("print-of-computed-string", OPS,
      "tf.print of a string tensor computed inside the mapped function",
      ValueError,
      r"tf.print inside a mapped function is given a string tensor computed "
      r"while it runs.*Pass the numbers and put the text in the message")
def print_of_computed_string():
  P(lambda x: (tf.print(tf.strings.as_string(x)), x)[1], "i")(
      np.zeros(2, np.float32))


@case("gradient-through-unbounded-loop", OPS,
      "a GradientTape through a tf.while_loop without maximum_iterations",
      ValueError,
      r"takes a gradient through a tf.while_loop with no maximum_iterations"
      r".* Give the loop maximum_iterations")
def gradient_through_unbounded_loop():
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
      r"\(x\[None\].*at tests/error_cases_collectives.py:LINE.*tf.expand_dims")
def new_axis_on_replicated():
  P(lambda v, w: v + w[None][0], in_axes=(0, None))(
      np.zeros((2, 3), np.float32), np.ones(3, np.float32))


@case("dynamic-shape-in-tf-function", OPS,
      "a pmap inside a tf.function whose mapped axis has an open size",
      ValueError, r"pmap of .*<lambda> inside a tf.function maps axis 0 of "
      r"args\[0\], of shape \(None,\), whose size is open \(None\): it is "
      r"the number of devices, .* or where reduce_retracing=True opened a size "
      r"that changed between calls. Give the size: an input_signature of "
      r"tf.TensorSpec\(\[8\], tf.float32\) for this argument")
def dynamic_shape_in_tf_function():
  f = P(lambda v: v)
  # No AutoGraph: it would prefix the message with a traceback of this file.
  tf.function(lambda v: f(v), autograph=False,
              input_signature=[tf.TensorSpec([None], tf.float32)]
              ).get_concrete_function()


@case("dynamic-slice-float-start", COLLECTIVES,
      "lax.dynamic_slice with a float start", TypeError,
      r"dynamic_slice: `start_indices`\[0\] has dtype float32, but start "
      r"indices must be integers, as in jax.lax; round it and cast it first "
      r"\(tf.cast\(tf.round\(start\), tf.int32\)\)")
def dynamic_slice_float_start():
  lax.dynamic_slice(np.arange(8.0), (1.0,), (2,))


@case("dynamic-slice-bool-start", COLLECTIVES,
      "lax.dynamic_slice with a bool tensor start inside a pmap", TypeError,
      r"dynamic_slice: `start_indices`\[1\] has dtype bool, but start indices "
      r"must be integers")
def dynamic_slice_bool_start():
  P(lambda x: lax.dynamic_slice(x, (0, x[0, 0] > 0), (1, 2)), "i")(
      np.zeros((8, 2, 4)))


@case("dynamic-slice-float-starts-tensor", COLLECTIVES,
      "lax.dynamic_slice with one float64 tensor of starts", TypeError,
      r"dynamic_slice: `start_indices` has dtype float64, but start indices "
      r"must be integers")
def dynamic_slice_float_starts_tensor():
  lax.dynamic_slice(np.zeros((4, 4)), tf.constant([1.0, 2.0], tf.float64),
                    (2, 2))


@case("dynamic-slice-in-dim-float-start", COLLECTIVES,
      "lax.dynamic_slice_in_dim with a NumPy float start", TypeError,
      r"dynamic_slice_in_dim: `start_index` has dtype float64, but start "
      r"indices must be integers")
def dynamic_slice_in_dim_float_start():
  lax.dynamic_slice_in_dim(np.arange(8.0), np.float64(1.5), 2)


@case("lax-scan-carry-dtype", OPS,
      "lax.scan whose f returns a carry of another dtype", TypeError,
      r"lax.scan: f must return a carry like init, as in jax.lax.scan, but "
      r"init\[1\] is float32\[\] and f's carry\[1\] is float64\[\]")
def lax_scan_carry_dtype():
  P(lambda x: lax.scan(lambda c, e: ((c[0] + e, tf.cast(c[1], tf.float64)),
                                     None), (x, 0.), tf.zeros(3))[0], "i")(
                                         np.zeros(2, np.float32))


@case("lax-scan-lengths", OPS, "lax.scan over xs of two lengths",
      ValueError, r"lax.scan: the leaves of xs must share their leading axis "
      r"size, and length must equal it, as in jax.lax.scan; got xs\['a'\] 3, "
      r"xs\['b'\] 2")
def lax_scan_lengths():
  P(lambda x: lax.scan(lambda c, e: (c, None), x,
                       {"a": tf.zeros(3), "b": tf.zeros(2)})[0], "i")(
                           np.zeros(2))


@case("lax-cond-branches", OPS,
      "lax.cond whose branches return different structures", TypeError,
      r"lax.cond: every branch must return the same structure, dtypes and "
      r"shapes, as in jax.lax.cond, but true_fun's result has the structure "
      r"\{'a': \*\} and false_fun's result has \*")
def lax_cond_branches():
  P(lambda x: lax.cond(lax.axis_index("i") > 0, lambda v: {"a": v},
                       lambda v: v, x), "i")(np.zeros(2))


@case("lax-fori-loop-float-bound", OPS, "lax.fori_loop with a float bound",
      TypeError, r"lax.fori_loop: upper must be an integer \(a Python int or "
      r"an integer scalar tensor\), as in jax.lax.fori_loop, got float 2.5")
def lax_fori_loop_float_bound():
  P(lambda x: lax.fori_loop(0, 2.5, lambda i, c: c, x), "i")(np.zeros(2))


@case("grad-non-scalar", OPS, "tfspmd.grad of a function returning a vector",
      TypeError, r"tfspmd.grad: the function must return a floating-point "
      r"scalar, as in jax.grad, got float32\[3\]; reduce it first")
def grad_non_scalar():
  P(lambda x: tfspmd.grad(lambda v: v * 2.)(x), "i")(
      np.zeros((2, 3), np.float32))


@case("grad-integer-leaf", OPS, "tfspmd.grad with respect to an int32 leaf",
      TypeError, r"tfspmd.grad: args\[0\]\['n'\] has dtype int32; gradients "
      r"are taken with respect to floating-point leaves only, as in jax.grad")
def grad_integer_leaf():
  P(lambda x: tfspmd.grad(lambda p: tf.reduce_sum(p["w"]))(
      {"w": x, "n": lax.axis_index("i")}), "i")(np.zeros((2, 3), np.float32))
