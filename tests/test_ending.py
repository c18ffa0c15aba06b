"""How a run ends on a stop signal (docs/ending.md), as a table over the signals.

In this process (CliRunner): the signal is sent to this process by a hook
at a seeded step, so only the one ending path (the StopRequest's handler,
the loop's boundary, its save, the ending line, the exit status) can have
written the checkpoint: --save_every is far beyond it. Real processes,
signals from outside, a second signal and the timing are tested in
tests/test_faults_interrupt.py and tests/test_faults_runs.py.
"""

import os
import random
import re
import signal

import pytest

import faults_support as fs
from cifar10_towers.common import checkpoints
from cifar10_towers.common import training

ALL_SIGNALS = ('SIGHUP', 'SIGINT', 'SIGQUIT', 'SIGTERM', 'SIGUSR1', 'SIGUSR2',
               'SIGALRM', 'SIGXCPU', 'SIGPWR')
THREE = ('SIGINT', 'SIGTERM', 'SIGUSR1')
# legacy gets every stop signal; modern three (the same handler serves both).
CASES = [('legacy', name) for name in ALL_SIGNALS] + [('modern', name) for name in THREE]
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


@pytest.mark.slow
@pytest.mark.parametrize('impl,name', CASES,
                         ids=['%s-%s-at-step-%d' % (c + (STEPS[c],)) for c in CASES])
def test_a_stop_signal_saves_the_step_says_one_line_and_resumes(
    impl, name, synth_data_dir, tmp_path, monkeypatch):
  step = STEPS[impl, name]
  train_dir = str(tmp_path / 'train')
  args = [impl, '--data_dir', synth_data_dir, '--train_dir', train_dir,
          '--max_steps', 1000, '--save_every', 1000] + list(fs.FAST_FLAGS)
  _signal_at(monkeypatch, step, name)
  code, out, err, exception = fs.invoke_cli(args)
  assert exception is None, exception
  assert code == 128 + getattr(signal, name), err
  path = os.path.join(train_dir, 'model.ckpt-%d' % step)
  assert fs.ours(err)[-1] == ('Stopped by %s at global step %d; saved %s. The same '
                              'command resumes from it.' % (name, step, path)), err
  assert [int(s) for s in re.findall(r': step (\d+), loss', out)][-1] == step
  assert checkpoints.resume_point(train_dir) == path

  monkeypatch.undo()
  args[args.index('--max_steps') + 1] = step + 1
  code, out, err, exception = fs.invoke_cli(args)
  assert (code, exception) == (0, None), err
  assert 'Resuming from %s at global step %d.' % (path, step) in out.splitlines()
  assert checkpoints.resume_point(train_dir) == os.path.join(
      train_dir, 'model.ckpt-%d' % (step + 1))
