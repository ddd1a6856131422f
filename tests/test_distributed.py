"""tfspmd.distributed in one process: the cluster description and the errors.

The multi-process behaviour itself is in test_multiprocess.py.
"""

import json

import pytest
import tensorflow as tf

import tfspmd
from tfspmd._src.core import multiprocess_hooks
from tfspmd._src.multiprocess import cluster
from tfspmd._src.multiprocess import distributed

TWO = ["h0:9000", "h1:9000"]


def test_addresses_and_process_id_from_arguments():
  found = cluster.resolve(process_addresses=TWO, process_id=1,
                          num_processes=2, coordinator_address="h0:9000",
                          environ={})
  assert found == cluster.Cluster(addresses=tuple(TWO), process_id=1,
                                  job_name="worker", source="process_addresses")


def test_dtensor_variables_describe_the_cluster():
  found = cluster.resolve(environ={"DTENSOR_JOBS": ",".join(TWO),
                                   "DTENSOR_CLIENT_ID": "1",
                                   "DTENSOR_NUM_CLIENTS": "2",
                                   "DTENSOR_JOB_NAME": "trainer"})
  assert (found.addresses, found.process_id, found.job_name) == (
      tuple(TWO), 1, "trainer")


def test_arguments_win_over_the_environment():
  found = cluster.resolve(process_addresses=TWO, process_id=0,
                          environ={"DTENSOR_JOBS": "a:1,b:2,c:3",
                                   "DTENSOR_CLIENT_ID": "2"})
  assert (found.addresses, found.process_id) == (tuple(TWO), 0)


def test_cloud_tpu_vm_hosts_get_the_default_port():
  found = cluster.resolve(on_tpu=True, environ={
      "TPU_WORKER_HOSTNAMES": "t0,t1,t2,t3", "TPU_WORKER_ID": "2"})
  assert found.addresses == ("t0:8476", "t1:8476", "t2:8476", "t3:8476")
  assert (found.process_id, found.source) == (2, "the Cloud TPU VM")


def test_tpu_hosts_take_the_port_of_coordinator_address():
  found = cluster.resolve(coordinator_address="t0:1234", on_tpu=True,
                          environ={"TPU_WORKER_HOSTNAMES": "t0,t1",
                                   "TPU_WORKER_ID": "0"})
  assert found.addresses == ("t0:1234", "t1:1234")


def test_nothing_found_is_one_process():
  found = cluster.resolve(environ={})
  assert (found.num_processes, found.process_id) == (1, 0)


@pytest.mark.parametrize("kwargs, environ, message", [
    (dict(num_processes=2), {}, r"num_processes=2, .* but neither a "
     r"coordinator address nor process addresses were given"),
    (dict(coordinator_address="h0:9000"), {}, r"coordinator_address="
     r"'h0:9000' was given without num_processes"),
    (dict(process_addresses=TWO), {}, r"lists 2 processes but nothing says "
     r"which one this is: pass process_id="),
    (dict(process_addresses=TWO, process_id=2), {}, r"process_id=2 is out of "
     r"range for the 2 processes of process_addresses"),
    (dict(process_addresses=TWO, process_id=0, num_processes=3), {},
     r"num_processes=3, but process_addresses lists 2"),
    (dict(process_addresses=TWO, process_id=0, coordinator_address="h1:9000"),
     {}, r"coordinator_address='h1:9000' is not process 0's address "
     r"'h0:9000'"),
    (dict(process_addresses=["h0", "h1:9000"], process_id=0), {},
     r"must be 'host:port', got 'h0'"),
    (dict(process_addresses=[]), {}, r"`process_addresses` is empty"),
    ({}, {"DTENSOR_JOBS": "a:1,b:2", "DTENSOR_CLIENT_ID": "0",
          "DTENSOR_NUM_CLIENTS": "3"},
     r"DTENSOR_NUM_CLIENTS=3, but DTENSOR_JOBS lists 2"),
    ({}, {"DTENSOR_JOBS": "a:1,b:2", "DTENSOR_CLIENT_ID": "one"},
     r"DTENSOR_CLIENT_ID must be an integer, got 'one'"),
])
def test_incomplete_or_inconsistent_clusters_are_errors(kwargs, environ,
                                                        message):
  with pytest.raises(ValueError, match=message):
    cluster.resolve(environ=environ, **kwargs)


def _tf_config(task_type, index, **jobs):
  return {"TF_CONFIG": json.dumps(
      {"cluster": jobs, "task": {"type": task_type, "index": index}})}


@pytest.mark.parametrize("task_type, index, process_id", [
    ("chief", 0, 0), ("worker", 0, 1), ("worker", 1, 2)])
def test_tf_config_lists_the_chief_then_the_workers(task_type, index,
                                                    process_id):
  found = cluster.resolve(environ=_tf_config(
      task_type, index, worker=["w0:2222", "w1:2222"], chief=["c0:2222"],
      ps=["p0:2222"], evaluator=["e0:2222"]))
  assert found.addresses == ("c0:2222", "w0:2222", "w1:2222")
  assert (found.process_id, found.source) == (process_id, "TF_CONFIG")


def test_tf_config_without_a_chief_numbers_the_workers():
  found = cluster.resolve(environ=_tf_config("worker", 1, worker=TWO))
  assert (found.addresses, found.process_id) == (tuple(TWO), 1)


def test_tf_config_of_one_task_is_one_process():
  found = cluster.resolve(environ=_tf_config("chief", 0, chief=["c0:2222"]))
  assert (found.num_processes, found.process_id) == (1, 0)


@pytest.mark.parametrize("index", ["1", 1.0, " 1"])
def test_a_tf_config_task_index_as_tensorflow_reads_it(index):
  found = cluster.resolve(environ=_tf_config("worker", index, worker=TWO))
  assert found.process_id == 1


def test_tf_config_is_read_before_a_launchers_variables():
  environ = dict(_tf_config("worker", 0, worker=TWO), SLURM_PROCID="1",
                 SLURM_NTASKS="4", SLURM_JOB_NODELIST="n1", SLURM_JOB_ID="7")
  assert cluster.lists_addresses(environ)
  assert not cluster.lists_addresses({"SLURM_PROCID": "1"})


@pytest.mark.parametrize("environ, message", [
    ({"TF_CONFIG": "{cluster: 1}"}, r"TF_CONFIG is not JSON"),
    (_tf_config("evaluator", 0, worker=TWO, evaluator=["e0:1"]),
     r"the processes that run a pmap together are the cluster's \"chief\" "
     r"and \"worker\" tasks"),
    (_tf_config("worker", 2, worker=TWO), r"task index 2 is out of range for "
     r"its 'worker' job of 2 task"),
    (_tf_config("worker", 0, worker="h0:1,h1:1"), r"'worker' job must be a "
     r"list of 'host:port' strings"),
    (_tf_config("worker", 0, worker=[]), r"TF_CONFIG's cluster lists no "
     r"\"chief\" or \"worker\" task \(\{'worker': \[\]\}\)"),
    (_tf_config("worker", 0.5, worker=TWO), r"task index must be a whole "
     r"number \(as an int, a string of digits or a float such as 1.0\), got "
     r"0.5"),
    (_tf_config("worker", "one", worker=TWO), r"task index must be a whole "
     r"number .*got 'one'"),
])
def test_bad_tf_config_is_an_error(environ, message):
  with pytest.raises(ValueError, match=message):
    cluster.resolve(environ=environ)


def test_process_addresses_as_one_string_is_an_error():
  with pytest.raises(TypeError, match="must be a list of 'host:port'"):
    cluster.resolve(process_addresses="h0:9000,h1:9000", environ={})


def test_initialize_after_devices_are_in_use_raises():
  tfspmd.devices()
  with pytest.raises(RuntimeError, match=r"initialize\(\) came too late"):
    tfspmd.distributed.initialize(process_addresses=TWO, process_id=0)
  assert not tfspmd.distributed.is_initialized()


# TensorFlow's messages for a lost peer (TF 2.21, from real runs).
_REFUSED = (
    "{{function_node __inference_f_12}} Collective ops is aborted by: failed "
    "to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:9001: "
    "Failed to connect to remote host: Connection refused\nAdditional GRPC "
    "error information from remote target /job:worker/replica:0/task:1 while "
    "calling /tensorflow.WorkerService/RecvBuf:")
_HEARTBEATS = (
    "Collective ops is aborted by: Error reported from /job:worker/task:2: "
    "The following tasks are unhealthy (stopped sending heartbeats):\n"
    "/job:worker/replica:0/task:2\nThe tasks have crashed.")
_COORDINATOR = ("Collective ops is aborted by: Deadline Exceeded\n\nRPC: "
                "/tensorflow.CoordinationService/Heartbeat")


@pytest.mark.parametrize("message, named", [
    (_REFUSED, "process 1 (localhost:9001)"),
    (_HEARTBEATS, "process 2 (localhost:9002)"),
    (_COORDINATOR, "process 0 (localhost:9000)"),
    ("Something else", "a peer process"),
])
def test_a_lost_peer_is_named(monkeypatch, message, named):
  monkeypatch.setattr(distributed, "_cluster", cluster.Cluster(
      addresses=("localhost:9000", "localhost:9001", "localhost:9002"),
      process_id=0 if named != "process 0 (localhost:9000)" else 1,
      job_name="worker", source="test"))
  with pytest.raises(tfspmd.distributed.PeerFailedError) as caught:
    with multiprocess_hooks.peer_failures():
      raise tf.errors.UnavailableError(None, None, message)
  assert str(caught.value).startswith(f"{named} exited or stopped answering")


def test_a_lost_peer_error_quotes_tensorflow_without_the_function_name(
    monkeypatch):
  monkeypatch.setattr(distributed, "_cluster", cluster.Cluster(
      addresses=("localhost:9000", "localhost:9001"), process_id=0,
      job_name="worker", source="test"))
  with pytest.raises(tfspmd.distributed.PeerFailedError) as caught:
    distributed.raise_peer_failure(
        tf.errors.UnavailableError(None, None, _REFUSED))
  assert str(caught.value).endswith(
      "restart every process. TensorFlow said: UnavailableError: Collective "
      "ops is aborted by: failed to connect to all addresses; last error: "
      "UNKNOWN: ipv4:127.0.0.1:9001: Failed to connect to remote host: "
      "Connection refused")


def test_one_process_keeps_tensorflows_error():
  with pytest.raises(tf.errors.UnavailableError, match="as it was"):
    with multiprocess_hooks.peer_failures():
      raise tf.errors.UnavailableError(None, None, "as it was")
