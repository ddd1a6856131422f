"""Mistakes with shardings and device_put.

Rows of the error catalogue (`error_catalogue`); tests/test_errors.py runs them.
"""

import os
from unittest import mock

import numpy as np
import tensorflow as tf

import tfspmd
from tfspmd._src.core import config as config_lib

from error_catalogue import case, DEVICES, NAMES, STATE, PROCESSES, SHARDINGS


@case("named-sharding-unknown-axis", SHARDINGS,
      "NamedSharding(mesh, P('z')) on a mesh without 'z'", ValueError,
      r"NamedSharding: `spec` PartitionSpec\('z'\) names the axis 'z', "
      r"which is not an axis of the mesh \(axes: \('x',\)\)")
def named_sharding_unknown_axis():
  tfspmd.sharding.NamedSharding(tfspmd.make_mesh((8,), ("x",)),
                                tfspmd.P("z"))


@case("named-sharding-spec-tuple", SHARDINGS,
      "NamedSharding(mesh, ('x',)): a tuple, not a PartitionSpec", TypeError,
      r"NamedSharding: `spec` must be a tfspmd.PartitionSpec \(tfspmd.P\(...\)\), "
      r"got tuple \('x',\)")
def named_sharding_spec_tuple():
  tfspmd.sharding.NamedSharding(tfspmd.make_mesh((8,), ("x",)), ("x",))


@case("single-device-sharding-not-a-device", SHARDINGS,
      "SingleDeviceSharding('cpu:0')", TypeError,
      r"SingleDeviceSharding: `device` must be a tfspmd.Device")
def single_device_sharding_not_a_device():
  tfspmd.sharding.SingleDeviceSharding("cpu:0")


@case("device-put-indivisible", SHARDINGS,
      "device_put of 6 rows split 8 ways", ValueError,
      r"x\['w'\] of shape \(6,\): NamedSharding\(.*\) splits dimension 0 8 "
      r"ways, which does not evenly divide its size 6")
def device_put_indivisible():
  tfspmd.device_put({"w": np.zeros(6)}, tfspmd.sharding.NamedSharding(
      tfspmd.make_mesh((8,), ("x",)), tfspmd.P("x")))


@case("device-put-spec-too-long", SHARDINGS,
      "device_put of a vector with a spec of two entries", ValueError,
      r"x of shape \(8,\) has rank 1, but NamedSharding\(.*\) splits 2 "
      r"dimensions")
def device_put_spec_too_long():
  tfspmd.device_put(np.zeros(8), tfspmd.sharding.NamedSharding(
      tfspmd.make_mesh((8,), ("x",)), tfspmd.P("x", None)))


@case("device-put-target", SHARDINGS, "device_put(x, 'gpu')", TypeError,
      r"device_put: the `device` for x must be a NamedSharding, a "
      r"PartitionSpec, a SingleDeviceSharding, a tfspmd.Device or None, got "
      r"str 'gpu'")
def device_put_target():
  tfspmd.device_put(np.zeros(2), "gpu")


@case("device-put-spec-without-mesh", SHARDINGS,
      "device_put(x, P('x')) with no mesh set", TypeError,
      r"device_put: the `device` for x is the PartitionSpec "
      r"PartitionSpec\('x'\), which needs a mesh: set one first")
def device_put_spec_without_mesh():
  tfspmd.device_put(np.zeros(2), tfspmd.P("x"))


@case("device-put-src", SHARDINGS, "device_put(x, src=a device)", ValueError,
      r"device_put: `src` must be None")
def device_put_src():
  tfspmd.device_put(np.zeros(2), src=tfspmd.devices()[0])


@case("device-put-sharded-count", SHARDINGS,
      "device_put_sharded of 3 shards onto 2 devices", ValueError,
      r"device_put_sharded: `shards` has 3 entries but `devices` 2")
def device_put_sharded_count():
  tfspmd.device_put_sharded([np.zeros(2)] * 3, tfspmd.devices()[:2])


@case("device-put-sharded-shapes", SHARDINGS,
      "device_put_sharded of shards of different shapes", ValueError,
      r"device_put_sharded: shards\[1\]\['w'\] has shape \[3\] and dtype "
      r"float64, shards\[0\]\['w'\] \[2\] and float64")
def device_put_sharded_shapes():
  tfspmd.device_put_sharded([{"w": np.zeros(2)}, {"w": np.zeros(3)}],
                            tfspmd.devices()[:2])


@case("device-put-sharded-structures", SHARDINGS,
      "device_put_sharded of shards of different structures", ValueError,
      r"device_put_sharded: shards\[1\] has the structure \(\*, \*\), "
      r"shards\[0\] \(\*,\)")
def device_put_sharded_structures():
  tfspmd.device_put_sharded([(np.zeros(2),), (np.zeros(2), np.zeros(2))],
                            tfspmd.devices()[:2])


@case("device-put-replicated-devices", SHARDINGS,
      "device_put_replicated(x, ['cpu:0'])", TypeError,
      r"device_put_replicated: `devices` must be a non-empty sequence of "
      r"tfspmd devices")
def device_put_replicated_devices():
  tfspmd.device_put_replicated(np.zeros(2), ["cpu:0"])


@case("device-put-sharded-device-twice", SHARDINGS,
      "device_put_sharded onto one device twice", ValueError,
      r"device_put_sharded: a device appears more than once in `devices`")
def device_put_sharded_device_twice():
  tfspmd.device_put_sharded([np.zeros(2)] * 2, [tfspmd.devices()[0]] * 2)


@case("local-devices-process-index", DEVICES,
      "local_devices(process_index=3) in one process", ValueError,
      r"local_devices: `process_index` must be the index of a process, an "
      r"int from 0 to 0 \(1 process\(es\)\), got 3")
def local_devices_process_index():
  tfspmd.local_devices(process_index=3)


@case("jax-enable-x64-invalid", STATE, "JAX_ENABLE_X64=maybe in the environment",
      ValueError, r"JAX_ENABLE_X64 must be one of .*'true'.*'false'.* to turn "
      r"tfspmd_enable_x64 on or off, got 'maybe'")
def jax_enable_x64_invalid():
  with mock.patch.dict(os.environ, {"JAX_ENABLE_X64": "maybe"}):
    config_lib.Config()


@case("vmap-spmd-axis-name-unhashable", NAMES,
      "vmap(spmd_axis_name=['i'])", TypeError,
      r"vmap: `spmd_axis_name` must be None, an axis name or a tuple of axis "
      r"names, got \['i'\]")
def vmap_spmd_axis_name_unhashable():
  tfspmd.vmap(lambda x: x, spmd_axis_name=["i"])


def _tf_config(text):
  """Runs initialize() with `text` as the TF_CONFIG a launcher set."""
  with mock.patch.dict(os.environ, {"TF_CONFIG": text}):
    tfspmd.distributed.initialize()


@case("tf-config-not-json", PROCESSES,
      "TF_CONFIG that is not JSON (unquoted keys)", ValueError,
      r"TF_CONFIG is not JSON \(Expecting property name enclosed in double "
      r"quotes: .*\): it must be like \{\"cluster\": \{\"worker\": "
      r"\[\"host:port\", \.\.\.\]\}, \"task\": \{\"type\": \"worker\", "
      r"\"index\": 0\}\}")
def tf_config_not_json():
  _tf_config("{cluster: {worker: ['h0:2222']}}")


@case("tf-config-not-an-object", PROCESSES,
      "TF_CONFIG whose \"cluster\" is not an object", ValueError,
      r"TF_CONFIG must be a JSON object with a \"cluster\" object, got "
      r"'\{\"cluster\": \[\"h0:2222\"\]\}'")
def tf_config_not_an_object():
  _tf_config('{"cluster": ["h0:2222"]}')


@case("tf-config-job-not-a-list", PROCESSES,
      "TF_CONFIG whose \"worker\" job is one string of addresses", ValueError,
      r"TF_CONFIG's 'worker' job must be a list of 'host:port' strings, got "
      r"'h0:2222,h1:2222'")
def tf_config_job_not_a_list():
  _tf_config('{"cluster": {"worker": "h0:2222,h1:2222"}, '
             '"task": {"type": "worker", "index": 0}}')


@case("tf-config-task-type", PROCESSES,
      "TF_CONFIG whose task is an \"evaluator\" (or \"ps\")", ValueError,
      r"TF_CONFIG's task is \{'type': 'evaluator', 'index': 0\}, but the "
      r"processes that run a pmap together are the cluster's \"chief\" and "
      r"\"worker\" tasks: give this process \"task\": \{\"type\": \"worker\" "
      r"\(or \"chief\"\), \"index\": \.\.\.\}, or do not call "
      r"tfspmd\.distributed\.initialize in it")
def tf_config_task_type():
  _tf_config('{"cluster": {"worker": ["h0:2222", "h1:2222"], '
             '"evaluator": ["e0:2222"]}, '
             '"task": {"type": "evaluator", "index": 0}}')


@case("tf-config-index-range", PROCESSES,
      "TF_CONFIG whose task index is past its job's tasks", ValueError,
      r"TF_CONFIG's task index 2 is out of range for its 'worker' job of 2 "
      r"task\(s\)")
def tf_config_index_range():
  _tf_config('{"cluster": {"worker": ["h0:2222", "h1:2222"]}, '
             '"task": {"type": "worker", "index": 2}}')


@case("device-put-in-tf-function", SHARDINGS,
      "device_put of a value inside a tf.function that is not a tfspmd.jit "
      "function", ValueError,
      r"device_put: x is a value of a function being traced \(a pmap's, a "
      r"shard_map's or a tf.function's\), which lies on no devices of its "
      r"own; call device_put on the arrays outside the function. Inside a "
      r"tfspmd.jit function \(outside the shard_maps in it\), "
      r"device_put\(x, sharding\) lays a value out")
def device_put_in_tf_function():
  mesh = tfspmd.make_mesh((8,), ("x",))
  # No AutoGraph: it would prefix the message with a traceback of this file.
  tf.function(lambda v: tfspmd.device_put(
      v, tfspmd.NamedSharding(mesh, tfspmd.P("x"))), autograph=False)(
          np.zeros(8, np.float32))


@case("device-put-to-a-device-in-jit", SHARDINGS,
      "device_put(v, tfspmd.devices()[0]) inside a tfspmd.jit function",
      ValueError,
      r"device_put: inside a tfspmd.jit function every value lies on the "
      r"function's mesh Mesh\(\{'i': 8\}\), but x was sent to "
      r"Device\(platform='cpu', id=0\); give a NamedSharding or a "
      r"PartitionSpec over that mesh")
def device_put_to_a_device_in_jit():
  tfspmd.jit(lambda v: tfspmd.device_put(v, tfspmd.devices()[0]))(
      np.zeros(8, np.float32))


@case("jit-with-shardings-in-shard-map", SHARDINGS,
      "a jit with out_shardings called inside a shard_map's function",
      ValueError,
      r"jit: .*<lambda>, jitted with in_shardings or out_shardings, was "
      r"called inside a pmap, a shard_map or a tf.function that is not a "
      r"tfspmd.jit function, whose values lie on no mesh. Jit it without "
      r"shardings to call it there \(it is then inlined, as in JAX\)")
def jit_with_shardings_in_shard_map():
  mesh = tfspmd.make_mesh((8,), ("x",))
  inner = tfspmd.jit(lambda v: v + 1, out_shardings=tfspmd.NamedSharding(
      mesh, tfspmd.P()))
  tfspmd.shard_map(inner, mesh=mesh, in_specs=tfspmd.P("x"),
                   out_specs=tfspmd.P("x"))(np.zeros(8, np.float32))
