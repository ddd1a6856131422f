"""One process of a multi-process test: `python multiprocess_worker.py SCENARIO`.

The test (test_multiprocess.py) starts one per process with the cluster in
the environment (`DTENSOR_JOBS`, `DTENSOR_CLIENT_ID`, ...) and
`TFSPMD_NUM_CPU_DEVICES`, and reads the last line of its stdout: a JSON
object of what the process saw. Timeouts come from `WORKER_INIT_TIMEOUT` and
`WORKER_HEARTBEAT_TIMEOUT` (seconds).
"""

import json
import os
import sys
import time

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from examples import multiprocess_psum
from examples import seed_examples
import tfspmd
from tfspmd import lax
from tfspmd.experimental import multihost_utils


def _initialize():
  """Joins the cluster the environment describes.

  With `WORKER_COORDINATOR` set, by the coordinator's address alone (and
  `WORKER_NUM_PROCESSES`, `WORKER_PROCESS_ID`), as JAX users start; else
  from DTensor's or a launcher's variables.
  """
  arguments = {}
  if os.environ.get("WORKER_COORDINATOR"):
    arguments = dict(
        coordinator_address=os.environ["WORKER_COORDINATOR"],
        num_processes=int(os.environ["WORKER_NUM_PROCESSES"]),
        process_id=int(os.environ["WORKER_PROCESS_ID"]))
  tfspmd.distributed.initialize(
      **arguments,
      initialization_timeout=float(os.environ["WORKER_INIT_TIMEOUT"]),
      heartbeat_timeout=float(os.environ["WORKER_HEARTBEAT_TIMEOUT"]))


def seed():
  """The jax.pmap reference's two-process example, and devices= across processes."""
  _initialize()
  me = tfspmd.process_index()
  out = multiprocess_psum.x_plus_psum()
  report = {
      "addresses": os.environ.get("DTENSOR_JOBS"),
      "process_index": me,
      "process_count": tfspmd.process_count(),
      "devices": [d.id for d in tfspmd.devices()],
      "local_devices": [d.id for d in tfspmd.local_devices()],
      "local_device_names": [d.name for d in tfspmd.local_devices()],
      "out": np.asarray(out).tolist(),
      "out_shape": out.shape.as_list(),
      "shard_devices": [s.device.id for s in out.addressable_shards],
      "out_row_2": int(out[2]),
  }
  # The result goes back in with no copy; the mapped axis spans 8 devices.
  again = tfspmd.pmap(lambda y: (lax.all_gather(y, "i"), lax.axis_size("i"),
                                 lax.axis_index("i")), axis_name="i")(out)
  report["gathered"] = np.asarray(again[0])[0].tolist()
  report["axis_size"] = np.asarray(again[1]).tolist()
  report["axis_index"] = np.asarray(again[2]).tolist()
  # Inside a tf.function, on the DTensor of an earlier result.
  center = tfspmd.pmap(lambda y: y - lax.pmean(y, "i"), axis_name="i")
  centered = tf.function(lambda v: center(center(v)))(
      tf.cast(out.dtensor_value, tf.float32))
  report["centered"] = [float(c.numpy()[0])
                        for c in dtensor.unpack(centered)]
  # A plain tensor holds only this process's part: refused in tfspmd's words.
  try:
    tf.function(lambda v: center(v))(tf.range(4, dtype=tf.float32))
  except ValueError as e:
    report["plain_in_tf_function"] = str(e)
  # Beside a DTensor, a plain tensor is what every device gets whole.
  shifted = tf.function(lambda v, k: center(v) + k)(
      tf.cast(out.dtensor_value, tf.float32), tf.fill([8], 2.))
  report["shifted"] = [float(c.numpy()[0]) for c in dtensor.unpack(shifted)]
  try:
    tfspmd.distributed.initialize()
  except RuntimeError as e:
    report["second_initialize"] = str(e)
  # devices= is the same list in every process; each maps over its own ones.
  middle = tfspmd.devices()[2:6]
  g = tfspmd.pmap(lambda x: x / lax.psum(x, "i"), axis_name="i",
                  devices=middle)
  report["middle"] = np.asarray(
      g(np.array([2.0, 3.0]) if me == 0 else np.array([4.0, 5.0]))).tolist()
  return report


def nested():
  """The reference's nested rows/cols normalize over 4 processes x 2 devices."""
  _initialize()
  me = tfspmd.process_index()

  x = np.arange(8.0).reshape((4, 2))
  local = x[me:me + 1]
  rows, cols, both = seed_examples.normalize_rows_and_cols(local)
  index = tfspmd.pmap(tfspmd.pmap(
      lambda: lax.axis_index(("rows", "cols")), axis_name="cols",
      axis_size=2), axis_name="rows", axis_size=1)()
  return {
      "process_index": me,
      "rows": np.asarray(rows).tolist(),
      "cols": np.asarray(cols).tolist(),
      "both": np.asarray(both).tolist(),
      "shape": rows.shape.as_list(),
      "linear_index": np.asarray(index).tolist(),
  }


def collectives():
  """Every collective of tfspmd.lax over one device per process.

  Process k passes row k of arange(64).reshape(8, 8) and reports its row of
  each result.
  """
  _initialize()
  me = tfspmd.process_index()
  count = tfspmd.process_count()
  row = np.arange(64, dtype=np.float32).reshape(8, 8)[me:me + 1]
  ring = [(k, (k + 1) % count) for k in range(count)]
  programs = {
      "psum": lambda v: lax.psum(v, "i"),
      "pmean": lambda v: lax.pmean(v, "i"),
      "pmax": lambda v: lax.pmax(v, "i"),
      "pmin": lambda v: lax.pmin(v, "i"),
      "all_gather": lambda v: lax.all_gather(v, "i"),
      "psum_scatter": lambda v: lax.psum_scatter(v, "i"),
      "ppermute": lambda v: lax.ppermute(v, "i", ring),
      "pshuffle": lambda v: lax.pshuffle(v, "i", list(range(count))[::-1]),
      "all_to_all": lambda v: lax.all_to_all(v, "i", 0, 0),
      "pswapaxes": lambda v: lax.pswapaxes(v, "i", 0),
      "axis_index": lambda v: v[:1] * 0 + tf.cast(lax.axis_index("i"),
                                                  tf.float32),
  }
  report = {name: np.asarray(tfspmd.pmap(f, axis_name="i")(row)).tolist()
            for name, f in programs.items()}
  # Nested pmaps, outer 4 x inner 2: each process holds one position of
  # each, so passes arrays of leading shape (1, 1).
  nested = _nested_collectives(row.reshape(1, 1, 8, 1), 4, 2)
  report.update({f"nested/{key}": value for key, value in nested.items()})
  return report


def _nested_collectives(part, outer, inner):
  """`_collectives_over` inner, outer and both axes of nested pmaps.

  Each process passes its block of the global array: leading dimensions its
  positions along 'o' and along 'i'; the inner pmap's axis_size is the
  global size of 'i', which crosses processes.
  """
  report = {}
  for group, count in ((("i",), inner), (("o",), outer),
                       (("o", "i"), outer * inner)):
    key = "+".join(group)
    try:
      out = tfspmd.pmap(tfspmd.pmap(
          _collectives_over(group, count),
          axis_name="i", axis_size=inner), axis_name="o")(part)
      report[key] = {name: np.asarray(value).tolist()
                     for name, value in out.items()}
    except Exception as e:  # pylint: disable=broad-except
      report[key] = f"{type(e).__name__}: {e}"
  return report


def nested_across_processes():
  """Nested pmaps, outer 2 x inner 4, over 4 processes x 2 devices.

  The global array is arange(128).reshape(2, 4, 8, 2); process k holds
  position k // 2 of 'o' and positions 2 (k % 2), 2 (k % 2) + 1 of 'i'.
  """
  _initialize()
  me = tfspmd.process_index()
  x = np.arange(128, dtype=np.float32).reshape(2, 4, 8, 2)
  i = 2 * (me % 2)
  report = _nested_collectives(x[me // 2:me // 2 + 1, i:i + 2], 2, 4)
  # The block of 2 'o' positions x 1 'i' position is not this process's.
  try:
    tfspmd.pmap(tfspmd.pmap(lambda v: lax.psum(v, "i"), axis_name="i",
                            axis_size=4), axis_name="o")(x[:2, :1])
    report["wrong_part"] = None
  except ValueError as e:
    report["wrong_part"] = str(e)
  # The per-device shapes the outer function traces with, per call: a new
  # signature traces it over this process's part, up to the nested pmap,
  # then over the global shapes.
  traced = []
  inner = tfspmd.pmap(lambda v: lax.psum(v, "i"), axis_name="i", axis_size=4)

  def outer(v):
    traced.append(v.shape.as_list())
    return inner(v)

  total = tfspmd.pmap(outer, axis_name="o")
  part = x[me // 2:me // 2 + 1, i:i + 2]
  report["traced"] = []
  for value in (part, part[..., :1], part):
    out = total(value)
    report["traced"].append(list(traced))
    traced.clear()
  # Inside a tf.function, on the DTensor of the last result: each local
  # device's block of psum over 'i' of it.
  again = tf.function(total)(out.dtensor_value)
  report["in_tf_function"] = [c.numpy().tolist()
                              for c in dtensor.unpack(again)]
  return report


def nested_not_a_block():
  """Nested pmaps whose grid does not split into 2 processes x 3 devices.

  Outer 3 x inner 2 over 6 devices: process 0 holds positions (0, 0),
  (0, 1) and (1, 0). Then inputs holding more positions than devices.
  """
  _initialize()
  report = {}
  inner = tfspmd.pmap(lambda v: lax.psum(v, "c"), axis_name="c", axis_size=2)
  for key, f, part in (
      ("not_a_block", tfspmd.pmap(inner, axis_name="r"),
       np.ones((3, 1, 2), np.float32)),
      ("too_many", tfspmd.pmap(tfspmd.pmap(lambda v: lax.psum(v, "c"),
                                           axis_name="c"), axis_name="r"),
       np.ones((1, 6), np.float32))):
    try:
      report[key] = np.asarray(f(part)).tolist()
    except ValueError as e:
      report[key] = str(e)
  return report


def _collectives_over(group, count):
  """Every collective of tfspmd.lax over the mesh axes `group` (size `count`).

  Each returns a block of the shape it is given (8 x 2 here): all_gather and
  all_to_all tiled, ppermute a ring shifting by one.
  """
  ring = [(k, (k + 1) % count) for k in range(count)]
  def f(b):
    return {
        "psum": lax.psum(b, group),
        "pmean": lax.pmean(b, group),
        "pmax": lax.pmax(b, group),
        "pmin": lax.pmin(b, group),
        "all_gather": lax.all_gather(b, group, tiled=True),
        "psum_scatter": lax.psum_scatter(b, group, tiled=True),
        "ppermute": lax.ppermute(b, group, ring),
        "all_to_all": lax.all_to_all(b, group, 0, 0, tiled=True),
        "axis_index": b * 0 + tf.cast(lax.axis_index(group), tf.float32),
    }
  return f


def _every_collective(report, label, mesh, spec, part):
  """Runs `_collectives_over` each axis of `mesh` and all of them at once."""
  names = mesh.axis_names
  groups = [(name,) for name in names] + ([names] if len(names) > 1 else [])
  for group in groups:
    count = int(np.prod([mesh.shape[name] for name in group]))
    key = f"{label}/{'+'.join(group)}"
    try:
      out = tfspmd.shard_map(_collectives_over(group, count), mesh=mesh,
                             in_specs=spec, out_specs=spec)(part)
      report[key] = {name: np.asarray(value).tolist()
                     for name, value in out.items()}
    except Exception as e:  # pylint: disable=broad-except
      report[key] = f"{type(e).__name__}: {e}"


def shard_map_processes():
  """shard_map over meshes of the devices of 2 processes x 4 devices.

  Each process passes its part of the global arrays the test names, and
  reports its part of each result (or the error it raised).
  """
  _initialize()
  me = tfspmd.process_index()
  devices = tfspmd.devices()
  P = tfspmd.P
  report = {}

  def attempt(key, thunk):
    try:
      report[key] = np.asarray(thunk()).tolist()
    except Exception as e:  # pylint: disable=broad-except
      report[key] = f"{type(e).__name__}: {e}"

  # (2, 4) with the process axis first: the part is half the rows.
  grid = tfspmd.make_mesh((2, 4), ("p", "d"))
  x = np.arange(128, dtype=np.float32).reshape(16, 8)
  rows = x[8 * me:8 * me + 8]
  _every_collective(report, "grid", grid, P("p", "d"), rows)
  # Global arrays from each process's part, and from a callback of blocks.
  by_rows = tfspmd.NamedSharding(grid, P("p", "d"))
  attempt("global/process_local", lambda: (
      tfspmd.make_array_from_process_local_data(by_rows, rows)))
  attempt("global/process_local_summed", lambda: tfspmd.shard_map(
      lambda b: lax.psum(b, "p"), mesh=grid, in_specs=P("p", "d"),
      out_specs=P(None, "d"))(
          tfspmd.make_array_from_process_local_data(by_rows, rows)))
  attempt("global/callback_summed", lambda: tfspmd.shard_map(
      lambda b: lax.psum(b, "p"), mesh=grid, in_specs=P("p", "d"),
      out_specs=P(None, "d"))(
          tfspmd.make_array_from_callback(x.shape, by_rows, lambda i: x[i])))
  # JAX's multihost_utils.
  hosts = multihost_utils
  attempt("multihost/allgather", lambda: hosts.process_allgather(
      np.array([me, 10 + me], np.int32)))
  attempt("multihost/allgather_tiled", lambda: hosts.process_allgather(
      {"v": np.full((2,), me * 1.5)}, tiled=True)["v"])
  attempt("multihost/broadcast", lambda: hosts.broadcast_one_to_all(
      np.float32(me + 5)))
  attempt("multihost/broadcast_from_1", lambda: hosts.broadcast_one_to_all(
      np.float32(me + 5), is_source=me == 1))
  attempt("multihost/sync", lambda: [hosts.sync_global_devices("here"), 1][1])
  attempt("multihost/sync_differs",
          lambda: hosts.sync_global_devices(f"barrier {me}"))
  # Leaves of other shapes, dtypes or trees in the two processes.
  attempt("multihost/other_dtypes", lambda: hosts.process_allgather(
      {"w": np.ones(2, [np.int32, np.float32][me])})["w"])
  attempt("multihost/other_shapes", lambda: hosts.process_allgather(
      [np.zeros(2), np.zeros(2 + me)]))
  attempt("multihost/other_trees", lambda: list(hosts.process_allgather(
      {"ab"[me]: np.zeros(2)}).values()))
  attempt("multihost/broadcast_other_shapes", lambda: hosts.broadcast_one_to_all(
      np.zeros((2, 1 + me), np.float32)))
  attempt("multihost/after_mismatch", lambda: hosts.process_allgather(
      np.int32(me)))
  bfloat16 = tf.bfloat16.as_numpy_dtype
  gathered = {}
  attempt("multihost/bfloat16", lambda: gathered.setdefault(
      "x", hosts.process_allgather(np.array([me + 0.5, 1.25], bfloat16))
  ).astype(np.float32))
  report["multihost/bfloat16_dtype"] = str(getattr(gathered.get("x"),
                                                   "dtype", None))
  attempt("multihost/broadcast_bfloat16", lambda: hosts.broadcast_one_to_all(
      np.array([me + 0.5], bfloat16), is_source=me == 1).astype(np.float32))
  attempt("multihost/round_trip", lambda: hosts.global_array_to_host_local_array(
      hosts.host_local_array_to_global_array(rows, grid, P("p", "d")), grid,
      P("p", "d")))
  w = np.arange(8, dtype=np.float32)  # not split over 'p': passed whole
  attempt("grid/replicated_input", lambda: tfspmd.shard_map(
      lambda b, c: b + c, mesh=grid, in_specs=(P("p", "d"), P("d")),
      out_specs=P("p", "d"))(rows, w))
  attempt("grid/out_without_p", lambda: tfspmd.shard_map(
      lambda b: lax.psum(b, "p"), mesh=grid, in_specs=P("p", "d"),
      out_specs=P(None, "d"))(rows))
  attempt("grid/total", lambda: tfspmd.shard_map(
      lambda b: lax.psum(tf.reduce_sum(b), ("p", "d")), mesh=grid,
      in_specs=P("p", "d"), out_specs=P())(rows))
  # A replicated input whose values differ between the processes.
  mine = np.array([me + 1.0], np.float32)
  attempt("grid/differing_psum", lambda: tfspmd.shard_map(
      lambda c: lax.psum(c, "p"), mesh=grid, in_specs=P(),
      out_specs=P())(mine))
  attempt("grid/differing_identity", lambda: tfspmd.shard_map(
      lambda c: c, mesh=grid, in_specs=P(), out_specs=P())(mine))
  # A result goes back in (as a DTensor, no copy), also with other specs.
  def round_trip():
    out = tfspmd.shard_map(lambda b: b * 2, mesh=grid, in_specs=P("p", "d"),
                           out_specs=P("p", "d"))(rows)
    return tfspmd.shard_map(lambda b: lax.psum(b, "p"), mesh=grid,
                            in_specs=P("p", None), out_specs=P(None))(out)
  attempt("grid/round_trip", round_trip)
  attempt("grid/result_shape", lambda: tfspmd.shard_map(
      lambda b: b, mesh=grid, in_specs=P("p", "d"),
      out_specs=P("p", "d"))(rows).shape.as_list())
  # Rows split over both axes: each device's block of 2 rows, in the part.
  double = tfspmd.shard_map(lambda b: b * 2, mesh=grid,
                            in_specs=P(("p", "d")), out_specs=P(("p", "d")))
  attempt("grid/merged_spec", lambda: repr(double(rows).sharding.spec))
  attempt("grid/merged_blocks", lambda: [
      [shard.device.id, shard.index[0].start, shard.data.numpy()[0, 0]]
      for shard in double(rows).addressable_shards])
  attempt("grid/merged_round_trip", lambda: double(double(rows)))

  # One axis over the 8 devices: the part is half the rows.
  line = tfspmd.make_mesh((8,), ("x",))
  y = np.arange(128, dtype=np.float32).reshape(64, 2)
  _every_collective(report, "line", line, P("x"), y[32 * me:32 * me + 32])
  attempt("line/replicated_input", lambda: tfspmd.shard_map(
      lambda b, c: b + tf.cast(lax.axis_index("x"), tf.float32) * c, mesh=line,
      in_specs=(P("x"), P()), out_specs=P("x"))(
          y[32 * me:32 * me + 32], np.float32(100.0)))

  # (4, 2) whose first axis crosses the processes: half the rows.
  tall = tfspmd.make_mesh((4, 2), ("a", "b"))
  z = np.arange(128, dtype=np.float32).reshape(32, 4)
  _every_collective(report, "tall", tall, P("a", "b"), z[16 * me:16 * me + 16])

  # (4, 2) whose second axis is the processes: half the columns.
  wide = tfspmd.Mesh(np.array(devices, dtype=object).reshape(2, 4).T,
                     ("d", "p"))
  _every_collective(report, "wide", wide, P("d", "p"), z[:, 2 * me:2 * me + 2])

  # Meshes and specs a process's part cannot follow.
  scattered = tfspmd.Mesh(np.array(devices, dtype=object)[
      [0, 1, 2, 4, 3, 5, 6, 7]].reshape(2, 4), ("p", "d"))
  attempt("error/not_a_block", lambda: tfspmd.shard_map(
      lambda b: b, mesh=scattered, in_specs=P(), out_specs=P())(w))
  attempt("error/part_not_divisible", lambda: tfspmd.shard_map(
      lambda b: b, mesh=line, in_specs=P("x"), out_specs=P("x"))(
          np.zeros(3, np.float32)))
  attempt("error/later_axis_crosses", lambda: tfspmd.shard_map(
      lambda b: b, mesh=grid, in_specs=P(("d", "p")), out_specs=P())(w))
  return report


def dead_peer():
  """Process 1 exits after joining; process 0 then needs it in a psum."""
  _initialize()
  me = tfspmd.process_index()
  if me == 1:
    print(json.dumps({"exited": True}), flush=True)
    os._exit(0)  # pylint: disable=protected-access
  time.sleep(1.0)  # Let the peer go.
  return _psum_of_ones_or_peer_failure()


def never_joined():
  """This process is the only one of its cluster that starts."""
  start = time.monotonic()
  try:
    _initialize()
  except TimeoutError as e:
    return {"error": type(e).__name__, "message": str(e),
            "seconds": time.monotonic() - start}
  return {"error": None}


def initialize_error():
  """Reports the error `initialize` raises, and how long it took."""
  start = time.monotonic()
  try:
    _initialize()
  except (ValueError, OSError, TimeoutError) as e:
    return {"error": type(e).__name__, "message": str(e),
            "seconds": time.monotonic() - start}
  return {"error": None}


def disagreeing_sizes():
  """Process 0 passes 2 rows to a psum, process 1 one row."""
  _initialize()
  rows = 2 if tfspmd.process_index() == 0 else 1
  try:
    out = tfspmd.pmap(lambda v: lax.psum(v, "i"), axis_name="i")(
        np.ones((rows, 3), np.float32))
    value = np.asarray(out).tolist()
  except (ValueError, RuntimeError) as e:
    return {"error": type(e).__name__, "message": str(e)}
  return {"error": None, "value": value}


def disagreeing_order():
  """Two pmaps called in another order, then devices= lists in another order."""
  _initialize()
  me = tfspmd.process_index()
  total = tfspmd.pmap(lambda v: lax.psum(v, "i"), axis_name="i")
  largest = tfspmd.pmap(lambda v: lax.pmax(v, "i"), axis_name="i")
  x = np.arange(4, dtype=np.float32).reshape(2, 2) + 10 * me
  report = {}
  try:
    for f in (total, largest) if me == 0 else (largest, total):
      np.asarray(f(x))
    report["order"] = None
  except ValueError as e:
    report["order"] = str(e)
  devices = tfspmd.devices()
  listed = devices if me == 0 else devices[2:] + devices[:2]
  try:
    np.asarray(tfspmd.pmap(lambda v: lax.axis_index("i"), axis_name="i",
                           devices=listed)(x))
    report["devices"] = None
  except ValueError as e:
    report["devices"] = str(e)
  return report


def finishes_early():
  """Process 1 finishes its program without the psum process 0 calls."""
  _initialize()
  if tfspmd.process_index() == 1:
    return {"finished": True}
  return _psum_of_ones_or_peer_failure()


def _psum_of_ones_or_peer_failure():
  """A psum's value, or the PeerFailedError it raised and how long that took."""
  start = time.monotonic()
  try:
    out = tfspmd.pmap(lambda x: lax.psum(x, "i"), axis_name="i")(tf.ones(2))
    # The call may return before its collective finishes: read the result.
    value = np.asarray(out).tolist()
  except tfspmd.distributed.PeerFailedError as e:
    return {"error": type(e).__name__, "message": str(e),
            "seconds": time.monotonic() - start}
  return {"error": None, "value": value}


def gpu_pair():
  """Two processes on one host, one GPU each (`local_device_ids`)."""
  me = int(os.environ["DTENSOR_CLIENT_ID"])
  tfspmd.distributed.initialize(
      local_device_ids=[me], backend="gpu",
      initialization_timeout=float(os.environ["WORKER_INIT_TIMEOUT"]),
      heartbeat_timeout=float(os.environ["WORKER_HEARTBEAT_TIMEOUT"]))
  out = tfspmd.pmap(lambda x: x + lax.psum(x, "i"), axis_name="i")(
      np.array([float(me)], np.float32))
  return {"out": np.asarray(out).tolist(),
          "platforms": sorted({d.platform for d in tfspmd.devices()}),
          "device_count": tfspmd.device_count(),
          "shard_device": out.addressable_shards[0].data.device}


def jax_options_and_shutdown():
  """initialize with JAX's option names, one psum, then shutdown."""
  tfspmd.distributed.initialize(
      os.environ["WORKER_COORDINATOR"],
      int(os.environ["WORKER_NUM_PROCESSES"]),
      int(os.environ["WORKER_PROCESS_ID"]),
      cluster_detection_method="deactivate",
      initialization_timeout=float(os.environ["WORKER_INIT_TIMEOUT"]),
      heartbeat_timeout_seconds=float(os.environ["WORKER_HEARTBEAT_TIMEOUT"]),
      shutdown_timeout_seconds=30,
      coordinator_bind_address=os.environ["WORKER_BIND_ADDRESS"])
  out = multiprocess_psum.x_plus_psum()
  report = {"out": np.asarray(out).tolist()}
  tfspmd.distributed.shutdown()
  report["initialized_after_shutdown"] = tfspmd.distributed.is_initialized()
  tfspmd.distributed.shutdown()  # a second call does nothing, as in JAX
  return report


def keras_classifier_and_data():
  """`(compiled model, x, y)`: a seeded classifier and 64 examples.

  The test trains the same on one device as the reference.
  """
  import keras  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(1)
  model = keras.Sequential([
      keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
      keras.layers.Dense(3)])
  model.compile(optimizer=keras.optimizers.Adam(0.01),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True))
  rng = np.random.default_rng(0)
  x = rng.standard_normal((64, 5)).astype(np.float32)
  y = rng.integers(0, 3, 64).astype(np.int32)
  return model, x, y


def keras_data_parallel():
  """A Keras model's own fit, data-parallel over both processes' devices.

  Every process passes the same global arrays; each keeps its share of
  every batch. The weights after training are reported.
  """
  _initialize()
  from tfspmd.adapters import data_parallel  # pylint: disable=g-import-not-at-top
  model, x, y = keras_classifier_and_data()
  history = data_parallel(model).fit(x, y, batch_size=32, epochs=2,
                                     shuffle=False, verbose=0)
  return {"process_index": tfspmd.process_index(),
          "loss": history.history["loss"],
          "weights": [w.tolist() for w in model.get_weights()]}


def jit_over_processes():
  """A tfspmd.jit of a shard_map over the devices of every process.

  Global arrays from each process's rows and from a callback of blocks go
  into one jitted step (a shard_map that multiplies each block of rows by
  the weights and sums over the process axis; the callback's array, split
  over both axes, is laid out by rows inside), whose result every process
  reads whole with process_allgather. `JIT_ROWS` rows per process.
  """
  _initialize()
  me, count = tfspmd.process_index(), tfspmd.process_count()
  rows = int(os.environ.get("JIT_ROWS", "8"))
  P = tfspmd.P
  mesh = tfspmd.make_mesh((count, tfspmd.local_device_count()), ("p", "d"))
  x = np.arange(count * rows * 8, dtype=np.float32).reshape(count * rows, 8)
  w = (np.arange(64, dtype=np.float32).reshape(8, 8) % 7) / 7.
  by_rows = tfspmd.NamedSharding(mesh, P("p"))
  local = tfspmd.make_array_from_process_local_data(
      by_rows, x[rows * me:rows * (me + 1)])
  from_callback = tfspmd.make_array_from_callback(
      x.shape, tfspmd.NamedSharding(mesh, P("p", "d")), lambda index: x[index])

  @tfspmd.jit
  def step(a, b, weights):
    mixed = tfspmd.shard_map(
        lambda u, v, m: lax.psum(tf.matmul(u, m) + v, "p"), mesh=mesh,
        in_specs=(P("p"), P("p"), P()), out_specs=P())(a, b, weights)
    return mixed, tf.reduce_sum(mixed)

  mixed, total = step(local, from_callback, w)
  return {"process_index": me,
          "mixed": multihost_utils.process_allgather(mixed, tiled=True).tolist(),
          "total": float(np.asarray(total)),
          "local_shape": list(np.asarray(mixed).shape)}


def without_initialize():
  """DTENSOR_JOBS names two processes, but initialize is not called."""
  try:
    tfspmd.devices()
  except RuntimeError as e:
    return {"error": type(e).__name__, "message": str(e)}
  return {"error": None}


if __name__ == "__main__":
  result = {"seed": seed, "nested": nested, "collectives": collectives,
            "nested_across_processes": nested_across_processes,
            "nested_not_a_block": nested_not_a_block,
            "shard_map_processes": shard_map_processes,
            "jit_over_processes": jit_over_processes,
            "dead_peer": dead_peer,
            "never_joined": never_joined, "gpu_pair": gpu_pair,
            "initialize_error": initialize_error,
            "disagreeing_sizes": disagreeing_sizes,
            "disagreeing_order": disagreeing_order,
            "finishes_early": finishes_early,
            "jax_options_and_shutdown": jax_options_and_shutdown,
            "keras_data_parallel": keras_data_parallel,
            "without_initialize": without_initialize}[sys.argv[1]]()
  print(json.dumps(result), flush=True)
  if sys.argv[1] == "jax_options_and_shutdown":
    # Out at once, past TensorFlow's exit barrier: shutdown alone must keep
    # process 0, which holds the cluster's coordination service, until the
    # others are done with it.
    os._exit(0)
