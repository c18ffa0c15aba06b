"""Run-time pieces both training loops share: the log line, stop requests, divergence."""

import contextlib
import datetime
import math
import os
import signal
import socket
import sys
import threading


class TrainingError(Exception):
  """Training cannot go on; the message names the step and what to do."""


def log_line(step, loss, examples_per_sec, sec_per_batch):
  """Upstream's progress line.

  Args:
    step: int, global step just finished.
    loss: float, mean of the towers' total losses at that step.
    examples_per_sec: float, images of all towers per second.
    sec_per_batch: float, seconds per step.
  """
  return ('%s: step %d, loss = %.2f (%.1f examples/sec; %.3f sec/batch)'
          % (datetime.datetime.now(), step, loss, examples_per_sec, sec_per_batch))


def check_finite(step, tower_losses):
  """Raises TrainingError naming the step and tower whose loss is NaN or inf."""
  for i, value in enumerate(tower_losses):
    if not math.isfinite(float(value)):
      raise TrainingError(
          'Model diverged with loss = %s at step %d in tower %d; the last good '
          'checkpoint is kept. Lower the learning rate or check the input data.'
          % (value, step, i))


class StopRequest:
  """SIGINT and SIGTERM as a request to stop: a flag at step boundaries, and at once where blocked.

  Use as a context manager around everything a signal should stop cleanly. The
  loop checks `requested` at each step boundary and stops there with a
  checkpoint.

  Python runs a signal handler in the main thread only, between two bytecodes,
  so a main thread blocked inside TensorFlow (a queue still filling, a
  collective waiting for a peer that never comes) would not see a signal until
  that call returns, possibly never. So the handler also wakes a watcher thread
  (`signal.set_wakeup_fd`), which at once runs the callback of the blocking
  phase in progress (`while_blocked`): close the input queues, end a start-up
  that waits for peers, and so on.

  A second signal while stopping ends the process at once, with 128 + the
  signal's number and a line saying that the steps since the last checkpoint
  are lost.

  Re-entrant: the CLI holds one for a whole command, so a signal during data
  checks or graph building is a stop request too; a trainer's own
  `with StopRequest()` inside it shares the same request. Outside the main
  thread it installs nothing.
  """

  SIGNALS = (signal.SIGINT, signal.SIGTERM)
  # The signal that stopped the last loop in this process ('SIGINT',
  # 'SIGTERM'), or None; the CLI turns it into the exit status 128 + number.
  last_signal = None
  _active = None  # the outermost entered StopRequest's _State, or None

  def __init__(self, warn=None):
    """Args: warn: callable(str) for the forced-exit line; default stderr."""
    self._warn = warn
    self._state = None
    self._owner = False

  def __enter__(self):
    if StopRequest._active is not None:
      self._state = StopRequest._active  # nested: share the outer request
      return self
    self._state = _State(self._warn or _stderr)
    self._owner = True
    StopRequest.last_signal = None
    if threading.current_thread() is threading.main_thread():
      self._state.install()
    StopRequest._active = self._state
    return self

  def __exit__(self, *exc):
    if self._owner:
      StopRequest._active = None
      self._state.uninstall()
      self._owner = False
    return False

  @property
  def requested(self):
    """True once a signal (or `request`) asked to stop."""
    return self._state is not None and self._state.event.is_set()

  @property
  def signal_name(self):
    """'SIGINT' or 'SIGTERM' once requested; None before."""
    return self._state.signal_name if self._state else None

  def wait(self, timeout):
    """Sleeps up to `timeout` seconds, waking early on a stop; True if one came."""
    return self._state.event.wait(timeout)

  @contextlib.contextmanager
  def while_blocked(self, callback):
    """Runs `callback(signal_name)` at once if a stop comes during the block.

    For a block where the main thread may wait inside TensorFlow for long
    (longer than a scheduler's grace period): the callback runs on the
    watcher thread while the main thread still waits, and must make that
    wait end (close a queue) or end the process itself (os._exit after a
    message). If a stop was requested before the block, the callback runs
    here first, in the calling thread.
    """
    state = self._state
    if state.event.is_set():
      _run_callback(callback, state.signal_name, state.warn)
    with state.lock:
      state.callbacks.append(callback)
    try:
      yield
    finally:
      with state.lock:
        state.callbacks.remove(callback)


def _stderr(message):
  print(message, file=sys.stderr, flush=True)


def _run_callback(callback, name, warn):
  try:
    callback(name)
  except Exception as e:  # pylint: disable=broad-except
    warn('while stopping: %s: %s' % (type(e).__name__, e))


class _State:
  """What one stop request holds; the handlers and the watcher thread share it."""

  def __init__(self, warn):
    self.warn = warn
    self.event = threading.Event()
    self.lock = threading.Lock()
    self.signal_name = None
    self.callbacks = []  # while_blocked callbacks, innermost last
    self._received = 0  # signals the watcher has seen
    self._previous_handlers = {}
    self._previous_wakeup_fd = -1
    self._reader = self._writer = None
    self._watcher = None

  def install(self):
    for sig in StopRequest.SIGNALS:
      self._previous_handlers[sig] = signal.signal(sig, self._handle)
    self._reader, self._writer = socket.socketpair()
    self._reader.setblocking(True)
    self._writer.setblocking(False)
    self._previous_wakeup_fd = signal.set_wakeup_fd(
        self._writer.fileno(), warn_on_full_buffer=False)
    self._watcher = threading.Thread(target=self._watch, name='stop-request',
                                     daemon=True)
    self._watcher.start()

  def uninstall(self):
    if self._watcher is None and not self._previous_handlers:
      return
    signal.set_wakeup_fd(self._previous_wakeup_fd)
    for sig, handler in self._previous_handlers.items():
      signal.signal(sig, handler)
    self._previous_handlers.clear()
    self._writer.close()  # the watcher's recv returns b'': it ends
    self._watcher.join(timeout=5)
    self._reader.close()
    self._watcher = None

  def stop(self, name):
    with self.lock:
      if self.signal_name is None:
        self.signal_name = name
      self.event.set()

  def _handle(self, signum, frame):  # pylint: disable=unused-argument
    # The main thread's handler: only marks the request (the watcher counts
    # signals and runs callbacks; it saw this one already or is about to).
    name = signal.Signals(signum).name
    StopRequest.last_signal = StopRequest.last_signal or name
    self.stop(name)

  def _watch(self):
    while True:
      try:
        data = self._reader.recv(64)
      except OSError:
        return
      if not data:
        return
      for signum in data:
        if signum not in [int(s) for s in StopRequest.SIGNALS]:
          continue
        self._received += 1
        name = signal.Signals(signum).name
        if self._received > 1:
          self.warn('%s again: stopping at once, without saving; the steps '
                    'since the last checkpoint are lost.' % name)
          sys.stdout.flush()
          sys.stderr.flush()
          os._exit(128 + signum)  # pylint: disable=protected-access
        StopRequest.last_signal = StopRequest.last_signal or name
        self.stop(name)
        with self.lock:
          callbacks = list(self.callbacks)
        for callback in reversed(callbacks):
          _run_callback(callback, name, self.warn)


def exit_status(signal_name):
  """The shell's exit status of a run stopped by `signal_name`: 128 + its number.

  130 for SIGINT (also for a KeyboardInterrupt), 143 for SIGTERM, 1 otherwise.
  """
  if signal_name == 'KeyboardInterrupt':
    signal_name = 'SIGINT'
  try:
    return 128 + int(signal.Signals[signal_name])
  except KeyError:
    return 1
