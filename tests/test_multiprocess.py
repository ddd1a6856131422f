"""Several real processes on localhost, joined by tfspmd.distributed.

Each scenario starts one Python process per cluster member running
multiprocess_worker.py, with the cluster in DTensor's variables and free
ports, and reads each one's JSON report. The processes are forked from one
that has imported TensorFlow and run nothing (`warm_python`), so each starts
TensorFlow's runtime and joins its cluster as a new process does. Every
child is killed (SIGKILL: TensorFlow's coordination service traps SIGTERM)
when the scenario ends, passes or not.
"""

import json
import os
import re
import socket
import subprocess
import tempfile
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from tfspmd._src.multiprocess import rendezvous

import multiprocess_worker
import warm_python

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "multiprocess_worker.py")
# The directory holding the tfspmd and examples packages, for the children.
SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(
    tfspmd.__file__)))
# Two cores run every child's TensorFlow import at once: be generous with
# joining, strict with the faults under test.
JOIN_TIMEOUT = 120
SCENARIO_TIMEOUT = 240


def _free_addresses(count):
  """`localhost:port` for `count` ports free now (bound together, then let go)."""
  sockets = [socket.socket() for _ in range(count)]
  try:
    for s in sockets:
      s.bind(("localhost", 0))
    return [f"localhost:{s.getsockname()[1]}" for s in sockets]
  finally:
    for s in sockets:
      s.close()


def _run(scenarios, *, devices, init_timeout=JOIN_TIMEOUT,
         heartbeat_timeout=10):
  """Runs the processes `scenarios` lists at once; returns their reports.

  Args:
    scenarios: One `(name, process_id, addresses[, env])` per process to
      start; a process of `addresses` that no entry names never starts.
      With `addresses` None, the cluster comes from `env` alone (a
      coordinator address, or a launcher's variables).
    devices: Logical CPU devices per process.
    init_timeout: The children's `initialization_timeout`, seconds.
    heartbeat_timeout: The children's `heartbeat_timeout`, seconds.

  Returns:
    The report (a dict) of each entry, in order, with its wall time under
    "wall_seconds".
  """
  base = {k: v for k, v in os.environ.items() if not k.startswith("DTENSOR_")}
  base.update(
      TFSPMD_NUM_CPU_DEVICES=str(devices), TF_CPP_MIN_LOG_LEVEL="3",
      WORKER_INIT_TIMEOUT=str(init_timeout),
      WORKER_HEARTBEAT_TIMEOUT=str(heartbeat_timeout),
      PYTHONPATH=os.pathsep.join(
          [SOURCE_ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
  children = []
  with tempfile.TemporaryDirectory() as logs:
    try:
      start = time.monotonic()
      for k, (name, process_id, addresses, *extra) in enumerate(scenarios):
        env = dict(base, **(extra[0] if extra else {}))
        if addresses is not None:
          env.update(DTENSOR_JOBS=",".join(addresses),
                     DTENSOR_CLIENT_ID=str(process_id))
        out, err = (os.path.join(logs, f"{k}.{kind}") for kind in ("out", "err"))
        # Forked from a process that has imported TensorFlow: dozens of
        # scenarios would otherwise each spend seconds importing it.
        child = warm_python.shared().start(
            path=WORKER, argv=[WORKER, name], env=env, stdout=out, stderr=err)
        children.append((child, out, err))
      reports = []
      for child, out, err in children:
        left = SCENARIO_TIMEOUT - (time.monotonic() - start)
        try:
          child.wait(timeout=max(left, 1))
        except subprocess.TimeoutExpired:
          pytest.fail(f"a process did not finish within {SCENARIO_TIMEOUT}s; "
                      f"its stderr ends:\n{_tail(err)}")
        with open(out, encoding="utf-8") as printed:
          lines = printed.read().splitlines()
        if child.returncode != 0 or not lines:
          pytest.fail(f"a process exited with {child.returncode}; its stderr "
                      f"ends:\n{_tail(err)}")
        report = json.loads(lines[-1])
        report["wall_seconds"] = time.monotonic() - start
        reports.append(report)
      return reports
    finally:
      for child, _, _ in children:
        if child.poll() is None:
          child.kill()
          child.wait()


def _tail(path, lines=30):
  with open(path, encoding="utf-8", errors="replace") as f:
    return "\n".join(f.read().splitlines()[-lines:])


# --- two processes x 4 devices: the jax.pmap reference's example ----------


@pytest.fixture(scope="module")
def seed():
  addresses = _free_addresses(2)
  return _run([("seed", 0, addresses), ("seed", 1, addresses)], devices=4)


def test_two_processes_each_get_their_part_of_x_plus_psum(seed):
  assert seed[0]["out"] == [28, 29, 30, 31]
  assert seed[1]["out"] == [32, 33, 34, 35]
  assert [r["out_shape"] for r in seed] == [[4], [4]]
  assert [r["out_row_2"] for r in seed] == [30, 34]


def test_every_process_sees_all_devices_and_its_own(seed):
  for process, report in enumerate(seed):
    assert report["process_index"] == process
    assert report["process_count"] == 2
    assert report["devices"] == list(range(8))
    assert report["local_devices"] == list(range(4 * process, 4 * process + 4))
    assert report["shard_devices"] == report["local_devices"]
    assert all(f"/job:worker/replica:0/task:{process}/device:CPU:" in name
               for name in report["local_device_names"])


def test_collectives_span_the_devices_of_all_processes(seed):
  for process, report in enumerate(seed):
    assert report["gathered"] == list(range(28, 36))
    assert report["axis_size"] == [8] * 4
    assert report["axis_index"] == list(range(4 * process, 4 * process + 4))


def test_pmap_inside_a_tf_function_on_a_multi_process_result(seed):
  whole = np.arange(28, 36, dtype=np.float32)
  expected = whole - whole.mean()
  assert seed[0]["centered"] == expected[:4].tolist()
  assert seed[1]["centered"] == expected[4:].tolist()
  assert seed[0]["shifted"] == (expected[:4] + 2.).tolist()
  assert seed[1]["shifted"] == (expected[4:] + 2.).tolist()


def test_a_plain_tensor_into_a_tf_function_around_a_pmap_is_refused(seed):
  for report in seed:
    assert report["plain_in_tf_function"].startswith(
        "a tf.function that calls a pmap over several processes was given a "
        "plain tensor for argument `v`, which is only this process's part")


def test_devices_spanning_processes_map_over_the_local_ones(seed):
  # devices()[2:6]: two devices of each process; 2., 3. and 4., 5. passed.
  whole = np.array([2.0, 3.0, 4.0, 5.0])
  expected = whole / whole.sum()
  np.testing.assert_allclose(seed[0]["middle"], expected[:2])
  np.testing.assert_allclose(seed[1]["middle"], expected[2:])


def test_initialize_twice_raises(seed):
  assert seed[1]["second_initialize"] == (
      "tfspmd.distributed.initialize() was already called in this process "
      "(process 1 of 2); call it once.")


# --- started as JAX users start them: a coordinator address is enough ------


def _coordinated(port, count, process_id):
  return {"WORKER_COORDINATOR": f"localhost:{port}",
          "WORKER_NUM_PROCESSES": str(count),
          "WORKER_PROCESS_ID": str(process_id)}


def _port_in_launcher_range():
  """A free port among those a job id maps to, and that job id."""
  for port in range(61440 + 1000, 65536):
    with socket.socket() as probe:
      try:
        probe.bind(("", port))
      except OSError:
        continue
    return port, port - 61440
  pytest.skip("no free port in 61440..65535")


def _tf_config_of_a_chief_and_a_worker():
  """`((chief, worker) addresses, each process's environment)`: TF_CONFIG."""
  addresses = _free_addresses(2)
  cluster = {"chief": [addresses[0]], "worker": [addresses[1]]}
  envs = [{"TF_CONFIG": json.dumps({"cluster": cluster, "task": task})}
          for task in ({"type": "chief", "index": 0},
                       {"type": "worker", "index": 0})]
  return addresses, envs


def test_the_seed_example_started_from_tf_config():
  # As Vertex AI and Kubeflow start TensorFlow jobs: every task's address,
  # the chief first.
  (chief, worker), envs = _tf_config_of_a_chief_and_a_worker()
  reports = _run([("seed", k, None, envs[k]) for k in range(2)], devices=4)
  assert reports[0]["out"] == [28, 29, 30, 31]
  assert reports[1]["out"] == [32, 33, 34, 35]
  assert [r["process_index"] for r in reports] == [0, 1]
  assert reports[0]["gathered"] == list(range(28, 36))
  assert reports[0]["addresses"] == reports[1]["addresses"] == (
      f"{chief},{worker}")


def test_a_keras_models_own_fit_over_two_processes_equals_one_device_fit():
  # As a TensorFlow job is started: TF_CONFIG, then data_parallel(model)
  # and the model's own fit, each process giving the same global arrays.
  _, envs = _tf_config_of_a_chief_and_a_worker()
  reports = _run([("keras_data_parallel", k, None, envs[k])
                  for k in range(2)], devices=4)
  reference, x, y = multiprocess_worker.keras_classifier_and_data()
  expected = reference.fit(x, y, batch_size=32, epochs=2, shuffle=False,
                           verbose=0).history["loss"]
  assert [r["process_index"] for r in reports] == [0, 1]
  for report in reports:
    np.testing.assert_allclose(report["loss"], expected, rtol=1e-5)
    for got, want in zip(report["weights"], reference.get_weights()):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_jax_option_names_and_shutdown():
  # Process 0 listens on the bind address; the others reach it through the
  # coordinator's, here the same port on another name of this host.
  port = int(_free_addresses(1)[0].rsplit(":", 1)[1])
  envs = [dict(_coordinated(port, 2, k),
               WORKER_BIND_ADDRESS=f"127.0.0.1:{port}") for k in range(2)]
  reports = _run([("jax_options_and_shutdown", k, None, envs[k])
                  for k in range(2)], devices=4)
  assert reports[0]["out"] == [28, 29, 30, 31]
  assert reports[1]["out"] == [32, 33, 34, 35]
  assert [r["initialized_after_shutdown"] for r in reports] == [False, False]


@pytest.mark.parametrize("how", ["coordinator", "SLURM", "Open MPI"])
def test_the_seed_example_started_from_one_coordinator_address(how):
  # DTensor needs every process's address; the processes find each other
  # through process 0 (tfspmd/_src/multiprocess/rendezvous.py).
  if how == "coordinator":
    port = int(_free_addresses(1)[0].rsplit(":", 1)[1])
    envs = [_coordinated(port, 2, k) for k in range(2)]
  elif how == "SLURM":
    port, job_id = _port_in_launcher_range()
    envs = [{"SLURM_PROCID": str(k), "SLURM_NTASKS": "2",
             "SLURM_STEP_NODELIST": "localhost", "SLURM_JOB_ID": str(job_id)}
            for k in range(2)]
  else:
    port, job_id = _port_in_launcher_range()
    envs = [{"OMPI_COMM_WORLD_RANK": str(k), "OMPI_COMM_WORLD_SIZE": "2",
             "OMPI_MCA_orte_hnp_uri": f"{job_id}.0;tcp://127.0.0.1:1234"}
            for k in range(2)]
  reports = _run([("seed", k, None, envs[k]) for k in range(2)], devices=4)
  assert reports[0]["out"] == [28, 29, 30, 31]
  assert reports[1]["out"] == [32, 33, 34, 35]
  assert [r["process_index"] for r in reports] == [0, 1]
  assert reports[0]["gathered"] == list(range(28, 36))
  addresses = reports[0]["addresses"].split(",")
  assert reports[1]["addresses"] == reports[0]["addresses"]
  # Process 0 serves DTensor on a port of its own, not the coordinator's.
  assert len(set(addresses)) == 2 and all(
      int(a.rsplit(":", 1)[1]) != port for a in addresses)


def test_a_process_that_never_registers_is_named_by_the_coordinator():
  port = int(_free_addresses(1)[0].rsplit(":", 1)[1])
  (coordinator,) = _run([("never_joined", 0, None, _coordinated(port, 3, 0))],
                        devices=2, init_timeout=4)
  assert coordinator["error"] == "TimeoutError"
  assert coordinator["message"] == (
      f"tfspmd.distributed.initialize: process(es) [1, 2] of 3 did not "
      f"register with the coordinator at localhost:{port} within 4 s; start "
      f"every process with the same coordinator_address and num_processes.")
  assert coordinator["seconds"] < 4 + 5


def test_a_coordinator_that_never_answers_is_named():
  port = int(_free_addresses(1)[0].rsplit(":", 1)[1])
  (follower,) = _run([("never_joined", 1, None, _coordinated(port, 2, 1))],
                     devices=2, init_timeout=4)
  assert follower["error"] == "TimeoutError"
  assert follower["message"].startswith(
      f"tfspmd.distributed.initialize: process 1 could not reach the "
      f"coordinator (process 0) at localhost:{port} within 4 s")
  assert follower["seconds"] < 4 + 5


def _exchange(port, members):
  """Runs the coordinator exchange of `members` in threads; their outcomes.

  The exchange is plain TCP before TensorFlow starts, so threads of this
  process stand for the processes (seconds faster than starting them).

  Args:
    port: The coordinator's port.
    members: One `(num_processes, process_id)` per participant.

  Returns:
    Per member, its list of addresses or the exception it raised.
  """
  outcomes = [None] * len(members)

  def join(k, num_processes, process_id):
    try:
      outcomes[k] = rendezvous.exchange_addresses(
          f"localhost:{port}", num_processes, process_id, 30)
    except (ValueError, OSError) as e:  # TimeoutError is an OSError
      outcomes[k] = e

  threads = [threading.Thread(target=join, args=(k, *member))
             for k, member in enumerate(members)]
  for thread in threads:
    thread.start()
    time.sleep(0.2)  # process 0 listens first, as it would in time
  for thread in threads:
    thread.join(timeout=60)
  return outcomes


def test_processes_that_disagree_on_num_processes_all_fail_at_once():
  port = int(_free_addresses(1)[0].rsplit(":", 1)[1])
  start = time.monotonic()
  outcomes = _exchange(port, [(2, 0), (3, 1)])
  assert time.monotonic() - start < 10  # not the 30 s timeout
  for outcome in outcomes:
    assert type(outcome) is ValueError  # pylint: disable=unidiomatic-typecheck
    assert str(outcome) == (
        "tfspmd.distributed.initialize: process 1 was started with "
        "num_processes=3, the coordinator (process 0) with num_processes=2; "
        "give every process the same num_processes.")


def test_two_processes_with_one_process_id_all_fail_at_once():
  port = int(_free_addresses(1)[0].rsplit(":", 1)[1])
  start = time.monotonic()
  outcomes = _exchange(port, [(3, 0), (3, 1), (3, 1)])
  assert time.monotonic() - start < 10
  for outcome in outcomes:
    assert type(outcome) is ValueError  # pylint: disable=unidiomatic-typecheck
    assert str(outcome) == (
        "tfspmd.distributed.initialize: two processes registered as process "
        "1; give each process its own process_id (0..2).")


def test_a_second_process_0_is_told_the_coordinator_port_is_taken():
  with socket.socket() as first:
    first.bind(("", 0))
    first.listen(1)
    (outcome,) = _exchange(first.getsockname()[1], [(2, 0)])
  assert type(outcome) is OSError  # pylint: disable=unidiomatic-typecheck
  assert "process 0 cannot listen on the coordinator's port" in str(outcome)
  assert "another process was also started with process_id=0" in str(outcome)


@pytest.fixture(scope="module")
def disagreeing_programs():
  """Joined processes that disagree, started at once.

  A pair of 2 and 1 devices; a pair passing 2 and 1 rows to one psum; a
  pair whose process 1 finishes without the psum process 0 calls (with a
  12 s initialization_timeout, which bounds TensorFlow's shutdown barrier).
  """
  counts, sizes, early, order = (_free_addresses(2) for _ in range(4))
  quick = {"WORKER_INIT_TIMEOUT": "12"}
  reports = _run(
      [("initialize_error", 0, counts),
       ("initialize_error", 1, counts, {"TFSPMD_NUM_CPU_DEVICES": "1"}),
       ("disagreeing_sizes", 0, sizes), ("disagreeing_sizes", 1, sizes),
       ("finishes_early", 0, early, quick),
       ("finishes_early", 1, early, quick),
       ("disagreeing_order", 0, order), ("disagreeing_order", 1, order)],
      devices=2)
  return reports[:2], reports[2:4], reports[4:6], early, reports[6:]


def test_processes_with_other_device_counts_fail_in_initialize(
    disagreeing_programs):
  counts, _, _, _, _ = disagreeing_programs
  for report in counts:
    assert report["error"] == "ValueError"
    assert report["message"] == (
        "tfspmd.distributed.initialize: the processes have different numbers "
        "of CPU devices: process 0 has 2, process 1 has 1. A pmap maps over "
        "as many devices in every process: give the same "
        "TFSPMD_NUM_CPU_DEVICES in every process's environment (or "
        "tfspmd.set_num_cpu_devices), and restart every process.")


def test_processes_passing_other_mapped_sizes_get_a_value_error(
    disagreeing_programs):
  _, sizes, _, _, _ = disagreeing_programs
  # Found when the program is traced, before any collective runs.
  for me, report in enumerate(sizes):
    assert report["error"] == "ValueError"
    assert re.fullmatch(
        rf"The processes disagree on this pmapped call: the pmapped program "
        rf"number 1 of process {me} is (.*), that of process {1 - me} is "
        rf"(.*)\. Every process must call the same pmaps in the same order, "
        rf"with the same devices= list, mapped size, per-device shapes and "
        rf"dtypes \(docs/multiprocess\.md\)\.", report["message"]), (
            report["message"])
    assert "a mesh of 4 on devices [0, 1, 2, 3], inputs (float32[4, 3])" in (
        report["message"])
    assert "inputs (float32[2, 3])" in report["message"]


def test_a_process_that_finishes_without_a_pmap_fails_the_others(
    disagreeing_programs):
  _, _, (waiting, finished), early, _ = disagreeing_programs
  assert finished["finished"]
  assert waiting["error"] == "PeerFailedError"
  assert waiting["message"].startswith(
      f"process 1 ({early[1]}) exited or stopped answering while process 0 "
      f"waited for it to trace the same pmapped program: it finished early")
  assert waiting["seconds"] < 12 + 15


def test_pmaps_called_in_another_order_or_over_other_device_lists(
    disagreeing_programs):
  *_, reports = disagreeing_programs
  for me, report in enumerate(reports):
    # psum's and pmax's lambdas share a name; their ops tell them apart.
    assert report["order"] is not None
    assert report["order"].startswith(
        f"The processes disagree on this pmapped call: the pmapped program "
        f"number 1 of process {me} is pmap of disagreeing_order.<locals>."
        f"<lambda> over axis 'i', a mesh of 4 on devices [0, 1, 2, 3], "
        f"inputs (float32[4, 2]), ops "), report["order"]
    assert report["devices"] is not None
    assert "number 2 of process" in report["devices"]
    assert "on devices [0, 1, 2, 3]" in report["devices"]
    assert "on devices [2, 3, 0, 1]" in report["devices"]


# --- four processes x 2 devices: nested pmaps -----------------------------


@pytest.fixture(scope="module")
def nested():
  port = int(_free_addresses(1)[0].rsplit(":", 1)[1])
  return _run([("nested", k, None, _coordinated(port, 4, k))
               for k in range(4)], devices=2)


def test_nested_normalize_over_four_processes(nested):
  x = np.arange(8.0).reshape((4, 2))
  rows = x / x.sum(0)
  cols = x / x.sum(1, keepdims=True)
  both = x / x.sum()
  for process, report in enumerate(nested):
    assert report["shape"] == [1, 2]
    np.testing.assert_allclose(report["rows"], rows[process:process + 1])
    np.testing.assert_allclose(report["cols"], cols[process:process + 1])
    np.testing.assert_allclose(report["both"], both[process:process + 1])


def test_nested_axes_index_the_outer_axis_across_processes(nested):
  for process, report in enumerate(nested):
    assert report["linear_index"] == [[2 * process, 2 * process + 1]]


@pytest.fixture(scope="module")
def nested_across():
  port = int(_free_addresses(1)[0].rsplit(":", 1)[1])
  return _run([("nested_across_processes", k, None, _coordinated(port, 4, k))
               for k in range(4)], devices=2)


def _check_nested_collectives(reports, blocks, part, prefix=""):
  """Each report's nested collectives against NumPy on the global `blocks`.

  `blocks` has the grid's shape ('o', 'i') first, then a device's block;
  `part(whole, k)` is process k's block of a global result; the reports'
  keys are the groups' names after `prefix`.
  """
  for group in (("i",), ("o",), ("o", "i")):
    key = "+".join(group)
    for name, rule in _RULES.items():
      whole = _per_device(blocks, ("o", "i"), group, rule)
      for k, report in enumerate(reports):
        got = report[prefix + key]
        assert isinstance(got, dict), got
        np.testing.assert_allclose(got[name], part(whole, k), rtol=1e-6,
                                   err_msg=f"{key} {name} {k}")


def test_every_collective_of_nested_pmaps_whose_inner_axis_crosses_processes(
    nested_across):
  # Outer 2 x inner 4 over 4 processes x 2 devices: process k holds 'o'
  # position k // 2 and 'i' positions 2 (k % 2) and 2 (k % 2) + 1.
  x = np.arange(128.0).reshape(2, 4, 8, 2)
  _check_nested_collectives(
      nested_across, x,
      lambda whole, k: whole[k // 2:k // 2 + 1, 2 * (k % 2):2 * (k % 2) + 2])


def test_a_process_passing_another_block_than_its_devices_hold(nested_across):
  for k, report in enumerate(nested_across):
    i = 2 * (k % 2)
    assert report["wrong_part"] == (
        f"pmap: with several processes the nested pmaps' axes 'o' (2) x 'i' "
        f"(4) form a grid over tfspmd.devices() in process order (outer axis "
        f"slowest), and process {k}'s devices lie at its positions "
        f"[({k // 2}, {i}), ({k // 2}, {i + 1})]: they hold [1, 2] positions "
        f"along the axes, but its inputs hold [2, 1]. Pass, for each mapped "
        f"input, arrays of leading shape (1, 2): the positions of its devices "
        f"along each axis, outermost first (docs/multiprocess.md).")


def test_a_crossing_axis_traces_a_new_signature_twice(nested_across):
  # Over this process's part (2 'i' positions) up to the nested pmap, then
  # over the global shapes (4); a known signature traces nothing.
  for report in nested_across:
    assert report["traced"] == [[[2, 8, 2], [4, 8, 2]],
                                [[2, 8, 1], [4, 8, 1]], []]


def test_a_crossing_axis_inside_a_tf_function(nested_across):
  x = np.arange(128.0).reshape(2, 4, 8, 2)
  for k, report in enumerate(nested_across):
    # psum over 'i' twice: 4 times the sum over 'i' of process k's row.
    expected = 4 * x[k // 2].sum(0)
    assert len(report["in_tf_function"]) == 2
    for block in report["in_tf_function"]:
      np.testing.assert_allclose(block, expected[None, None], rtol=1e-6)


def test_nested_pmaps_whose_grid_is_no_block_of_each_process_are_an_error():
  port = int(_free_addresses(1)[0].rsplit(":", 1)[1])
  reports = _run([("nested_not_a_block", k, None, _coordinated(port, 2, k))
                  for k in range(2)], devices=3)
  held = {0: "[(0, 0), (0, 1), (1, 0)]", 1: "[(1, 1), (2, 0), (2, 1)]"}
  for k, report in enumerate(reports):
    assert report["not_a_block"] == (
        f"pmap: with several processes the nested pmaps' axes 'r' (3) x 'c' "
        f"(2) form a grid over tfspmd.devices() in process order (outer axis "
        f"slowest), and process {k}'s devices lie at its positions "
        f"{held[k]}: they are not a block of it (every combination of their "
        f"positions along the axes), so its part of an array would not be an "
        f"array. Choose sizes for which each process's 3 devices are a "
        f"block: the product of the innermost sizes times a divisor of the "
        f"next one out (docs/multiprocess.md).")
    assert report["too_many"].endswith(
        "With several processes each process passes, for each mapped input, "
        "the block of the global array its own devices hold: this process's "
        "inputs hold 6 positions of the nested pmaps' grid, but it has 3 "
        "devices. Pass the positions of its devices only, and give a nested "
        "pmap whose axis crosses processes its global size as axis_size= "
        "(docs/multiprocess.md); or use tfspmd.shard_map over a "
        "tfspmd.make_mesh of tfspmd.devices()."), report["too_many"]


# --- two processes x 4 devices: shard_map over meshes of both --------------


@pytest.fixture(scope="module")
def shard_map_reports():
  port = int(_free_addresses(1)[0].rsplit(":", 1)[1])
  return _run([("shard_map_processes", k, None, _coordinated(port, 2, k))
               for k in range(2)], devices=4)


def _per_device(blocks, names, group, rule):
  """Each device's result: `rule(blocks of its group, in order, its index)`.

  `blocks` has the mesh's shape first, then a block's; `group` names the
  mesh axes a collective spans, major first.
  """
  mesh_shape = blocks.shape[:len(names)]
  where = [names.index(name) for name in group]
  sizes = [mesh_shape[k] for k in where]
  results = []
  for position in np.ndindex(mesh_shape):
    members = []
    for member in np.ndindex(*sizes):
      at = list(position)
      for k, m in zip(where, member):
        at[k] = m
      members.append(blocks[tuple(at)])
    index = int(np.ravel_multi_index([position[k] for k in where], sizes))
    results.append(rule(members, index))
  return np.stack(results).reshape(mesh_shape + results[0].shape)


_RULES = {
    "psum": lambda ms, i: np.sum(ms, 0),
    "pmean": lambda ms, i: np.mean(ms, 0),
    "pmax": lambda ms, i: np.max(ms, 0),
    "pmin": lambda ms, i: np.min(ms, 0),
    "all_gather": lambda ms, i: np.concatenate(ms, 0),
    "psum_scatter": lambda ms, i: np.split(np.sum(ms, 0), len(ms))[i],
    "ppermute": lambda ms, i: ms[(i - 1) % len(ms)],
    "all_to_all": lambda ms, i: np.concatenate(
        [np.split(m, len(ms))[i] for m in ms], 0),
    "axis_index": lambda ms, i: np.full_like(ms[i], i),
}


def _blocks(x, mesh_shape):
  """The blocks of the 2-D `x` split over a 1-D or 2-D mesh, mesh axes first."""
  rows, cols = (mesh_shape + (1,))[:2]
  split = x.reshape(rows, x.shape[0] // rows, cols, x.shape[1] // cols)
  return split.transpose(0, 2, 1, 3).reshape(mesh_shape + split.shape[1::2])


def _joined(per_device, mesh_shape):
  """The global array of 2-D per-device blocks laid out as `_blocks` splits."""
  rows, cols = (mesh_shape + (1,))[:2]
  grid = per_device.reshape((rows, cols) + per_device.shape[-2:])
  return grid.transpose(0, 2, 1, 3).reshape(
      rows * grid.shape[2], cols * grid.shape[3])


# Each mesh of the scenario: its shape, axis names, the global input, and
# process k's part of a 2-D global array (half the rows, or half the columns
# where the processes lie along the second axis).
_MESHES = {
    "grid": ((2, 4), ("p", "d"), np.arange(128.0).reshape(16, 8),
             lambda a, k: np.split(a, 2, 0)[k]),
    "line": ((8,), ("x",), np.arange(128.0).reshape(64, 2),
             lambda a, k: np.split(a, 2, 0)[k]),
    "tall": ((4, 2), ("a", "b"), np.arange(128.0).reshape(32, 4),
             lambda a, k: np.split(a, 2, 0)[k]),
    "wide": ((4, 2), ("d", "p"), np.arange(128.0).reshape(32, 4),
             lambda a, k: np.split(a, 2, 1)[k]),
}


@pytest.mark.parametrize("label", sorted(_MESHES))
def test_every_collective_of_a_shard_map_over_two_processes(
    shard_map_reports, label):
  mesh_shape, names, x, part = _MESHES[label]
  blocks = _blocks(x, mesh_shape)
  groups = [(n,) for n in names] + ([names] if len(names) > 1 else [])
  for group in groups:
    key = f"{label}/{'+'.join(group)}"
    for name, rule in _RULES.items():
      whole = _joined(_per_device(blocks, names, group, rule), mesh_shape)
      for k, report in enumerate(shard_map_reports):
        assert isinstance(report[key], dict), report[key]
        np.testing.assert_allclose(report[key][name], part(whole, k),
                                   rtol=1e-6, err_msg=f"{key} {name} {k}")


def test_a_shard_map_input_not_split_over_processes_is_passed_whole(
    shard_map_reports):
  x = np.arange(128.0).reshape(16, 8)
  w = np.arange(8.0)
  y = np.arange(128.0).reshape(64, 2)
  for k, report in enumerate(shard_map_reports):
    np.testing.assert_allclose(report["grid/replicated_input"],
                               (x + w)[8 * k:8 * k + 8])
    np.testing.assert_allclose(
        report["line/replicated_input"],
        (y + 100.0 * np.repeat(np.arange(8.0), 8)[:, None])[32 * k:32 * k + 32])


def test_global_arrays_from_each_processs_part_or_a_callback(
    shard_map_reports):
  # make_array_from_process_local_data and make_array_from_callback: each
  # process gives its rows; a psum over 'p' then adds the two processes'.
  x = np.arange(128.0).reshape(16, 8)
  for k, report in enumerate(shard_map_reports):
    np.testing.assert_allclose(report["global/process_local"],
                               x[8 * k:8 * k + 8])
    for key in ("global/process_local_summed", "global/callback_summed"):
      np.testing.assert_allclose(report[key], x[:8] + x[8:], err_msg=key)


def test_multihost_utils_gather_broadcast_and_wait_across_processes(
    shard_map_reports):
  x = np.arange(128.0).reshape(16, 8)
  for k, report in enumerate(shard_map_reports):
    assert report["multihost/allgather"] == [[0, 10], [1, 11]]
    assert report["multihost/allgather_tiled"] == [0.0, 0.0, 1.5, 1.5]
    assert report["multihost/broadcast"] == 5.0
    assert report["multihost/broadcast_from_1"] == 6.0
    assert report["multihost/sync"] == 1
    assert report["multihost/sync_differs"].startswith(
        f"ValueError: sync_global_devices('barrier {k}'): processes "
        f"[{1 - k}] reached a barrier of another name")
    np.testing.assert_allclose(report["multihost/round_trip"],
                               x[8 * k:8 * k + 8])


def test_multihost_utils_name_the_leaf_processes_pass_otherwise(
    shard_map_reports):
  # Values cross as raw bytes: a leaf of another dtype, shape or tree in
  # one process is an error in every process, not bytes reinterpreted.
  dtypes = ["int32", "float32"]
  for k, report in enumerate(shard_map_reports):
    other = 1 - k
    assert report["multihost/other_dtypes"] == (
        f"ValueError: process_allgather: process {other} passes "
        f"in_tree['w'] of shape (2,) and dtype {dtypes[other]}, where "
        f"process {k} passes shape (2,) and dtype {dtypes[k]}; every process "
        f"must pass process_allgather the same tree structure, and leaves of "
        f"the same shapes and dtypes (pad to one shape, cast to one dtype).")
    assert report["multihost/other_shapes"].startswith(
        f"ValueError: process_allgather: process {other} passes in_tree[1] "
        f"of shape ({2 + other},) and dtype float64, where process {k} "
        f"passes shape ({2 + k},) and dtype float64;")
    assert report["multihost/other_trees"].startswith(
        f"ValueError: process_allgather: process {other} passes a tree of "
        f"structure PyTreeSpec({{'{'ab'[other]}': *}}), where process {k} "
        f"passes PyTreeSpec({{'{'ab'[k]}': *}});")
    assert report["multihost/broadcast_other_shapes"].startswith(
        f"ValueError: broadcast_one_to_all: process {other} passes in_tree "
        f"of shape (2, {1 + other}) and dtype float32, where process {k} "
        f"passes shape (2, {1 + k}) and dtype float32;")
    assert report["multihost/after_mismatch"] == [0, 1]


def test_multihost_utils_exchange_bfloat16(shard_map_reports):
  bfloat16 = tf.bfloat16.as_numpy_dtype
  expected = np.array([[0.5, 1.25], [1.5, 1.25]], bfloat16)
  for report in shard_map_reports:
    assert report["multihost/bfloat16_dtype"] == "bfloat16"
    np.testing.assert_array_equal(report["multihost/bfloat16"],
                                  expected.astype(np.float32))
    assert report["multihost/broadcast_bfloat16"] == [1.5]


def test_a_shard_map_result_not_split_over_processes_is_whole_everywhere(
    shard_map_reports):
  x = np.arange(128.0).reshape(16, 8)
  for report in shard_map_reports:
    np.testing.assert_allclose(report["grid/out_without_p"],
                               x[:8] + x[8:])
    np.testing.assert_allclose(report["grid/total"], x.sum())


def test_a_shard_map_result_goes_back_in_as_the_global_array(
    shard_map_reports):
  x = np.arange(128.0).reshape(16, 8)
  for report in shard_map_reports:
    assert report["grid/result_shape"] == [8, 8]
    np.testing.assert_allclose(report["grid/round_trip"], 2 * (x[:8] + x[8:]))


def test_a_dimension_split_over_both_axes_gives_each_process_its_rows(
    shard_map_reports):
  x = np.arange(128.0).reshape(16, 8)
  for k, report in enumerate(shard_map_reports):
    assert report["grid/merged_spec"] == "PartitionSpec(('p', 'd'))"
    # The device at (p, d) = (k, j), id 4 k + j, holds global block 4 k + j
    # of 2 rows: rows 2 j, 2 j + 1 of the process's part.
    assert report["grid/merged_blocks"] == [
        [4 * k + j, 2 * j, 2 * x[8 * k + 2 * j, 0]] for j in range(4)]
    np.testing.assert_allclose(report["grid/merged_round_trip"],
                               4 * x[8 * k:8 * k + 8])


def test_replicated_shard_map_inputs_that_differ_stay_each_process_own(
    shard_map_reports):
  for k, report in enumerate(shard_map_reports):
    # Each process's devices hold its value, and the program takes it as
    # the same along 'p': a psum of it there is 2 times this process's.
    assert report["grid/differing_psum"] == [2 * (k + 1.0)]
    assert report["grid/differing_identity"] == [k + 1.0]


def test_shard_map_meshes_and_specs_a_process_part_cannot_follow(
    shard_map_reports):
  for k, report in enumerate(shard_map_reports):
    assert report["error/not_a_block"].startswith(
        f"ValueError: shard_map: the devices of process {k} are not a block "
        f"of the mesh Mesh({{'p': 2, 'd': 4}}): they lie at positions ")
    assert report["error/part_not_divisible"] == (
        "ValueError: shard_map: this process's part of args[0] has size 3 "
        "along dimension 0, which the in spec PartitionSpec('x') splits into "
        "the blocks of this process's mesh positions (4 along 'x'): 3 is not "
        "divisible by 4. With several processes each passes its part of the "
        "global array (docs/multiprocess.md).")
    assert report["error/later_axis_crosses"] == (
        "ValueError: shard_map: in spec PartitionSpec(('d', 'p')) for args[0] "
        "splits dimension 0 over ('d', 'p'), and the later axis 'p' crosses "
        "processes; with several processes only the first axis splitting a "
        "dimension may. Name 'p' first there, or split another dimension "
        "over it.")


# --- eight processes x 1 device: every collective ---------------------------


def test_every_collective_over_eight_processes_of_one_device():
  port = int(_free_addresses(1)[0].rsplit(":", 1)[1])
  reports = _run([("collectives", k, None, _coordinated(port, 8, k))
                  for k in range(8)], devices=1)
  x = np.arange(64, dtype=np.float32).reshape(8, 8)
  expected = {
      "psum": np.broadcast_to(x.sum(0), (8, 8)),
      "pmean": np.broadcast_to(x.mean(0), (8, 8)),
      "pmax": np.broadcast_to(x.max(0), (8, 8)),
      "pmin": np.broadcast_to(x.min(0), (8, 8)),
      "all_gather": np.broadcast_to(x, (8, 8, 8)),
      "psum_scatter": x.sum(0),
      "ppermute": np.roll(x, 1, axis=0),
      "pshuffle": x[::-1],
      "all_to_all": x.T,
      "pswapaxes": x.T,
      "axis_index": np.arange(8.0)[:, None],
  }
  for name, whole in expected.items():
    got = np.concatenate([np.asarray(r[name]).reshape((1,) + whole.shape[1:])
                          for r in reports])
    np.testing.assert_allclose(got, whole, rtol=1e-6, err_msg=name)
  # Nested pmaps, outer 4 x inner 2: process k holds position k // 2 of 'o'
  # and k % 2 of 'i', and passes its row as a block of leading shape (1, 1).
  _check_nested_collectives(
      reports, x.reshape(4, 2, 8, 1),
      lambda whole, k: whole[k // 2:k // 2 + 1, k % 2:k % 2 + 1],
      prefix="nested/")


# --- GPUs ------------------------------------------------------------------


@pytest.mark.gpu
def test_two_processes_with_one_gpu_each():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  gpus = len(tf.config.list_physical_devices("GPU"))
  if gpus < 2:
    pytest.skip(f"needs 2 GPUs (one per process); this machine has {gpus}")
  addresses = _free_addresses(2)
  reports = _run([("gpu_pair", 0, addresses), ("gpu_pair", 1, addresses)],
                 devices=1)
  assert [r["out"] for r in reports] == [[1.0], [2.0]]
  for process, report in enumerate(reports):
    assert report["platforms"] == ["gpu"] and report["device_count"] == 2
    assert report["shard_device"].endswith(f"task:{process}/device:GPU:0")


# --- faults -----------------------------------------------------------------


def test_a_peer_that_exits_makes_the_collective_raise_peer_failed_error():
  addresses = _free_addresses(2)
  heartbeat = 5
  survivor, peer = _run(
      [("dead_peer", 0, addresses), ("dead_peer", 1, addresses)], devices=2,
      heartbeat_timeout=heartbeat)
  assert peer == {"exited": True, "wall_seconds": peer["wall_seconds"]}
  assert survivor["error"] == "PeerFailedError"
  # It is gone before process 0 traces the psum, or while its collective runs.
  assert re.match(
      rf"process 1 \({addresses[1]}\) exited or stopped answering while "
      rf"process 0 waited (on it in a collective|for it to trace the same "
      rf"pmapped program)", survivor["message"]), survivor["message"]
  # The connection is refused at once, or its heartbeats are missed.
  assert survivor["seconds"] < heartbeat + 10


@pytest.fixture(scope="module")
def alone():
  """Processes whose peers never start, started at once.

  Process 0 of one pair, process 1 of another, and a process of a third
  pair that does not call initialize.
  """
  first, second, third = (_free_addresses(2) for _ in range(3))
  reports = _run([("never_joined", 0, first), ("never_joined", 1, second),
                  ("without_initialize", 0, third)],
                 devices=2, init_timeout=3)
  return reports, first, second


def test_a_peer_that_never_starts_times_out_initialize(alone):
  (coordinator, _, _), first, _ = alone
  assert coordinator["error"] == "TimeoutError"
  assert coordinator["message"].startswith(
      f"tfspmd.distributed.initialize: process 1 ({first[1]}) did not join "
      f"within initialization_timeout=3.0s (this is process 0 of 2")
  assert coordinator["seconds"] < 3 + 10


def test_a_coordinator_that_never_starts_times_out_initialize(alone):
  (_, follower, _), _, second = alone
  assert follower["error"] == "TimeoutError"
  assert follower["message"].startswith(
      f"tfspmd.distributed.initialize: process 0 ({second[0]}) did not join")
  # The follower retries its registration once: up to twice the timeout.
  assert follower["seconds"] < 2 * 3 + 10


def test_devices_without_initialize_in_a_cluster_raises(alone):
  (_, _, report), _, _ = alone
  assert report["error"] == "RuntimeError"
  assert report["message"] == (
      "DTENSOR_JOBS names 2 processes, but the multi-process runtime was not "
      "started: call tfspmd.distributed.initialize() first thing in every "
      "process, before any TensorFlow op.")


def jit_over_processes_expected(count, rows):
  """What `jit_over_processes` computes, in NumPy."""
  x = np.arange(count * rows * 8, dtype=np.float32).reshape(count * rows, 8)
  w = (np.arange(64, dtype=np.float32).reshape(8, 8) % 7) / 7.
  blocks = [x[rows * k:rows * (k + 1)] for k in range(count)]
  mixed = sum(b @ w + b for b in blocks)
  return mixed, mixed.sum()


def test_a_jit_of_a_shard_map_over_two_processes_on_global_arrays():
  # Global arrays from each process's rows and from a callback, one
  # tfspmd.jit of a shard_map over both processes' devices, the result read
  # whole with process_allgather.
  port = int(_free_addresses(1)[0].rsplit(":", 1)[1])
  reports = _run([("jit_over_processes", k, None, _coordinated(port, 2, k))
                  for k in range(2)], devices=4)
  mixed, total = jit_over_processes_expected(2, 8)
  for k, report in enumerate(reports):
    assert report["process_index"] == k
    assert report["local_shape"] == [8, 8]
    np.testing.assert_allclose(report["mixed"], mixed, rtol=1e-5)
    np.testing.assert_allclose(report["total"], total, rtol=1e-5)
