"""How a run ends on a stop signal (docs/ending.md), as a table over the signals.

In this process (CliRunner): the signal is sent to this process by a hook
at a seeded step, so only the one ending path (the StopRequest's handler,
the loop's boundary, its save, the ending line, the exit status) can have
written the checkpoint: --save_every is far beyond it. Each trainer's signals
run as one chain: each run resumes from the stop before it. Real processes,
signals from outside, a second signal and the timing are tested in
tests/test_faults_interrupt.py and tests/test_faults_runs.py.
"""

import errno
import os
import random
import re
import shutil
import signal
import subprocess
import sys

import pytest

import faults_support as fs
from cifar10_towers.modern import engines
from cifar10_towers.runtime import checkpoints
from cifar10_towers.runtime import training

# What the modern cases inject into, named here so that a rename fails at collection.
_MODERN_WRITE = engines.Towers.write_summaries
_MODERN_STEP = engines.Towers.run_step  # the engine's step

ALL_SIGNALS = ('SIGHUP', 'SIGINT', 'SIGQUIT', 'SIGTERM', 'SIGUSR1', 'SIGUSR2',
               'SIGALRM', 'SIGXCPU', 'SIGPWR')
# One handler serves every stop signal (installed for each: the test below; each
# one's name and exit status: tests/test_stop_request.py): legacy trains through
# four of them, modern three.
CASES = [('legacy', name) for name in ('SIGHUP', 'SIGINT', 'SIGTERM', 'SIGUSR2')] + [
    ('modern', name) for name in ('SIGINT', 'SIGTERM', 'SIGUSR1')]
_SEEDED = random.Random(20)  # the step of each case: seeded, named in its id
STEPS = {case: _SEEDED.randint(2, 5) for case in CASES}


def test_the_installed_handlers_are_exactly_the_list():
  assert tuple(signal.Signals(s).name for s in training.STOP_SIGNALS) == ALL_SIGNALS
  before = {s: signal.getsignal(s) for s in signal.valid_signals()
            if s not in (signal.SIGKILL, signal.SIGSTOP)}
  signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
  try:
    with training.StopRequest():
      handled = {s for s in before if signal.getsignal(s) != (
          signal.SIG_IGN if s == signal.SIGHUP else before[s])}
      assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN  # stays ignored
    assert {signal.Signals(s).name for s in handled} == set(ALL_SIGNALS) - {'SIGHUP'}
  finally:
    signal.signal(signal.SIGHUP, before[signal.SIGHUP])
  after = {s: signal.getsignal(s) for s in before}
  assert after == before  # every handler is given back


def _signal_at(monkeypatch, step, name):
  """Sends `name` to this process when the trainer has finished `step` steps of this run."""
  add = training.LogWindow.add
  done = [0]

  def add_and_signal(self, seconds, images, extra=False):
    add(self, seconds, images, extra)
    done[0] += 1
    if done[0] == step:
      os.kill(os.getpid(), getattr(signal, name))
  monkeypatch.setattr(training.LogWindow, 'add', add_and_signal)


@pytest.fixture(scope='module')
def stopped_runs(synth_data_dir, tmp_path_factory):
  """Each trainer's cases as one chain of runs in one train_dir, in this process.

  Run k is stopped by case k's signal at its seeded step of that run, and run
  k + 1 resumes from what it saved (and is stopped in turn); a last run
  resumes from the last stop and trains one step more.

  Returns:
    dict case -> dict: the global step of its stop, its run's (code, stdout,
    stderr, exception) and the resume point after it, and the same of the
    run that resumed from it ('next', 'next_resume_point') with that run's
    last global step ('next_step') and whether it was the last run
    ('next_is_last').
  """
  runs = {}
  for impl in fs.TRAINERS:
    train_dir = str(tmp_path_factory.mktemp('%s_stops' % impl) / 'train')
    args = [impl, '--data_dir', synth_data_dir, '--train_dir', train_dir,
            '--max_steps', 1000, '--save_every', 1000] + list(fs.FAST_FLAGS)
    chain = [case for case in CASES if case[0] == impl]
    step, previous = 0, None
    for case in chain + [None]:
      with pytest.MonkeyPatch.context() as monkeypatch:
        if case is not None:
          _signal_at(monkeypatch, STEPS[case], case[1])
          step += STEPS[case]
        else:  # the last run: one more step
          step += 1
          args[args.index('--max_steps') + 1] = step
        result = fs.invoke_cli(args)
      resume_point = checkpoints.resume_point(train_dir)
      if previous is not None:
        runs[previous].update(next=result, next_resume_point=resume_point,
                              next_step=step, next_is_last=case is None)
      if case is not None:
        runs[case] = dict(train_dir=train_dir, step=step, run=result,
                          resume_point=resume_point)
      previous = case
  return runs


@pytest.mark.slow
@pytest.mark.parametrize('impl,name', CASES,
                         ids=['%s-%s-at-step-%d' % (c + (STEPS[c],)) for c in CASES])
def test_a_stop_signal_saves_the_step_says_one_line_and_resumes(impl, name, stopped_runs):
  stopped = stopped_runs[impl, name]
  step, train_dir = stopped['step'], stopped['train_dir']
  code, out, err, exception = stopped['run']
  assert exception is None, exception
  assert code == 128 + getattr(signal, name), err
  path = os.path.join(train_dir, 'model.ckpt-%d' % step)
  assert fs.ours(err)[-1] == ('Stopped by %s at global step %d; saved %s. The same '
                              'command resumes from it.' % (name, step, path)), err
  assert [int(s) for s in re.findall(r': step (\d+), loss', out)][-1] == step
  assert stopped['resume_point'] == path

  # The next run resumes from it and trains on (to its own stop, or to max_steps).
  code, out, err, exception = stopped['next']
  assert exception is None, exception
  if stopped['next_is_last']:
    assert code == 0, err  # (a run stopped in turn: its own case checks its status)
  assert 'Resuming from %s at global step %d.' % (path, step) in out.splitlines()
  assert stopped['next_step'] > step
  assert stopped['next_resume_point'] == os.path.join(
      train_dir, 'model.ckpt-%d' % stopped['next_step'])


# --- a failure crossing the loop: one table over the exception boundaries -------

def _nth_call(monkeypatch, owner, name, n, error):
  """From the nth call on, `owner.name` raises `error` instead of running."""
  real = getattr(owner, name)
  calls = [0]

  def wrapper(*args, **kwargs):
    calls[0] += 1
    if calls[0] >= n:
      raise error
    return real(*args, **kwargs)
  monkeypatch.setattr(owner, name, wrapper)


def _inject_input(monkeypatch, impl, step, ctx):
  """The data files are deleted after `step` steps: the pipeline fails to read."""
  del impl
  add, done = training.LogWindow.add, [0]

  def add_then_delete(self, *args, **kwargs):
    add(self, *args, **kwargs)
    done[0] += 1
    if done[0] == step:
      for name in os.listdir(ctx['batches']):
        if name.startswith('data_batch_'):
          os.remove(os.path.join(ctx['batches'], name))
  monkeypatch.setattr(training.LogWindow, 'add', add_then_delete)


def _inject_stdout(monkeypatch, impl, step, ctx):
  """stdout's reader goes away (`| head`): the log line of step+1 cannot be written."""
  del impl, ctx
  import click  # pylint: disable=import-outside-toplevel
  echo = click.echo

  def failing_echo(message=None, *args, **kwargs):
    if kwargs.get('err') or ': step %d, loss' % (step + 1) not in str(message):
      return echo(message, *args, **kwargs)
    raise BrokenPipeError(errno.EPIPE, 'Broken pipe')
  monkeypatch.setattr(click, 'echo', failing_echo)


def _inject_summaries(monkeypatch, impl, step, ctx):
  """The summary writer fails at step+1 (--summary_every 1 from step+1 on)."""
  del ctx
  error = OSError(errno.ENOSPC, 'No space left on device')
  if impl == 'legacy':
    import tensorflow.compat.v1 as tf1  # pylint: disable=import-outside-toplevel
    _nth_call(monkeypatch, tf1.summary.FileWriter, 'add_summary', step + 1, error)
  else:
    _nth_call(monkeypatch, engines.Towers, _MODERN_WRITE.__name__, step + 1, error)


def _inject_step(monkeypatch, impl, step, ctx):
  """The device fails in step+1, before its update."""
  del ctx
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  error = tf.errors.InternalError(None, None, 'the device failed (injected)')
  if impl == 'legacy':
    import tensorflow.compat.v1 as tf1  # pylint: disable=import-outside-toplevel
    real, calls = tf1.Session.run, [0]

    def run(self, fetches, *args, **kwargs):
      if isinstance(fetches, list) and len(fetches) >= 3:  # the loop's step
        calls[0] += 1
        if calls[0] == step + 1:
          raise error
      return real(self, fetches, *args, **kwargs)
    monkeypatch.setattr(tf1.Session, 'run', run)
  else:
    _nth_call(monkeypatch, engines.Towers, _MODERN_STEP.__name__, step + 1, error)


def _inject_saver(monkeypatch, impl, step, ctx):
  """The disk is full from step+1 on: the periodic save of step+1 fails, and so does a retry."""
  del ctx
  error = OSError(errno.ENOSPC, 'No space left on device')
  if impl == 'legacy':
    import tensorflow.compat.v1 as tf1  # pylint: disable=import-outside-toplevel
    _nth_call(monkeypatch, tf1.train.Saver, 'save', 1, error)
  else:
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    _nth_call(monkeypatch, tf.train.CheckpointManager, 'save', 1, error)


# boundary -> (inject, --save_every (None: far beyond; 'next': the fault's
# step), the ending line's cause, and what is kept: 'saved' the step the
# fault came after, 'next' the step after it (the fault came after its
# update: its log line, its summaries), 'none' no checkpoint).
BOUNDARIES = {
    'input files': (_inject_input, None,
                    r'TensorFlow failed \(not found\): \S+data_batch_\d\.bin; No such '
                    r'file or directory\.', 'saved'),
    'stdout closed': (_inject_stdout, None,
                      r'stdout closed \(Broken pipe: a '
                      r'pipe\'s reader ended or the terminal is gone\)\.', 'next'),
    'summary writer': (_inject_summaries, None,
                       r'could not write TensorBoard summaries in \S+ \(\[Errno 28\] No '
                       r'space left on device\)\. Free space on that disk, or pass '
                       r'another --train_dir\.', 'next'),
    'device in the step': (_inject_step, None,
                           r'TensorFlow failed \(internal\): the device failed '
                           r'\(injected\)\.', 'saved'),
    'checkpoint saver': (_inject_saver, 'next', r'could not write checkpoint '
                         r'model\.ckpt-\d+ in \S+ \(\[Errno 28\] No space left on '
                         r'device\)\. Free space on that disk, or pass another '
                         r'--train_dir\.', 'none'),
}
FAULTS = [(impl, b) for b in BOUNDARIES for impl in fs.TRAINERS]
FAULT_STEPS = {case: _SEEDED.randint(2, 4) for case in FAULTS}


@pytest.mark.slow
@pytest.mark.parametrize('impl,boundary', FAULTS, ids=[
    '%s-%s-after-step-%d' % (c + (FAULT_STEPS[c],)) for c in FAULTS])
def test_a_failure_crossing_the_loop_keeps_the_last_step_in_one_line(
    impl, boundary, synth_data_dir, tmp_path, monkeypatch):
  inject, save_every, said, kept = BOUNDARIES[boundary]
  step = FAULT_STEPS[impl, boundary]
  data_dir = str(tmp_path / 'data')
  shutil.copytree(synth_data_dir, data_dir)
  train_dir = str(tmp_path / 'train')
  args = [impl, '--data_dir', data_dir, '--train_dir', train_dir, '--max_steps', 1000,
          '--save_every', step + 1 if save_every else 1000, '--batch_size', 8,
          '--log_every', 1, '--summary_every', 1 if boundary == 'summary writer' else 1000]
  inject(monkeypatch, impl, step, {'batches': os.path.join(data_dir, 'cifar-10-batches-bin')})
  code, out, err, exception = fs.invoke_cli(args)
  assert exception is None, exception
  assert code == 1, err
  ending = fs.ours(err)[-1]
  logged = [int(s) for s in re.findall(r': step (\d+), loss', out)]
  if boundary == 'input files':
    # The queue or buffer holds records read before the deletion: the read
    # fails a few steps later, at the last step logged.
    assert logged and logged[-1] >= step, out
    step = logged[-1]
  if kept == 'next':
    step += 1
  path = os.path.join(train_dir, 'model.ckpt-%d' % step)
  if kept in ('saved', 'next'):
    assert re.fullmatch(r'Error: %s Saved global step %d to %s; the same command resumes '
                        r'from it\.' % (said, step, re.escape(path)), ending), ending
    assert checkpoints.resume_point(train_dir) == path
    resumed = step
  else:
    assert re.fullmatch(r'Error: %s No checkpoint was written; the same command starts '
                        r'again at step 0\.' % said, ending), ending
    assert checkpoints.resume_point(train_dir) is None
    resumed = 0
  assert 'Traceback' not in out + err and '{{node' not in err

  monkeypatch.undo()
  if boundary == 'input files':
    shutil.rmtree(data_dir)
    shutil.copytree(synth_data_dir, data_dir)
  args[args.index('--max_steps') + 1] = resumed + 1
  code, out, err, exception = fs.invoke_cli(args)
  assert (code, exception) == (0, None), err
  if resumed:
    assert 'Resuming from %s at global step %d.' % (path, step) in out.splitlines()
  assert checkpoints.resume_point(train_dir) == os.path.join(
      train_dir, 'model.ckpt-%d' % (resumed + 1))


# --- a real closed stream: a real process -------------------------------------------

@pytest.mark.slow
def test_stdout_closed_by_head_under_a_modern_run(synth_data_dir, tmp_path):
  """`modern ... | head -N`: the first write after head left ends the run, saved, said on stderr."""
  lines = FAULT_STEPS['modern', 'stdout closed']  # head keeps this many lines
  train_dir = str(tmp_path / 'train')
  args = ['modern', '--data_dir', synth_data_dir, '--train_dir', train_dir,
          '--max_steps', 100000, '--save_every', 100000] + list(fs.FAST_FLAGS)
  # `python cli.py ARGS | head -N`, the run forked by the fork server.
  head = subprocess.Popen(['head', '-%d' % lines], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True)
  try:
    run = fs.spawn_cli(args, stdout=head.stdin.fileno())
  finally:
    head.stdin.close()
  kept = head.stdout.read().splitlines()
  head.wait(timeout=60)
  _, stderr = run.communicate(timeout=180)
  assert run.returncode == 1, stderr[-2000:]
  assert len(kept) == lines
  match = re.fullmatch(
      r'Error: stdout closed \(Broken pipe: a pipe\'s reader '
      r'ended or the terminal is gone\)\. Saved global step (\d+) to %s/model\.ckpt-(\d+); '
      r'the same command resumes from it\.' % re.escape(train_dir), fs.ours(stderr)[-1])
  assert match and match.group(1) == match.group(2), stderr[-2000:]
  saved = int(match.group(1))
  assert checkpoints.resume_point(train_dir) == os.path.join(train_dir, 'model.ckpt-%d' % saved)
  assert 'Traceback' not in stderr and 'Exception ignored' not in stderr
  args[args.index('--max_steps') + 1] = saved + 1
  code, out, err, exception = fs.invoke_cli(args)
  assert (code, exception) == (0, None), err
  assert 'Resuming from %s/model.ckpt-%d at global step %d.' % (
      train_dir, saved, saved) in out.splitlines()


@pytest.mark.slow
@pytest.mark.parametrize('impl', fs.TRAINERS)
def test_stdout_on_a_full_disk_ends_a_run_saying_what_it_kept(impl, synth_data_dir, tmp_path):
  """`legacy ... > /dev/full`: legacy's first line comes before its first step, modern's
  after it; either way one line names stdout and what was kept, and the same command resumes."""
  train_dir = str(tmp_path / 'train')
  args = [impl, '--data_dir', synth_data_dir, '--train_dir', train_dir,
          '--max_steps', 2] + list(fs.FAST_FLAGS)
  with open('/dev/full', 'w', encoding='utf-8') as full:
    run = fs.spawn_cli(args, stdout=full.fileno())
  _, stderr = run.communicate(timeout=180)
  assert run.returncode == 1, stderr[-2000:]
  assert 'Traceback' not in stderr and 'Exception ignored' not in stderr, stderr[-2000:]
  ending = fs.ours(stderr)[-1]
  said = r'Error: stdout closed \(No space left on device\)'
  saved = re.fullmatch(said + r'\. Saved global step (\d+) to %s/model\.ckpt-(\d+); the same '
                       r'command resumes from it\.' % re.escape(train_dir), ending)
  if saved:
    assert saved.group(1) == saved.group(2), ending
    step = int(saved.group(1))
    assert checkpoints.resume_point(train_dir) == os.path.join(train_dir, 'model.ckpt-%d' % step)
  else:
    assert re.fullmatch(said + r' before the first step; nothing was saved\.', ending), ending
    assert not os.path.isdir(train_dir) or checkpoints.resume_point(train_dir) is None
    step = 0
  code, out, err, exception = fs.invoke_cli(args)
  assert (code, exception) == (0, None), err
  assert bool(step) == ('Resuming from %s/model.ckpt-%d at global step %d.' % (
      train_dir, step, step) in out.splitlines()), out
  assert checkpoints.resume_point(train_dir) == os.path.join(train_dir, 'model.ckpt-2')


@pytest.mark.slow
def test_both_streams_on_a_full_disk_end_a_run_with_status_1(synth_data_dir, tmp_path):
  """Nowhere to say it: still a failure's status, and no run left behind."""
  train_dir = str(tmp_path / 'train')
  with open('/dev/full', 'w', encoding='utf-8') as full:
    result = subprocess.run(
        [sys.executable, fs.CLI, 'legacy', '--data_dir', synth_data_dir, '--train_dir',
         train_dir, '--max_steps', '2', *fs.FAST_FLAGS], cwd=fs.ROOT, env=fs.cli_env(),
        stdout=full, stderr=full, timeout=180, check=False)
  assert result.returncode == 1
  assert not os.path.isdir(train_dir) or checkpoints.resume_point(train_dir) is None


def test_stdout_full_under_another_command_is_one_line(synth_data_dir, monkeypatch):
  import click  # pylint: disable=import-outside-toplevel
  echo = click.echo

  def full(message=None, *args, **kwargs):
    if kwargs.get('err'):
      return echo(message, *args, **kwargs)
    raise OSError(errno.ENOSPC, 'No space left on device')
  monkeypatch.setattr(click, 'echo', full)
  code, _, err, exception = fs.invoke_cli(['data', 'check', '--data_dir', synth_data_dir])
  assert (code, exception) == (1, None), err
  assert fs.ours(err)[-1] == ('Error: stdout closed (No space left on device); `data check` '
                              'did not finish, and left nothing half-written.'), err


@pytest.mark.parametrize('debug', ['1', None], ids=['CIFAR10_TOWERS_DEBUG=1', 'plain'])
def test_a_failure_shows_its_traceback_only_when_asked(debug, synth_data_dir, tmp_path):
  missing = str(tmp_path / 'none')
  code, _, err, exception = fs.invoke_cli(
      ['eval', '--run_once', '--checkpoint_dir', missing, '--data_dir', synth_data_dir],
      env={'CIFAR10_TOWERS_DEBUG': debug})
  assert (code, exception) == (1, None), err
  assert fs.ours(err)[-1].startswith('Error: no checkpoint in %s.' % missing), err
  assert ('Traceback (most recent call last):' in err) == (debug == '1'), err


@pytest.mark.parametrize('stopped', [True, False], ids=['after a stop', 'no stop'])
def test_an_error_that_replaces_a_stop_is_that_stop(stopped, synth_data_dir, tmp_path,
                                                     monkeypatch):
  # A signal's Stopped raised inside `from m import name` reaches us as CPython's
  # "TypeError: expected a message argument" (seen in the tensorflow_import phase
  # of test_faults_runs). With a stop requested it is the stop: its line and
  # 128 + the signal's number; without one it stays the bug it is.
  import click  # pylint: disable=import-outside-toplevel
  from cifar10_towers.common import devices  # pylint: disable=import-outside-toplevel

  def plan_devices(num_gpus):
    if stopped:
      click.get_current_context().obj._stop(signal.SIGTERM)  # the handler's first act
    raise TypeError('expected a message argument')

  monkeypatch.setattr(devices, 'plan_devices', plan_devices)
  code, out, err, exception = fs.invoke_cli(
      ['legacy', '--data_dir', synth_data_dir, '--train_dir', tmp_path / 'train'])
  if stopped:
    assert (code, exception) == (128 + signal.SIGTERM, None), err
    assert fs.ours(err) == ['Stopped by SIGTERM before the first step; nothing was saved.'], err
  else:
    assert isinstance(exception, TypeError), (code, err)
  assert not os.path.exists(tmp_path / 'train' / 'checkpoint')
