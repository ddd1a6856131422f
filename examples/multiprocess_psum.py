"""The jax.pmap reference's multi-process example, written with TensorFlow.

Every process runs this program; each passes one value per local device,
and the psum adds the values of all processes' devices. With two processes
of 4 devices each, process 0 prints [28 29 30 31] and process 1 prints
[32 33 34 35].

In each process of a cluster (DTENSOR_JOBS, DTENSOR_CLIENT_ID set; on a
Cloud TPU VM slice nothing is needed: docs/tpu_vm.md):
  python examples/multiprocess_psum.py
On one machine, as two processes of 4 logical CPU devices started here:
  python examples/multiprocess_psum.py --local 2
"""

import os
import socket
import subprocess
import sys

import tensorflow as tf
import tfspmd
from tfspmd import lax


def x_plus_psum():
  """Each process's part of `x + psum(x, 'i')` over `x = range(all devices)`."""
  count = tfspmd.local_device_count()
  data = tf.range(count) + count * tfspmd.process_index()
  return tfspmd.pmap(lambda x: x + lax.psum(x, axis_name="i"),
                     axis_name="i")(data)


def _start_local(processes, devices=4, timeout=300):
  """Runs this program as `processes` processes on localhost; prints each."""
  sockets = [socket.socket() for _ in range(processes)]
  for s in sockets:
    s.bind(("localhost", 0))
  jobs = ",".join(f"localhost:{s.getsockname()[1]}" for s in sockets)
  for s in sockets:
    s.close()
  children = [subprocess.Popen(
      [sys.executable, __file__], stdout=subprocess.PIPE, text=True,
      env=dict(os.environ, DTENSOR_JOBS=jobs, DTENSOR_CLIENT_ID=str(k),
               TFSPMD_NUM_CPU_DEVICES=str(devices), TF_CPP_MIN_LOG_LEVEL="3"))
              for k in range(processes)]
  try:
    for child in children:
      print(child.communicate(timeout=timeout)[0], end="")
  finally:
    for child in children:
      child.kill()  # SIGKILL: TensorFlow's coordination service traps SIGTERM.


def main():
  tfspmd.distributed.initialize()
  print(f"process {tfspmd.process_index()}: {x_plus_psum()}", flush=True)


if __name__ == "__main__":
  if sys.argv[1:2] == ["--local"]:
    _start_local(int(sys.argv[2]))
  else:
    main()
