"""Mistakes with several processes that one process can show (the others are
listed in `error_catalogue.PLACEHOLDERS`).

Rows of the error catalogue (`error_catalogue`); tests/test_errors.py runs them.
"""

import dataclasses
from unittest import mock

import numpy as np

import tfspmd
from tfspmd import lax
from tfspmd._src.runtime import devices as devices_lib

from error_catalogue import case, P, PROCESSES


INIT = tfspmd.distributed.initialize
TWO_ADDRESSES = ["localhost:9000", "localhost:9001"]


@case("initialize-after-devices", PROCESSES,
      "tfspmd.distributed.initialize() after TensorFlow started its devices",
      RuntimeError, r"initialize\(\) came too late: TensorFlow has already "
      r"started its devices")
def initialize_after_devices():
  P(lambda x: x)(np.zeros(2))
  INIT(process_addresses=TWO_ADDRESSES, process_id=0)


@case("initialize-no-addresses", PROCESSES,
      "initialize(num_processes=2) without a coordinator or the processes' "
      "addresses",
      ValueError, r"num_processes=2, process_id=None, but neither a "
      r"coordinator address nor process addresses were given. Pass "
      r"coordinator_address=")
def initialize_no_addresses():
  INIT(num_processes=2)


@case("initialize-coordinator-without-process-id", PROCESSES,
      "initialize(coordinator_address=..., num_processes=2) without "
      "process_id", ValueError,
      r"num_processes=2 lists 2 processes but nothing says which one this is: "
      r"pass process_id=")
def initialize_coordinator_without_process_id():
  INIT(coordinator_address="localhost:1234", num_processes=2)


@case("initialize-no-process-id", PROCESSES,
      "initialize(process_addresses=[...]) without process_id", ValueError,
      r"process_addresses lists 2 processes but nothing says which one this "
      r"is: pass process_id=")
def initialize_no_process_id():
  INIT(process_addresses=TWO_ADDRESSES)


@case("initialize-process-id-range", PROCESSES,
      "initialize(process_addresses=[two], process_id=2)", ValueError,
      r"process_id=2 is out of range for the 2 processes")
def initialize_process_id_range():
  INIT(process_addresses=TWO_ADDRESSES, process_id=2)


@case("initialize-timeout", PROCESSES, "initialize(initialization_timeout=0)",
      ValueError, r"`initialization_timeout` must be a positive, finite "
      r"number of seconds, got 0")
def initialize_timeout():
  INIT(initialization_timeout=0)


@case("initialize-local-device-ids-cpu", PROCESSES,
      "initialize(local_device_ids=[0]) on CPU", ValueError,
      r"`local_device_ids` picks physical GPUs, but the platform is 'cpu'")
def initialize_local_device_ids_cpu():
  INIT(local_device_ids=[0], backend="cpu")


@case("initialize-coordinator-not-a-string", PROCESSES,
      "initialize(coordinator_address=('localhost', 1234))", TypeError,
      r"coordinator_address must be a 'host:port' string, got tuple "
      r"\('localhost', 1234\), such as 'host0:1234'")
def initialize_coordinator_not_a_string():
  INIT(coordinator_address=("localhost", 1234), num_processes=2, process_id=1)


@case("initialize-coordinator-url", PROCESSES,
      "initialize(coordinator_address='http://host0:1234')", ValueError,
      r"coordinator_address must be 'host:port', got 'http://host0:1234': a "
      r"host name or IP address, ':', and a port in 1\.\.65535, with no "
      r"scheme")
def initialize_coordinator_url():
  INIT(coordinator_address="http://host0:1234", num_processes=2, process_id=1)


@case("initialize-coordinator-port-range", PROCESSES,
      "initialize(coordinator_address='localhost:70000')", ValueError,
      r"coordinator_address must be 'host:port', got 'localhost:70000': .*a "
      r"port in 1\.\.65535")
def initialize_coordinator_port_range():
  INIT(coordinator_address="localhost:70000", num_processes=2, process_id=1)


@case("initialize-num-processes-string", PROCESSES,
      "initialize(num_processes='2'), read from the environment as a string",
      TypeError, r"`num_processes` must be an int, got str '2'; write "
      r"num_processes=int\(\.\.\.\)")
def initialize_num_processes_string():
  INIT(coordinator_address="localhost:1234", num_processes="2", process_id=1)


@case("initialize-num-processes-zero", PROCESSES,
      "initialize(num_processes=0)", ValueError,
      r"`num_processes` must be a positive int, got 0")
def initialize_num_processes_zero():
  INIT(num_processes=0)


@case("initialize-process-id-string", PROCESSES,
      "initialize(process_id='1')", TypeError,
      r"`process_id` must be an int, got str '1'")
def initialize_process_id_string():
  INIT(coordinator_address="localhost:1234", num_processes=2, process_id="1")


@case("initialize-timeout-infinite", PROCESSES,
      "initialize(initialization_timeout=float('inf'))", ValueError,
      r"`initialization_timeout` must be a positive, finite number of "
      r"seconds, got inf")
def initialize_timeout_infinite():
  INIT(initialization_timeout=float("inf"))


@case("initialize-address-not-a-string", PROCESSES,
      "initialize(process_addresses=[('localhost', 9000), ...])", TypeError,
      r"every process address \(from process_addresses\) must be a "
      r"'host:port' string, got tuple \('localhost', 9000\)")
def initialize_address_not_a_string():
  INIT(process_addresses=[("localhost", 9000), ("localhost", 9001)],
       process_id=0)


@case("initialize-addresses-repeated", PROCESSES,
      "one address twice in process_addresses", ValueError,
      r"process_addresses lists \['localhost:9000'\] more than once: "
      r"\['localhost:9000', 'localhost:9000'\]\. Give every process its own "
      r"'host:port'")
def initialize_addresses_repeated():
  INIT(process_addresses=["localhost:9000", "localhost:9000"], process_id=0)


@case("initialize-heartbeat-twice", PROCESSES,
      "initialize with heartbeat_timeout_seconds and heartbeat_timeout",
      TypeError, r"give `heartbeat_timeout_seconds` \(JAX's name\) or "
      r"`heartbeat_timeout` \(its earlier name\), not both; got 5 and 7")
def initialize_heartbeat_twice():
  INIT(heartbeat_timeout_seconds=5, heartbeat_timeout=7)


@case("initialize-cluster-detection-method", PROCESSES,
      "initialize(cluster_detection_method='mpi4py')", ValueError,
      r"`cluster_detection_method` must be None .* or 'deactivate', got "
      r"'mpi4py'")
def initialize_cluster_detection_method():
  INIT(cluster_detection_method="mpi4py")


@case("initialize-slice-index", PROCESSES, "initialize(slice_index=1)",
      ValueError, r"`slice_index` must be None, got 1: DTensor's runtime "
      r"numbers processes only")
def initialize_slice_index():
  INIT(slice_index=1)


@case("initialize-shutdown-timeout", PROCESSES,
      "initialize(shutdown_timeout_seconds=-1)", ValueError,
      r"`shutdown_timeout_seconds` must be a positive, finite number of "
      r"seconds, got -1")
def initialize_shutdown_timeout():
  INIT(shutdown_timeout_seconds=-1)


@case("initialize-bind-address", PROCESSES,
      "initialize(coordinator_bind_address='9000')", ValueError,
      r"coordinator_bind_address")
def initialize_bind_address():
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
def nested_crossing_axis_size(devices):
  del devices
  P(_psum_over("i", 3), "o")(np.zeros((1, 2)))


@case("nested-crossing-grid", PROCESSES,
      "with 2 processes passing 1 x 2 positions, a nested axis_size=6, which "
      "does not divide the grid's 4 positions", ValueError,
      r"the nested axes crossing processes, 'i' \(6\), have global sizes "
      r"whose product 6 does not divide the 4 grid positions.*axis_size= "
      r"values whose product divides 4")
@_as_two_processes
def nested_crossing_grid(devices):
  del devices
  P(_psum_over("i", 6), "o")(np.zeros((1, 2)))


@case("nested-crossing-not-an-input", PROCESSES,
      "with 2 processes, a nested pmap whose axis crosses processes mapping a "
      "value computed inside the outer function", ValueError,
      r"the nested pmap over axis 'i' has global size 4, which crosses "
      r"processes, but a mapped argument has size 2 and is not an input of "
      r"the outermost pmap.*map the inputs of the outermost pmap")
@_as_two_processes
def nested_crossing_not_an_input(devices):
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
def nested_crossing_one_depth(devices):
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
def nested_crossing_devices(devices):
  P(_psum_over("i", 4), "o", devices=devices)(np.zeros((1, 2)))
