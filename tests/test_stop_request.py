"""runtime.training.StopRequest: signals as a stop request, also while TensorFlow blocks."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types

import pytest
import tensorflow as tf

from cifar10_towers.runtime import training

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT_SECS = 5.0  # a callback must have ended a blocked wait by then


def _signal_soon(sig, delay=0.3):
  timer = threading.Timer(delay, os.kill, (os.getpid(), sig))
  timer.start()
  return timer


@pytest.mark.parametrize('sig', training.STOP_SIGNALS, ids=lambda s: s.name)
def test_a_signal_is_a_request_and_the_handlers_come_back(sig):
  """Each stop signal: its name, and 128 + its number (tests/test_ending.py trains through
  four of them, the same handler)."""
  before = signal.getsignal(sig)
  with training.StopRequest() as stop:
    assert not stop.requested and stop.signal_name is None
    _signal_soon(sig)
    assert stop.wait(PROMPT_SECS)  # wakes early, well before the timeout
    assert stop.requested and stop.signal_name == sig.name
  assert signal.getsignal(sig) is before
  assert training.exit_status(stop.signal_name) == 128 + sig


def test_nested_requests_share_one_state():
  with training.StopRequest() as outer:
    with training.StopRequest() as inner:
      os.kill(os.getpid(), signal.SIGTERM)
      assert inner.wait(PROMPT_SECS)
    # Leaving the inner one keeps the outer handlers installed and the request.
    assert outer.requested and outer.signal_name == 'SIGTERM'
    assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None)


def test_while_blocked_ends_a_wait_inside_tensorflow():
  """The main thread waits in a C++ dequeue, where no Python handler can run."""
  queue = tf.queue.FIFOQueue(1, tf.float32)
  closed_by = []

  def close(name):
    closed_by.append(name)
    queue.close(cancel_pending_enqueues=True)

  with training.StopRequest() as stop:
    with stop.while_blocked(close):
      _signal_soon(signal.SIGTERM)
      start = time.time()
      with pytest.raises(tf.errors.OutOfRangeError):
        queue.dequeue()  # would block forever
      waited = time.time() - start
    assert closed_by == ['SIGTERM'] and stop.requested
  assert waited < PROMPT_SECS


def test_while_blocked_runs_at_once_when_already_requested():
  calls = []
  with training.StopRequest() as stop:
    os.kill(os.getpid(), signal.SIGINT)
    assert stop.wait(PROMPT_SECS)
    with stop.while_blocked(calls.append):
      assert calls == ['SIGINT']


def test_callbacks_do_not_outlive_their_block():
  calls = []
  with training.StopRequest() as stop:
    with stop.while_blocked(calls.append):
      pass
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop.wait(PROMPT_SECS)
    time.sleep(0.2)  # the watcher has run whatever it would run
  assert calls == []


@pytest.mark.slow
@pytest.mark.parametrize('sig', [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_a_second_signal_ends_the_process_at_once(sig):
  # The main thread never reaches a step boundary (it sleeps in C).
  script = textwrap.dedent('''
      import os, signal, sys, time
      sys.path.insert(0, %r)
      from cifar10_towers.runtime import training
      with training.StopRequest():
        print('ready', flush=True)
        time.sleep(60)
      print('not reached', flush=True)
  ''' % ROOT)
  proc = subprocess.Popen([sys.executable, '-c', script], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  try:
    assert proc.stdout.readline().strip() == 'ready'
    proc.send_signal(sig)
    time.sleep(0.3)
    start = time.time()
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=30)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == 128 + sig
  assert time.time() - start < PROMPT_SECS
  assert 'not reached' not in out
  assert err.strip() == ('%s again: stopping at once, without saving; the steps '
                         'since the last checkpoint are lost.' % sig.name)


def test_raising_ends_the_block_at_once_and_only_there():
  """In a `raising` block a signal raises Stopped in the main thread; outside, it only marks."""
  with training.StopRequest() as stop:
    with pytest.raises(training.Stopped) as raised:
      with stop.raising():
        _signal_soon(signal.SIGTERM, delay=0.2)
        time.sleep(30)  # interrupted: the handler raises here
    assert str(raised.value) == ('Stopped by SIGTERM before the first step; '
                                 'nothing was saved.')
    assert stop.requested
    with pytest.raises(training.Stopped):  # requested before: raises at entry
      with stop.raising():
        pass
  with training.StopRequest() as stop:
    with stop.raising():
      pass
    os.kill(os.getpid(), signal.SIGINT)  # outside the block: a flag only
    assert stop.wait(PROMPT_SECS) and stop.signal_name == 'SIGINT'


def test_a_stop_that_library_code_turned_into_another_error_is_still_the_stop():
  """The handler's Stopped can land inside library code that makes another error of it
  (seen: a SIGTERM during modern's first trace ended as TensorFlow's "Could not pack
  sequence", after its C code had printed CPython's SystemError from the Stopped as an
  ignored exception); leaving the block it is the stop again, with that error as its
  cause, and nothing prints the Stopped as ignored. An error in a block no signal
  interrupted stays itself, and other ignored exceptions still print."""
  printed = []
  before = sys.unraisablehook
  recorder = sys.unraisablehook = lambda info: printed.append(info.exc_value)
  try:
    with training.StopRequest() as stop:
      with pytest.raises(training.Stopped) as raised:
        with stop.raising():
          try:
            _signal_soon(signal.SIGTERM, delay=0.2)
            time.sleep(30)  # interrupted: the handler raises here
          except training.Stopped as e:  # what the library made of it
            system_error = SystemError('__import__ returned a result with an exception set')
            system_error.__cause__ = e
            other = RuntimeError('not the stop')
            for error in (system_error, other):  # as C code that cannot raise reports them
              sys.unraisablehook(types.SimpleNamespace(exc_value=error))
            raise ValueError('Could not pack sequence.') from e
      assert raised.value.signal_name == 'SIGTERM'
      assert isinstance(raised.value.__cause__, ValueError)
      assert printed == [other]
    assert sys.unraisablehook is recorder  # the hook as it was
  finally:
    sys.unraisablehook = before
  with training.StopRequest() as stop:
    with pytest.raises(ValueError, match='not a stop'):
      with stop.raising():
        raise ValueError('not a stop')
    assert not stop.requested


@pytest.mark.slow
def test_a_second_signal_ends_the_process_even_while_a_callback_blocks():
  script = textwrap.dedent('''
      import sys, threading, time
      sys.path.insert(0, %r)
      from cifar10_towers.runtime import training
      with training.StopRequest() as stop:
        with stop.while_blocked(lambda name: threading.Event().wait()):
          print('ready', flush=True)
          time.sleep(60)
  ''' % ROOT)
  proc = subprocess.Popen([sys.executable, '-c', script], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  try:
    assert proc.stdout.readline().strip() == 'ready'
    proc.send_signal(signal.SIGTERM)  # its callback never returns
    time.sleep(0.3)
    start = time.time()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == 128 + signal.SIGTERM
  assert time.time() - start < PROMPT_SECS
  assert err.strip().startswith('SIGTERM again: stopping at once')


def test_leaving_a_block_waits_for_its_running_callback():
  """A callback may use what the block's owner closes right after the block."""
  events = []

  def slow(name):
    events.append('callback starts')
    time.sleep(0.5)
    events.append('callback ends')

  with training.StopRequest() as stop:
    with stop.while_blocked(slow):
      os.kill(os.getpid(), signal.SIGTERM)
      assert stop.wait(PROMPT_SECS)
      deadline = time.time() + PROMPT_SECS
      while not events and time.time() < deadline:
        time.sleep(0.01)
    events.append('block left')
  assert events == ['callback starts', 'callback ends', 'block left']


@pytest.mark.slow
def test_without_the_cli_a_warning_of_the_library_still_reaches_stderr():
  """The library configures no logging: logging's last resort shows its warnings."""
  script = ('from cifar10_towers.runtime import training\n'
            'training._run_callback(lambda name: 1 / 0, "SIGTERM")\n')
  proc = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True,
                        timeout=60, check=False)
  assert proc.returncode == 0, proc.stderr
  assert 'while stopping: ZeroDivisionError: division by zero' in proc.stderr.splitlines()
