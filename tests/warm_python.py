"""Python programs in processes forked from one that has imported TensorFlow.

Importing TensorFlow takes seconds; a test that starts dozens of processes
pays it once here. The forking process imports TensorFlow and runs no op,
so each child starts TensorFlow's runtime (devices, threads, a cluster)
itself, as a new process does. Each child takes the environment given for
it before its program runs, and tfspmd is imported by the program, so what
tfspmd and DTensor read from the environment they read from the child's.

Not for programs whose environment TensorFlow's own import must see
(`TF_ENABLE_ONEDNN_OPTS`, `LD_PRELOAD`): start those with subprocess.
"""

import atexit
import functools
import json
import os
import signal
import subprocess
import sys

_FORKING_PROCESS = r'''
import faulthandler
import json
import os
import runpy
import sys
import time
import traceback

import numpy
import tensorflow
from tensorflow.experimental import dtensor


def run_child(request):
  os.environ.clear()
  os.environ.update(request["env"])
  null = os.open(os.devnull, os.O_RDONLY)
  os.dup2(null, 0)
  for descriptor, path in ((1, request["stdout"]), (2, request["stderr"])):
    opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(opened, descriptor)
    os.close(opened)
  if request["cwd"] is not None:
    os.chdir(request["cwd"])
  sys.argv = request["argv"]
  if os.environ.get("PYTHONFAULTHANDLER"):
    faulthandler.enable()
  code = 0
  try:
    if request["path"] is not None:
      sys.path[0] = os.path.dirname(os.path.abspath(request["path"]))
      runpy.run_path(request["path"], run_name="__main__")
    else:
      exec(compile(request["code"], "<string>", "exec"),
           {"__name__": "__main__"})
  except SystemExit as exit_:
    if exit_.code is None or isinstance(exit_.code, int):
      code = exit_.code or 0
    else:
      print(exit_.code, file=sys.stderr)
      code = 1
  except BaseException:
    traceback.print_exc()
    code = 1
  # Out through the interpreter's own exit, as a process that ends its
  # program: TensorFlow's exit handlers run (a cluster's shutdown barrier).
  sys.exit(code)


def answer(value):
  sys.stdout.write(json.dumps(value) + "\n")
  sys.stdout.flush()


for line in sys.stdin:
  request = json.loads(line)
  if request["kind"] == "start":
    child = os.fork()
    if child == 0:
      run_child(request)
    answer(child)
  else:
    deadline = time.monotonic() + request["timeout"]
    while True:
      done, status = os.waitpid(request["pid"], os.WNOHANG)
      if done:
        answer(os.waitstatus_to_exitcode(status))
        break
      if time.monotonic() >= deadline:
        answer(None)
        break
      time.sleep(0.02)
'''


class ForkedProcess:
  """A child of the forking process, as much of `subprocess.Popen` as tests use."""

  def __init__(self, forking, pid, argv):
    self._forking = forking
    self.pid = pid
    self.args = argv
    self.returncode = None

  def wait(self, timeout=None):
    """The exit code (negative: the signal); TimeoutExpired after `timeout` s."""
    if self.returncode is None:
      code = self._forking.request(
          {"kind": "wait", "pid": self.pid,
           "timeout": 1e9 if timeout is None else timeout})
      if code is None:
        raise subprocess.TimeoutExpired(self.args, timeout)
      self.returncode = code
    return self.returncode

  def poll(self):
    """The exit code, or None while the process runs."""
    try:
      return self.wait(timeout=0)
    except subprocess.TimeoutExpired:
      return None

  def kill(self):
    if self.returncode is None:
      try:
        os.kill(self.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass


class WarmPython:
  """One process that has imported TensorFlow and forks the programs to run."""

  def __init__(self, env=None):
    self._process = subprocess.Popen(
        [sys.executable, "-c", _FORKING_PROCESS], env=env, text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL)

  def request(self, request):
    self._process.stdin.write(json.dumps(request) + "\n")
    self._process.stdin.flush()
    line = self._process.stdout.readline()
    if not line:
      raise RuntimeError(
          f"the forking process ended (exit code {self._process.poll()})")
    return json.loads(line)

  def start(self, *, argv, env, stdout, stderr, path=None, code=None,
            cwd=None):
    """Starts `path` (a script) or `code` as `python ARGV`; returns the process.

    Args:
      argv: `sys.argv` of the program.
      env: Its whole environment.
      stdout: The file its standard output goes to.
      stderr: The file its standard error goes to.
      path: The script to run, as `python path`.
      code: The program to run, as `python -c code`.
      cwd: Its working directory (None: this process's).
    """
    if (path is None) == (code is None):
      raise ValueError("give one of path and code")
    pid = self.request({"kind": "start", "argv": list(argv), "env": dict(env),
                        "stdout": stdout, "stderr": stderr, "path": path,
                        "code": code, "cwd": cwd})
    return ForkedProcess(self, pid, argv)

  def close(self):
    if self._process.poll() is None:
      self._process.stdin.close()
      try:
        self._process.wait(timeout=60)
      except subprocess.TimeoutExpired:
        self._process.kill()
        self._process.wait()


@functools.cache
def shared():
  """The test process's one WarmPython, closed when the process exits.

  It inherits this process's environment, with `PYTHONPATH` naming the
  directory that holds tfspmd, so that every child imports this checkout's.
  """
  import tfspmd  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  source_root = os.path.dirname(os.path.dirname(os.path.abspath(
      tfspmd.__file__)))
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=os.pathsep.join(
      [source_root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
  warm = WarmPython(env)
  atexit.register(warm.close)
  return warm
