"""Every process's address, from the coordinator's alone.

DTensor's multi-client runtime needs the `host:port` of every process before
it starts; users, as with `jax.distributed.initialize`, know one coordinator
address. Before DTensor starts, process 0 listens on the coordinator
address; every other process connects to it and sends its index and the
host and port it will serve on; process 0 sends every process the whole
list. Each process reserves its port (bound, not listening) from before it
registers until the list is complete, so no two processes of one host and
not the coordinator's own port can be chosen twice.

Messages are single lines of JSON over TCP. Everything is bounded by one
deadline: a process that never registers is named by process 0, and a
coordinator that never answers by the others. Processes that disagree (on
the number of processes, or two with one index) fail at once, all of them:
waiting would only end in a timeout that names the wrong process.
"""

import contextlib
import json
import socket
import time

from tfspmd._src.multiprocess import cluster as cluster_lib

_RETRY_SECONDS = 0.2


def exchange_addresses(coordinator_address, num_processes, process_id,
                       timeout, bind_address=None):
  """The `host:port` of every process, in process order.

  Args:
    coordinator_address: `host:port` process 0 listens on for the exchange.
    num_processes: How many processes take part.
    process_id: This process's index.
    timeout: Seconds the whole exchange may take.
    bind_address: `host:port` process 0 listens on, if not every interface
      at the coordinator's port.

  Returns:
    A list of `host:port`, one per process; process 0's host is the
    coordinator's, its port another one.

  Raises:
    TimeoutError: Naming the processes that did not register (process 0),
      or the coordinator that did not answer (the others).
    ValueError: In every process registered so far, if one registers with
      another `num_processes`, an index out of range or one already taken.
    OSError: In process 0, if the coordinator's port is taken.
  """
  host, port = cluster_lib.split_address(coordinator_address,
                                         "coordinator_address")
  deadline = time.monotonic() + timeout
  listen = (("", port) if bind_address is None else
            cluster_lib.split_address(bind_address, "coordinator_bind_address"))
  with _reserved_port() as own_port:
    if process_id == 0:
      return _collect(host, port, listen, own_port, num_processes, deadline,
                      timeout)
    return _register(host, port, own_port, process_id, num_processes,
                   deadline, timeout)


@contextlib.contextmanager
def _reserved_port():
  """A port bound by this process (so no one else takes it) until exit."""
  reservation = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  try:
    reservation.bind(("", 0))
    yield reservation.getsockname()[1]
  finally:
    reservation.close()


def _collect(host, port, listen, own_port, count, deadline, timeout):
  """Process 0: wait for every other process, then send them the list.

  It listens on `listen`, `(host, port)`, and is reached at `host:port`.
  """
  server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  members = {}  # process id -> (connection, "host:port")
  try:
    try:
      server.bind(listen)
    except OSError as e:
      raise OSError(
          e.errno,
          f"tfspmd.distributed.initialize: process 0 cannot listen on the "
          f"coordinator's port {listen[1]} ({e.strerror}): another program uses "
          f"it, or another process was also started with process_id=0. Give "
          f"each process its own process_id, or pick a free port for "
          f"coordinator_address.") from None
    server.listen(count)
    while len(members) < count - 1:
      left = deadline - time.monotonic()
      if left <= 0:
        missing = sorted(set(range(1, count)) - set(members))
        message = (
            f"tfspmd.distributed.initialize: process(es) {missing} of "
            f"{count} did not register with the coordinator at "
            f"{host}:{port} within {timeout:g} s; start every process with "
            f"the same coordinator_address and num_processes.")
        _send_all(members, {"error": message, "timeout": True})
        raise TimeoutError(message)
      server.settimeout(min(left, 1.0))
      try:
        connection, peer = server.accept()
      except socket.timeout:
        continue
      connection.settimeout(max(deadline - time.monotonic(), 0.1))
      try:
        hello = _receive(connection)
      except (OSError, ValueError):
        connection.close()
        continue
      problem = _check_hello(hello, count, members)
      if problem:
        _send(connection, {"error": problem, "timeout": False})
        connection.close()
        if not isinstance(hello, dict) or "num_processes" not in hello:
          continue  # Not a tfspmd process: no reason to stop the others.
        _send_all(members, {"error": problem, "timeout": False})
        raise ValueError(problem)
      members[hello["process_id"]] = (
          connection, f"{hello.get('host') or peer[0]}:{hello['port']}")
    addresses = [f"{host}:{own_port}"] + [members[k][1]
                                          for k in range(1, count)]
    _send_all(members, {"addresses": addresses})
    return addresses
  finally:
    for connection, _ in members.values():
      connection.close()
    server.close()


def _check_hello(hello, count, members):
  """What is wrong with a registration, or None."""
  process_id = hello.get("process_id") if isinstance(hello, dict) else None
  if isinstance(hello, dict) and hello.get("num_processes") != count:
    return (f"tfspmd.distributed.initialize: process {process_id!r} was "
            f"started with num_processes={hello.get('num_processes')!r}, "
            f"the coordinator (process 0) with num_processes={count}; give "
            f"every process the same num_processes.")
  if (not isinstance(process_id, int) or not 0 < process_id < count or
      not isinstance(hello.get("port"), int)):
    return (f"tfspmd.distributed.initialize: a process registered as "
            f"{process_id!r}, but the coordinator expects processes 1.."
            f"{count - 1} (num_processes={count}).")
  if process_id in members:
    return (f"tfspmd.distributed.initialize: two processes registered as "
            f"process {process_id}; give each process its own process_id "
            f"(0..{count - 1}).")
  return None


def _register(host, port, own_port, process_id, count, deadline, timeout):
  """Processes 1..n-1: register with the coordinator, wait for the list."""
  while True:
    try:
      connection = socket.create_connection(
          (host, port), timeout=max(min(deadline - time.monotonic(), 5), 0.1))
      break
    except OSError:
      if time.monotonic() + _RETRY_SECONDS >= deadline:
        raise TimeoutError(
            f"tfspmd.distributed.initialize: process {process_id} could not "
            f"reach the coordinator (process 0) at {host}:{port} within "
            f"{timeout:g} s; is process 0 running, with that "
            f"coordinator_address?") from None
      time.sleep(_RETRY_SECONDS)
  with connection:
    # The address the coordinator reached us from is one it can reach.
    own_host = connection.getsockname()[0]
    try:
      connection.settimeout(max(deadline - time.monotonic(), 0.1))
      _send(connection, {"process_id": process_id, "num_processes": count,
                         "host": own_host, "port": own_port})
      reply = _receive(connection)
    except (OSError, ValueError):
      raise TimeoutError(
          f"tfspmd.distributed.initialize: process {process_id} registered "
          f"with the coordinator at {host}:{port}, but the list of every "
          f"process did not come within {timeout:g} s (did every process "
          f"start?).") from None
  if "error" in reply:
    raise (TimeoutError if reply.get("timeout") else ValueError)(reply["error"])
  return reply["addresses"]


def _send(connection, message):
  connection.sendall((json.dumps(message) + "\n").encode())


def _send_all(members, message):
  for connection, _ in members.values():
    with contextlib.suppress(OSError):
      _send(connection, message)


def _receive(connection):
  data = b""
  while not data.endswith(b"\n"):
    chunk = connection.recv(4096)
    if not chunk:
      raise ValueError("connection closed")
    data += chunk
  return json.loads(data)
