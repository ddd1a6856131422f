"""The device threads of a pmap in debug mode, and where they meet.

One `Session` serves a top-level pmap call in debug mode and every pmap
nested in it: it runs each device's program in its own thread and lets the
threads of one collective meet. Threads meet by key, not by object, so the
devices of a group may belong to different nested pmap calls (a collective
over an outer axis, called inside an inner pmap). A device's n-th
collective over a group meets the n-th of every other member: the compiled
program runs the same collectives in the same order on every device.

A failure anywhere stops the whole session: the first error is kept, every
waiting thread is released (it unwinds with `DeviceReleased`), and the caller
raises the error. If every running thread waits at a meeting that cannot
complete (a device skipped a collective), that is a failure too, so a wrong
program raises instead of hanging.
"""

import collections
import dataclasses
import threading

from tfspmd._src.runtime import axis_env


@dataclasses.dataclass
class DebugFrame(axis_env.Frame):
  """A bound axis of a pmap in debug mode.

  Attributes:
    index: This device's position along the axis, a Python int.
    session: The `Session` its threads meet in.
  """
  session: object = None


class DeviceReleased(BaseException):
  """Unwinds a device thread after the session failed elsewhere.

  A BaseException, so that a device program's `except Exception` does not
  swallow it and go on to wait at its next collective.
  """


def describe(chain):
  """Names a device by its position along each bound axis."""
  return "{" + ", ".join(f"{frame.name!r}: {frame.index}"
                         for frame in chain) + "}"


class _Meeting:
  """One collective of one group: what each member brought, then the result."""

  def __init__(self, function, axes, expected):
    self.function = function
    self.axes = axes
    self.expected = expected
    self.values = {}
    self.devices = {}
    self.done = False
    self.result = None


class Session:
  """The threads of one top-level pmap call in debug mode.

  `_running` counts the threads executing a device's program: not waiting at
  a meeting, not waiting for the threads of a nested pmap. When it drops to
  zero while a meeting is incomplete, no thread can complete it.
  """

  def __init__(self):
    self._condition = threading.Condition()
    self._running = 0
    self._pending = {}
    self._counts = collections.Counter()
    self.error = None

  def run_devices(self, chains, body, nested):
    """Runs `body(chain)` for each chain in its own thread.

    Args:
      chains: One tuple of `DebugFrame`s per device, outermost axis first.
      body: The device's program; returns the device's result.
      nested: Whether the caller is itself a device thread of this session
        (it waits while its devices run).

    Returns:
      The results, in the order of `chains`.

    Raises:
      DeviceReleased: In a nested call, if the session failed.
      BaseException: At the top level, the session's first error.
    """
    count = len(chains)
    results = [None] * count
    finished = 0

    def device(k):
      nonlocal finished
      try:
        results[k] = body(chains[k])
      except DeviceReleased:
        pass
      except BaseException as error:  # pylint: disable=broad-except
        self._fail(error, chains[k])
      finally:
        with self._condition:
          finished += 1
          # The last device of a nested call hands its place to the caller.
          if not (nested and finished == count):
            self._running -= 1
            self._check_deadlock()
          self._condition.notify_all()

    with self._condition:
      if self.error is not None:
        raise DeviceReleased
      self._running += count - int(nested)
    for k, chain in enumerate(chains):
      threading.Thread(target=device, args=(k,), daemon=True,
                       name=f"tfspmd debug device {describe(chain)}").start()
    with self._condition:
      try:
        while finished < count:
          self._condition.wait()
      except BaseException as error:  # A KeyboardInterrupt of the caller.
        self._fail(error, None)
        raise
      if self.error is not None:
        if nested:
          raise DeviceReleased
        raise self.error
    return results

  def meet(self, chain, group, linear, expected, function, axes, value,
           compute):
    """Brings `value` to the meeting of `group`; returns the group's result.

    Args:
      chain: The calling device's frames.
      group: A key shared by exactly the members of the group.
      linear: The caller's position in the group.
      expected: The number of members.
      function: The collective's name, checked to be the same for all.
      axes: The named axes, for error messages.
      value: The caller's value.
      compute: `compute(values, devices)`, given the members' values and
        descriptions in the order of their positions; called once, by the
        member that arrives last.

    Raises:
      DeviceReleased: If the session failed (the caller unwinds).
    """
    device = tuple(frame.index for frame in chain)
    with self._condition:
      if self.error is not None:
        raise DeviceReleased
      key = (group, self._counts[device, group])
      self._counts[device, group] += 1
      meeting = self._pending.get(key)
      if meeting is None:
        meeting = self._pending[key] = _Meeting(function, axes, expected)
      elif (meeting.function, meeting.expected) != (function, expected):
        self._fail(RuntimeError(
            f"pmap(debug=True): devices met at different collectives: "
            f"{', '.join(meeting.devices.values())} called "
            f"{meeting.function} over {meeting.axes} where "
            f"{describe(chain)} called {function} over {axes}. Every device "
            f"must run the same collectives in the same order."), None)
        raise DeviceReleased
      meeting.values[linear] = value
      meeting.devices[linear] = describe(chain)
      if len(meeting.values) < expected:
        self._running -= 1
        self._check_deadlock()
        while not meeting.done and self.error is None:
          self._condition.wait()
        if not meeting.done:
          raise DeviceReleased
        return meeting.result
      del self._pending[key]
      try:
        meeting.result = compute(
            [meeting.values[k] for k in range(expected)],
            [meeting.devices[k] for k in range(expected)])
      except BaseException as error:  # pylint: disable=broad-except
        self._fail(error, None)
        raise DeviceReleased from None
      meeting.done = True
      self._running += expected - 1
      self._condition.notify_all()
      return meeting.result

  def _fail(self, error, chain):
    """Keeps the session's first error and releases every waiting thread."""
    with self._condition:
      if self.error is not None:
        return
      if chain is not None:
        # A note, not a new exception: the caller gets the device's own
        # exception, of its own type, with its traceback.
        error.__notes__ = [*getattr(error, "__notes__", ()),
                           f"Raised by the device at {describe(chain)} of a "
                           f"pmap in debug mode."]
      self.error = error
      self._condition.notify_all()

  def _check_deadlock(self):
    if self._running or not self._pending or self.error is not None:
      return
    waiting = "; ".join(
        f"{meeting.function} over {meeting.axes} waits for "
        f"{meeting.expected} devices, and only "
        f"{', '.join(meeting.devices.values())} arrived"
        for meeting in self._pending.values())
    self._fail(RuntimeError(
        f"pmap(debug=True): the devices stopped at different collectives, "
        f"so none can go on: {waiting}. Every device must run the same "
        f"collectives in the same order; look for a collective under Python "
        f"control flow that depends on the device (on axis_index, or on its "
        f"data)."), None)
