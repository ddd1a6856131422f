"""The two executors: which runs a program, and that both compute the same.

The host executor runs a mesh of CPU devices of one process as one XLA
program; DTensor's executor splits it into one program per device. Values
are checked against NumPy.
"""

import logging

import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from tfspmd import lax
from tfspmd._src.executors import selection

from child_process import run_python

N = 8


def _collectives(x):
  total = lax.psum(x, "i")
  gathered = lax.all_gather(x, "i")
  shifted = lax.ppermute(x, "i", [(k, (k + 1) % N) for k in range(N)])
  return total, gathered, shifted, lax.axis_index("i")


@pytest.mark.parametrize("executor", ["host", "dtensor"])
def test_both_executors_compute_the_collectives_numpy_does(executor,
                                                           monkeypatch):
  monkeypatch.setattr(tfspmd.config, "_values",
                      dict(tfspmd.config._values, tfspmd_executor=executor))  # pylint: disable=protected-access
  x = np.arange(N * 3, dtype=np.float32).reshape(N, 3)
  total, gathered, shifted, index = tfspmd.pmap(_collectives, "i")(x)
  np.testing.assert_allclose(total, np.broadcast_to(x.sum(0), x.shape))
  np.testing.assert_allclose(gathered, np.broadcast_to(x, (N, N, 3)))
  np.testing.assert_allclose(shifted, np.roll(x, 1, axis=0))
  np.testing.assert_array_equal(index, np.arange(N))
  program, = [p for p in tfspmd.pmap(_collectives, "i").programs.values()
              if p.executor == executor]
  assert program.executor == executor


def test_a_host_result_lies_on_the_mesh_when_asked(host_executor):
  del host_executor  # unused
  x = np.arange(16, dtype=np.float32).reshape(N, 2)
  out = tfspmd.pmap(lambda v: v * 2.)(x)
  shards = out.addressable_shards
  assert [shard.device.id for shard in shards] == list(range(N))
  for k, shard in enumerate(shards):
    assert shard.data.device.endswith(f"CPU:{k}")
    np.testing.assert_array_equal(shard.data, x[k:k + 1] * 2.)
  from tensorflow.experimental import dtensor  # pylint: disable=g-import-not-at-top
  pieces = dtensor.unpack(out.dtensor_value)
  np.testing.assert_array_equal(np.concatenate(pieces), x * 2.)
  # Back into a program, and into DTensor's executor, with the same values.
  again = tfspmd.pmap(lambda v: v + 1.)(out)
  np.testing.assert_array_equal(again, x * 2. + 1.)


def test_a_program_xla_cannot_compile_runs_op_by_op_and_says_so(
    host_executor, caplog):
  del host_executor  # unused
  caplog.set_level(logging.WARNING, logger="tfspmd")
  x = np.arange(N * 3, dtype=np.float32).reshape(N, 3)
  histogram = tfspmd.pmap(lambda v: tf.histogram_fixed_width(
      v, [0., 24.], nbins=4))
  out = np.asarray(histogram(x))
  expected = np.stack([np.histogram(row, bins=4, range=(0., 24.))[0]
                       for row in x])
  np.testing.assert_array_equal(out, expected)
  # The program that runs op by op is kept: a second call takes it again.
  np.testing.assert_array_equal(histogram(x * .5), np.stack(
      [np.histogram(row, bins=4, range=(0., 24.))[0] for row in x * .5]))
  refused = [r.getMessage() for r in caplog.records
             if "XLA cannot compile" in r.getMessage()]
  assert len(refused) == 1, refused
  assert "it has no kernel for the op HistogramFixedWidth" in refused[0]
  assert "__inference" not in refused[0]


def _loop_of_sums(x):
  total = tf.while_loop(lambda k, _: k < 3,
                        lambda k, acc: (k + 1, acc + lax.psum(x, "i")),
                        (0, tf.zeros_like(x)))[1]
  return total, lax.all_gather(x, "i", tiled=True)


def test_jit_compile_false_runs_op_by_op_with_the_same_numbers(
    each_executor, caplog):
  tfspmd.config.update("tfspmd_log_compiles", True)
  caplog.set_level(logging.WARNING, logger="tfspmd")
  x = np.arange(N * 2, dtype=np.float32).reshape(N, 2)
  try:
    total, gathered = tfspmd.pmap(_loop_of_sums, "i", jit_compile=False)(x)
  finally:
    tfspmd.config.update("tfspmd_log_compiles", False)
  np.testing.assert_allclose(total, np.broadcast_to(3 * x.sum(0), x.shape))
  np.testing.assert_array_equal(gathered, np.broadcast_to(x.ravel(),
                                                          (N, N * 2)))
  first_runs = [r.getMessage() for r in caplog.records
                if "pmap of _loop_of_sums for" in r.getMessage() and
                not r.getMessage().startswith("tfspmd: traced")]
  on_host = each_executor == "host"
  assert len(first_runs) == 1, first_runs
  assert first_runs[0].startswith(
      "tfspmd: ran op by op, without XLA, pmap of" if on_host else
      "tfspmd: lowered, compiled and ran pmap of"), first_runs


def test_jit_compile_is_a_bool():
  with pytest.raises(TypeError, match=r"pmap: `jit_compile` must be True or "
                     r"False, got str 'auto'"):
    tfspmd.pmap(lambda v: v, jit_compile="auto")


@pytest.mark.parametrize("spec", [(None, None), ("d", None)])
def test_an_array_made_from_host_data_is_held_as_its_executor_holds_it(
    each_executor, spec):
  from tfspmd._src.runtime import placement as placement_lib  # pylint: disable=g-import-not-at-top
  from tfspmd._src.runtime import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  devices = tuple(tfspmd.local_devices())
  placement = placement_lib.Placement(
      mesh_lib.MeshKey(("d",), (N,), devices), spec)
  x = np.arange(N * 3, dtype=np.float32).reshape(N, 3)
  array = tfspmd.ShardedArray.from_whole(tf.constant(x), placement)
  on_host = each_executor == "host"
  assert (array._held_on_host() is not None) == on_host  # pylint: disable=protected-access
  np.testing.assert_array_equal(array, x)
  for k, shard in enumerate(array.addressable_shards):
    assert shard.data.device.endswith(f"CPU:{k}")
    np.testing.assert_array_equal(shard.data, x[k:k + 1] if spec[0] else x)
  np.testing.assert_array_equal(tfspmd.pmap(lambda v: v * 2.)(array), x * 2.)


def test_auto_runs_cpu_meshes_of_one_process_on_the_host(monkeypatch):
  values = dict(tfspmd.config._values)  # pylint: disable=protected-access
  monkeypatch.setattr(tfspmd.config, "_values", values)
  values["tfspmd_executor"] = "auto"
  assert selection.executor_for(["cpu"] * 8, 1, "f") == selection.HOST
  assert selection.executor_for(["gpu"] * 8, 1, "f") == selection.DTENSOR
  assert selection.executor_for(["cpu"] * 8, 2, "f") == selection.DTENSOR
  values["tfspmd_executor"] = "dtensor"
  assert selection.executor_for(["cpu"] * 8, 1, "f") == selection.DTENSOR
  values["tfspmd_executor"] = "host"
  with pytest.raises(ValueError, match=r"pmap of f: tfspmd_executor is 'host'"
                     r".*spans devices of \['tpu'\]"):
    selection.executor_for(["tpu"] * 8, 1, "pmap of f")
  with pytest.raises(ValueError, match=r"spans 2 processes"):
    selection.executor_for(["cpu"] * 8, 2, "pmap of f")


def test_the_setting_takes_only_its_values():
  with pytest.raises(ValueError, match=r"tfspmd_executor must be one of "
                     r"\('auto', 'host', 'dtensor'\), got 'xla'"):
    tfspmd.config.update("tfspmd_executor", "xla")
  with pytest.raises(TypeError, match=r"tfspmd_executor must be one of"):
    tfspmd.config.update("tfspmd_executor", True)


def test_the_environment_variable_is_checked_at_import():
  run = run_python("import tfspmd", check=False, TFSPMD_EXECUTOR="gpu")
  assert run.returncode != 0
  assert ("TFSPMD_EXECUTOR must be one of ('auto', 'host', 'dtensor')"
          in run.stderr), run.stderr[-2000:]
  run = run_python("import tfspmd; print(tfspmd.config.tfspmd_executor)",
                   TFSPMD_EXECUTOR="DTensor")
  assert run.stdout.split() == ["dtensor"]


@pytest.mark.parametrize("jit_compile", [True, False])
def test_an_integer_division_by_zero_on_the_host_gives_jaxs_numbers(
    host_executor, jit_compile):
  del host_executor  # unused
  x = np.array([7, -7, 0, 5, -5, 1, -1, 3], np.int32)
  y = np.array([0, 0, 0, -2, 2, -1, -1, 0], np.int32)
  run = lambda f, a, b: np.asarray(tfspmd.pmap(
      f, "i", jit_compile=jit_compile)(a, b)).tolist()
  # jax.pmap of jnp.floor_divide and jnp.remainder (jax 0.10.2, 8 CPU
  # devices): x // 0 is -2, 0 // 0 is -1 and x % 0 is 0, where XLA's
  # lowering of TensorFlow's ops gave 7 // 0 = -1 and 7 % 0 = 7.
  assert run(tf.math.floordiv, x, y) == [-2, -2, -1, -3, -3, -1, 1, -2]
  assert run(tf.math.floormod, x, y) == [0, 0, 0, -1, 1, 0, 0, 0]
  assert run(lambda a, b: a // b, x.astype(np.int64),
             y.astype(np.int64)) == [-2, -2, -1, -3, -3, -1, 1, -2]
  # Unsigned: jnp.floor_divide's x // 0 is the largest value (lax.div).
  u, v = np.abs(x).astype(np.uint8), np.abs(y).astype(np.uint8)
  assert run(tf.math.floordiv, u, v) == [255, 255, 255, 2, 2, 1, 1, 255]
  assert run(tf.math.floormod, u, v) == [0, 0, 0, 1, 1, 0, 0, 0]
  if jit_compile:
    # Truncating: lax.div and lax.rem (XLA's numbers; run op by op,
    # TensorFlow's kernels raise).
    assert run(tf.truncatediv, x, y) == [-1, -1, -1, -2, -2, -1, 1, -1]
    assert run(tf.truncatemod, x, y) == [7, -7, 0, 1, -1, 0, 0, 3]
  # The divisor broadcast against a per-device row, zero on device 3.
  rows = np.arange(8 * 3, dtype=np.int32).reshape(8, 3) - 10
  divisors = np.array([1, 2, -3, 0, 4, 1, 2, 3], np.int32)
  expected = rows // np.where(divisors == 0, 1, divisors)[:, None]
  expected[3] = np.where(rows[3] == 0, -1, -2)
  assert run(lambda r, d: r // d, rows, divisors) == expected.tolist()


def test_arithmetic_on_arrays_stays_where_the_executor_holds_them(
    each_executor):
  x = np.arange(N * 3, dtype=np.float32).reshape(N, 3)
  out = tfspmd.pmap(lambda v: v + 1.)(x)
  results = {"scaled": (out * 2. - x, (x + 1.) * 2. - x),
             "negated": (-abs(out), -np.abs(x + 1.)),
             "compared": (out > 4., x + 1. > 4.),
             "cast": (out.astype(tf.int32), (x + 1.).astype(np.int32))}
  for name, (got, want) in results.items():
    np.testing.assert_array_equal(got, want, err_msg=name)
    assert got.sharding.spec == out.sharding.spec, name
    assert (got._held_on_host() is not None) == (each_executor == "host")  # pylint: disable=protected-access
  # A result of another shape is split as DTensor's expansion chooses.
  wide = out + np.ones((2, N, 3), np.float32)
  np.testing.assert_array_equal(wide, np.broadcast_to(x + 2., (2, N, 3)))
  with pytest.raises(TypeError, match="does not promote dtypes"):
    out + np.ones((N, 3), np.float64)
