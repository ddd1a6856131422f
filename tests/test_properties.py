"""Generated programs against an independent NumPy reference.

Each test draws programs from one family (collectives, trees of arguments,
in_axes/out_axes, nested meshes, vmap inside pmap): the mapped size, dtype,
per-device shape, axes and values vary. The reference never calls tfspmd:
it slices the inputs per device with NumPy, runs the per-device function's
local part slice by slice, does each collective as a NumPy operation across
the slices, and stacks the results along out_axes.

Each distinct call signature traces a program (~0.2 s), so every family
keeps a fixed set of pmapped functions and draws shapes and sizes from small
sets: the default run draws 550 programs over about 140 traced signatures. Profiles (TFSPMD_HYPOTHESIS_PROFILE):
  ci (default): derandomized, no example database, no deadline;
  nightly: 10 times the examples, random.
"""

import collections
import os

import hypothesis
from hypothesis import strategies as st
import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from tfspmd import lax

hypothesis.settings.register_profile(
    "ci", derandomize=True, database=None, deadline=None, print_blob=True,
    suppress_health_check=list(hypothesis.HealthCheck))
hypothesis.settings.register_profile(
    "nightly", parent=hypothesis.settings.get_profile("ci"),
    derandomize=False)
PROFILE = os.environ.get("TFSPMD_HYPOTHESIS_PROFILE", "ci")
_SCALE = {"ci": 1, "nightly": 10}[PROFILE]

# Examples per family in the ci profile.
EXAMPLES = {"reductions": 120, "gathers": 60, "permutations": 70,
            "all_to_all": 50, "trees": 80, "nested": 50, "vmap": 40,
            "dtypes": 80}
DEFAULT_COUNT = sum(EXAMPLES.values())

generated = collections.Counter()


def family(name):
  """Settings of one family's test under the selected profile."""
  return hypothesis.settings(hypothesis.settings.get_profile(PROFILE),
                             max_examples=EXAMPLES[name] * _SCALE)


# --- the NumPy reference -----------------------------------------------------


def values(seed, shape, dtype):
  """Random values that every sum and mean here keeps exact.

  Multiples of 1/4 in [-8, 8]: sums of up to 64 of them, and their means
  over powers of two, are exact in float32, so the checks can be exact.
  """
  rng = np.random.default_rng(seed)
  return (rng.integers(-32, 33, size=shape) / 4 if np.dtype(dtype).kind == "f"
          else rng.integers(-20, 21, size=shape)).astype(dtype)


def device_slices(global_value, axis, n):
  """Each device's slice of an input mapped along `axis` (None: all of it)."""
  if axis is None:
    return [global_value] * n
  return [np.take(global_value, d, axis=axis) for d in range(n)]


def stack_outputs(per_device, axis):
  """The result of per-device outputs with the mapped axis at `axis`."""
  if axis is None:
    for value in per_device[1:]:
      np.testing.assert_array_equal(value, per_device[0])
    return per_device[0]
  return np.stack(per_device, axis=axis)


def mapped_shape(per_device_shape, axis, n):
  shape = list(per_device_shape)
  shape.insert(axis % (len(shape) + 1), n)
  return tuple(shape)


def check(actual, expected, dtype):
  actual = np.asarray(actual)
  assert actual.dtype == np.dtype(dtype), (actual.dtype, dtype)
  assert actual.shape == expected.shape, (actual.shape, expected.shape)
  if np.dtype(dtype).kind == "f":
    np.testing.assert_allclose(actual, expected, rtol=1e-6, atol=0)
  else:
    np.testing.assert_array_equal(actual, expected)


DTYPES = (np.float32, np.int32)
SHAPES = ((3,), (2, 3))
SIZES = (2, 8)
seeds = st.integers(0, 2 ** 32 - 1)

# --- reductions: psum, pmean, pmax, pmin -------------------------------------

REDUCTION_OUT_AXES = {"mapped": 0, "mixed": (None, None, 1, -1)}


def reductions(x):
  y = x * 3 - 1
  return (lax.psum(y, "i"), lax.pmean(y, "i"), lax.pmax(y, "i"),
          lax.pmin(y, "i"))


REDUCTIONS = {(in_axis, out): tfspmd.pmap(reductions, "i", in_axes=in_axis,
                                          out_axes=REDUCTION_OUT_AXES[out])
              for in_axis in (0, -1) for out in REDUCTION_OUT_AXES}


def reductions_reference(slices):
  ys = [s * 3 - 1 for s in slices]
  total = np.sum(ys, axis=0)
  mean = total / len(ys)
  return [(total, mean, np.max(ys, axis=0), np.min(ys, axis=0))
          for _ in ys]


@family("reductions")
@hypothesis.given(in_axis=st.sampled_from((0, -1)),
                  out=st.sampled_from(sorted(REDUCTION_OUT_AXES)),
                  n=st.sampled_from(SIZES), dtype=st.sampled_from(DTYPES),
                  shape=st.sampled_from(SHAPES), seed=seeds)
def test_reductions_match_numpy(in_axis, out, n, dtype, shape, seed):
  generated["reductions"] += 1
  x = values(seed, mapped_shape(shape, in_axis, n), dtype)
  outputs = REDUCTIONS[in_axis, out](x)
  per_device = reductions_reference(device_slices(x, in_axis % x.ndim, n))
  out_axes = REDUCTION_OUT_AXES[out]
  out_axes = out_axes if isinstance(out_axes, tuple) else (out_axes,) * 4
  mean_dtype = np.float32 if dtype == np.int32 else dtype
  for k, (actual, axis) in enumerate(zip(outputs, out_axes)):
    expected = stack_outputs([d[k] for d in per_device], axis)
    check(actual, expected.astype(mean_dtype if k == 1 else dtype),
          mean_dtype if k == 1 else dtype)

# --- all_gather and psum_scatter ----------------------------------------------


def gathers(x):
  n = lax.axis_size("i")
  stacked = lax.all_gather(x, "i")
  tiled = lax.all_gather(x, "i", axis=-1, tiled=True)
  scaled = tf.stack([x * (k + 1) for k in range(n)])
  return stacked, tiled, lax.psum_scatter(scaled, "i")


GATHERS = tfspmd.pmap(gathers, "i")


@family("gathers")
@hypothesis.given(n=st.sampled_from(SIZES), dtype=st.sampled_from(DTYPES),
                  shape=st.sampled_from(SHAPES), seed=seeds)
def test_gathers_match_numpy(n, dtype, shape, seed):
  generated["gathers"] += 1
  x = values(seed, (n,) + shape, dtype)
  stacked, tiled, scattered = GATHERS(x)
  slices = device_slices(x, 0, n)
  total = np.sum(slices, axis=0)
  check(stacked, stack_outputs([np.stack(slices)] * n, 0), dtype)
  check(tiled, stack_outputs([np.concatenate(slices, axis=-1)] * n, 0), dtype)
  check(scattered, stack_outputs([total * (d + 1) for d in range(n)], 0), dtype)

# --- ppermute, pshuffle, axis_index ---------------------------------------------


def permutations(x):
  n = lax.axis_size("i")
  shifted = lax.ppermute(x, "i", [(j, (j + 1) % n) for j in range(n)])
  one_pair = lax.ppermute(x, "i", [(0, n - 1)])
  reversed_ = lax.pshuffle(x, "i", list(range(n))[::-1])
  indexed = x + tf.cast(lax.axis_index("i"), x.dtype)
  return shifted, one_pair, reversed_, indexed


PERMUTATIONS = tfspmd.pmap(permutations, "i", out_axes=(0, 0, 1, -1))


@family("permutations")
@hypothesis.given(n=st.sampled_from((1, 2, 4, 8)),
                  dtype=st.sampled_from(DTYPES), shape=st.sampled_from(SHAPES),
                  seed=seeds)
def test_permutations_match_numpy(n, dtype, shape, seed):
  generated["permutations"] += 1
  x = values(seed, (n,) + shape, dtype)
  s = device_slices(x, 0, n)
  zeros = np.zeros_like(s[0])
  expected = [
      [s[(d - 1) % n] for d in range(n)],
      [s[0] if d == n - 1 else zeros for d in range(n)],
      [s[n - 1 - d] for d in range(n)],
      [s[d] + d for d in range(n)],
  ]
  for actual, per_device, axis in zip(PERMUTATIONS(x), expected, (0, 0, 1, -1)):
    check(actual, stack_outputs(per_device, axis), dtype)

# --- all_to_all and pswapaxes -----------------------------------------------------


def exchanges(x, blocks):
  return (lax.all_to_all(x, "i", 0, 1), lax.pswapaxes(x, "i", 0),
          lax.all_to_all(blocks, "i", 0, 1, tiled=True))


EXCHANGES = tfspmd.pmap(exchanges, "i")


@family("all_to_all")
@hypothesis.given(n=st.sampled_from(SIZES), k=st.sampled_from((1, 3)),
                  dtype=st.sampled_from(DTYPES), seed=seeds)
def test_all_to_all_matches_numpy(n, k, dtype, seed):
  generated["all_to_all"] += 1
  x = values(seed, (n, n, k), dtype)
  blocks = values(seed + 1, (n, 2 * n, k), dtype)
  s, b = device_slices(x, 0, n), device_slices(blocks, 0, n)
  expected = [
      [np.stack([s[j][d] for j in range(n)], axis=1) for d in range(n)],
      [np.stack([s[j][d] for j in range(n)], axis=0) for d in range(n)],
      [np.concatenate([b[j][2 * d:2 * d + 2] for j in range(n)], axis=1)
       for d in range(n)],
  ]
  for actual, per_device in zip(EXCHANGES(x, blocks), expected):
    check(actual, stack_outputs(per_device, 0), dtype)

# --- trees of arguments, in_axes and out_axes prefixes, keyword arguments -----

Pair = collections.namedtuple("Pair", ["u", "v"])
TREE_IN_AXES = {"b-broadcast": ({"a": 0, "b": None},),
                "b-split": ({"a": -1, "b": (0, None)},)}
TREE_OUT_AXES = {"prefix": Pair(u=None, v=[0, -1]), "all": 0}


def tree_function(tree, *, w):
  a, (y, z) = tree["a"], tree["b"]
  return Pair(u=lax.psum(a, "i") + z, v=[a * 2 + w, y - z])


TREES = {(i, o): tfspmd.pmap(tree_function, "i", in_axes=TREE_IN_AXES[i],
                             out_axes=TREE_OUT_AXES[o])
         for i in TREE_IN_AXES for o in TREE_OUT_AXES}


@family("trees")
@hypothesis.given(in_axes=st.sampled_from(sorted(TREE_IN_AXES)),
                  out_axes=st.sampled_from(sorted(TREE_OUT_AXES)),
                  n=st.sampled_from(SIZES),
                  dtype=st.sampled_from((np.float32, np.float64)),
                  shape=st.sampled_from(SHAPES), seed=seeds)
def test_trees_of_arguments_match_numpy(in_axes, out_axes, n, dtype, shape,
                                        seed):
  generated["trees"] += 1
  a_axis = 0 if in_axes == "b-broadcast" else -1
  y_axis = None if in_axes == "b-broadcast" else 0
  a = values(seed, mapped_shape(shape, a_axis, n), dtype)
  y = values(seed + 1, shape if y_axis is None else (n,) + shape, dtype)
  z = values(seed + 2, shape, dtype)
  w = values(seed + 3, (n,) + shape, dtype)
  out = TREES[in_axes, out_axes]({"a": a, "b": (y, z)}, w=w)

  a_s = device_slices(a, a_axis % a.ndim, n)
  y_s, w_s = device_slices(y, y_axis, n), device_slices(w, 0, n)
  total = np.sum(a_s, axis=0)
  u = [total + z for _ in range(n)]
  v0 = [a_s[d] * 2 + w_s[d] for d in range(n)]
  v1 = [y_s[d] - z for d in range(n)]
  axes = (None, 0, -1) if out_axes == "prefix" else (0, 0, 0)
  assert isinstance(out, Pair) and isinstance(out.v, list)
  for actual, per_device, axis in zip((out.u, *out.v), (u, v0, v1), axes):
    check(actual, stack_outputs(per_device, axis), dtype)

# --- nested pmaps: a 2-D mesh ---------------------------------------------------------


def nested_function(x):
  return (lax.psum(x, "r"), lax.psum(x, ("r", "c")), lax.all_gather(x, "c"),
          x * tf.cast(lax.axis_index(("r", "c")), x.dtype), lax.pmax(x, "c"))


NESTED = tfspmd.pmap(tfspmd.pmap(nested_function, "c"), "r")


@family("nested")
@hypothesis.given(mesh=st.sampled_from(((2, 2), (2, 4), (4, 2))),
                  dtype=st.sampled_from(DTYPES), seed=seeds)
def test_nested_pmaps_match_numpy(mesh, dtype, seed):
  generated["nested"] += 1
  rows, cols = mesh
  x = values(seed, (rows, cols, 3), dtype)
  expected = [np.empty((rows, cols, 3), dtype), np.empty((rows, cols, 3), dtype),
              np.empty((rows, cols, cols, 3), dtype),
              np.empty((rows, cols, 3), dtype), np.empty((rows, cols, 3), dtype)]
  for r in range(rows):
    for c in range(cols):
      expected[0][r, c] = sum(x[k, c] for k in range(rows))
      expected[1][r, c] = x.sum(axis=(0, 1))
      expected[2][r, c] = x[r]
      expected[3][r, c] = x[r, c] * (r * cols + c)
      expected[4][r, c] = x[r].max(axis=0)
  for actual, want in zip(NESTED(x), expected):
    check(actual, want, dtype)

# --- a named vmap inside a pmap ----------------------------------------------------------


def per_slice(x):
  return lax.psum(x, "v") + lax.pmax(x, "i"), lax.axis_index(("i", "v"))


VMAP_IN_PMAP = tfspmd.pmap(tfspmd.vmap(per_slice, axis_name="v"), "i")


@family("vmap")
@hypothesis.given(n=st.sampled_from(SIZES), m=st.sampled_from((2, 3)),
                  seed=seeds)
def test_vmap_inside_pmap_matches_numpy(n, m, seed):
  generated["vmap"] += 1
  x = values(seed, (n, m, 3), np.float32)
  combined, index = VMAP_IN_PMAP(x)
  expected = np.empty_like(x)
  for d in range(n):
    for v in range(m):
      expected[d, v] = x[d].sum(axis=0) + x[:, v].max(axis=0)
  check(combined, expected, np.float32)
  check(index, np.arange(n * m, dtype=np.int32).reshape(n, m), np.int32)


# --- every dtype a pmap takes ----------------------------------------------------------

ALL_DTYPES = (np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32,
              np.uint32, np.int64, np.uint64, np.float16, np.float32,
              np.float64, np.complex64, np.complex128)


def moves(x):
  n = lax.axis_size("i")
  return (x, lax.all_gather(x, "i", axis=1),
          lax.ppermute(x, "i", [(j, (j + 1) % n) for j in range(n)]))


def sums(x):
  return lax.psum(x, "i"), lax.pmean(x, "i")


def extrema(x):
  return lax.pmax(x, "i"), lax.pmin(x, "i")


MOVES = tfspmd.pmap(moves, "i", in_axes=1)
SUMS = tfspmd.pmap(sums, "i", out_axes=(0, None))
EXTREMA = tfspmd.pmap(extrema, "i", out_axes=(None, 0))


def any_values(seed, shape, dtype):
  rng = np.random.default_rng(seed)
  if dtype == np.bool_:
    return rng.integers(0, 2, size=shape).astype(bool)
  if np.dtype(dtype).kind == "c":
    return (values(seed, shape, np.float32) +
            1j * values(seed + 1, shape, np.float32)).astype(dtype)
  if dtype == np.uint64:  # both halves: unsigned order and wrapping sums
    return rng.integers(0, 9, size=shape, dtype=np.uint64) + (
        rng.integers(0, 2, size=shape, dtype=np.uint64) << np.uint64(63))
  low = 0 if np.dtype(dtype).kind == "u" else -8
  return (rng.integers(low, 9, size=shape) / (1 if np.dtype(dtype).kind in "iu"
                                              else 4)).astype(dtype)


@family("dtypes")
@hypothesis.given(n=st.sampled_from(SIZES), dtype=st.sampled_from(ALL_DTYPES),
                  seed=seeds)
def test_every_dtype_moves_and_sums_like_numpy(n, dtype, seed):
  generated["dtypes"] += 1
  x = any_values(seed, (2, n), dtype)
  s = device_slices(x, 1, n)
  same, gathered, shifted = MOVES(x)
  check(same, stack_outputs(s, 0), dtype)
  check(gathered, stack_outputs([np.stack(s, axis=1)] * n, 0), dtype)
  check(shifted, stack_outputs([s[(d - 1) % n] for d in range(n)], 0), dtype)
  if dtype == np.bool_:
    return
  total, mean = SUMS(x.T)
  wrapped = np.sum(s, axis=0, dtype=dtype)  # integers wrap, as on devices
  check(total, stack_outputs([wrapped] * n, 0), dtype)
  if np.dtype(dtype).kind in "iu":  # the mean of the (wrapped) sum
    wide = np.dtype(dtype) in (np.int64, np.uint32, np.uint64)
    mean_dtype = np.float64 if wide else np.float32
    expected = wrapped.astype(np.float64) / n
  else:
    mean_dtype = dtype
    exact = np.complex128 if np.dtype(dtype).kind == "c" else np.float64
    expected = np.sum(s, axis=0, dtype=exact) / n
  check(mean, expected.astype(mean_dtype), mean_dtype)
  if np.dtype(dtype).kind == "c":
    return
  largest, smallest = EXTREMA(x.T)
  check(largest, np.max(s, axis=0), dtype)
  check(smallest, stack_outputs([np.min(s, axis=0)] * n, 0), dtype)


def test_generated_program_count():
  """Runs last: the families together drew the programs the profile asks for."""
  if set(generated) != set(EXAMPLES):
    pytest.skip("only part of this file ran")
  assert sum(generated.values()) >= DEFAULT_COUNT * _SCALE
