"""Two processes as two hosts: network namespaces joined by a veth pair.

The two-process test of a `tfspmd.jit` of a shard_map on global arrays
(tests/multiprocess_worker.py, `jit_over_processes`) runs its processes on
localhost, where every address is the same host's. Here each process runs
in a network namespace of its own, joined to the other's by a veth pair
(10.77.0.1 and 10.77.0.2): the coordinator, the address exchange and
DTensor's collectives go over that link, as between two machines. The same
program then runs on localhost, side by side, and both results are checked
against NumPy.

Needs root (or CAP_NET_ADMIN) and iproute2 (`ip netns`); not run in CI.

Run: python -m benchmarks.two_hosts [--rounds N] [--rows N]
"""

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import timing  # pylint: disable=wrong-import-position

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "multiprocess_worker.py")
NAMESPACES = ("tfspmd_host0", "tfspmd_host1")
ADDRESSES = ("10.77.0.1", "10.77.0.2")
PORT = 8476


def _ip(*args):
  subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def two_hosts():
  """Two network namespaces joined by a veth pair, removed afterwards."""
  for namespace in NAMESPACES:
    subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
  try:
    for namespace in NAMESPACES:
      _ip("netns", "add", namespace)
    _ip("link", "add", "tfspmd_veth0", "type", "veth", "peer", "name",
        "tfspmd_veth1")
    for k, (namespace, address) in enumerate(zip(NAMESPACES, ADDRESSES)):
      _ip("link", "set", f"tfspmd_veth{k}", "netns", namespace)
      _ip("-n", namespace, "addr", "add", f"{address}/24", "dev",
          f"tfspmd_veth{k}")
      _ip("-n", namespace, "link", "set", "lo", "up")
      _ip("-n", namespace, "link", "set", f"tfspmd_veth{k}", "up")
    yield
  finally:
    for namespace in NAMESPACES:
      subprocess.run(["ip", "netns", "del", namespace], capture_output=True)


def _free_port():
  with socket.socket() as probe:
    probe.bind(("localhost", 0))
    return probe.getsockname()[1]


def run_pair(rows, namespaced):
  """The two processes' reports and the wall seconds until both finished."""
  coordinator = (f"{ADDRESSES[0]}:{PORT}" if namespaced else
                 f"localhost:{_free_port()}")
  base = {k: v for k, v in os.environ.items() if not k.startswith("DTENSOR_")}
  base.update(TFSPMD_NUM_CPU_DEVICES="4", TF_CPP_MIN_LOG_LEVEL="3",
              WORKER_INIT_TIMEOUT="60", WORKER_HEARTBEAT_TIMEOUT="10",
              WORKER_COORDINATOR=coordinator, WORKER_NUM_PROCESSES="2",
              JIT_ROWS=str(rows), PYTHONPATH=ROOT)
  start = time.monotonic()
  children = []
  for k in range(2):
    prefix = ["ip", "netns", "exec", NAMESPACES[k]] if namespaced else []
    children.append(subprocess.Popen(
        prefix + [sys.executable, WORKER, "jit_over_processes"],
        env=dict(base, WORKER_PROCESS_ID=str(k)), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True))
  reports = []
  for child in children:
    out, err = child.communicate(timeout=600)
    if child.returncode != 0:
      raise RuntimeError(f"a process exited with {child.returncode}:\n"
                         f"{err[-3000:]}")
    reports.append(json.loads(out.splitlines()[-1]))
  return reports, time.monotonic() - start


def expected(rows):
  """`jit_over_processes`'s result, in NumPy."""
  x = np.arange(2 * rows * 8, dtype=np.float32).reshape(2 * rows, 8)
  w = (np.arange(64, dtype=np.float32).reshape(8, 8) % 7) / 7.
  mixed = sum(b @ w + b for b in (x[:rows], x[rows:]))
  return mixed, float(mixed.sum())


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--rows", type=int, default=8)
  options = parser.parse_args()
  mixed, total = expected(options.rows)
  seconds = {"two namespaces over a veth pair": [], "localhost": []}
  with two_hosts():
    for _ in range(options.rounds):
      for name, namespaced in (("two namespaces over a veth pair", True),
                               ("localhost", False)):
        reports, wall = run_pair(options.rows, namespaced)
        for k, report in enumerate(reports):
          assert report["process_index"] == k
          np.testing.assert_allclose(report["mixed"], mixed, rtol=1e-5)
          np.testing.assert_allclose(report["total"], total, rtol=1e-5)
        seconds[name].append(wall)
  rows = [dict(network=name, median_s=statistics.median(values),
               runs=len(values), matches_numpy="yes")
          for name, values in seconds.items()]
  timing.print_table(
      "A tfspmd.jit of a shard_map over 2 processes x 4 CPU devices on global "
      "arrays: wall seconds of the whole run (start, join, trace, run, "
      "process_allgather)", rows, ["network", "median_s", "runs",
                                   "matches_numpy"])
  path = timing.write_results("two_hosts", dict(
      machine=timing.machine(), rows=rows, seconds=seconds,
      load_average=os.getloadavg()))
  print(f"\nwrote {path}")


if __name__ == "__main__":
  main()
