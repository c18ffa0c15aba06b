"""A second Ctrl-C and kill -9 during training, with real `python cli.py` processes.

(A first SIGINT / SIGTERM after a step - the step saved, one line, 128 + the
signal's number within 10 s - is tests/test_faults_runs.py's phase table.)
- A second SIGINT during the stop's save ends the run at once, unsaved.
- kill -9 at random moments: the next run resumes from the newest intact
  checkpoint, losing only the steps since the last completed save, and the
  last run finishes at max_steps. FAULTS_KILLS / FAULTS_KILL_STEPS /
  FAULTS_SEED scale it up (the issue's full version: 10 kills, 200 steps).
The processes are forked from tests/fork_server.py (no TensorFlow import each).
"""

import os
import random
import re
import signal
import threading
import time

import pytest
import tensorflow as tf

import faults_support as fs
from cifar10_towers.runtime import checkpoints

# Where a save is held, named here so that a rename fails at collection.
_SAVE = {impl: checkpoints.StepSaver.__call__ for impl in fs.TRAINERS}  # one save path

STEP_LINE = re.compile(r': step (\d+), loss = ')
EXIT_WITHIN_SECS = 10


def _step(line):
  match = STEP_LINE.search(line or '')
  return int(match.group(1)) if match else None


def _steps_logged(text):
  return [int(m.group(1)) for m in STEP_LINE.finditer(text)]


def _complete_saves_below(step, save_every, start):
  """The newest save step < `step` (a save of it finished before `step` began)."""
  last = (step - 1) // save_every * save_every
  return max(last, start)


def _saving(train_dir, step):
  """True once the save of `step` has begun writing (temp files or its own)."""
  for name in os.listdir(train_dir):
    if ('tempstate' in name or name.endswith('_temp')
        or name.startswith('model.ckpt-%d.' % step)):
      return True
  return False


def kill_and_resume(impl, data_dir, train_dir, max_steps, save_every, kills, rng):
  """Kills a training run `kills` times at random moments, then lets it finish.

  The kill steps are spread over the run at random. Half of the kills come
  0-50 ms after that step was logged; the other half are aimed at a save: at
  the next save step, as soon as its files start to appear, plus 0-5 ms.

  Returns:
    list of dicts per kill: killed_after (last step logged), resumed (step
    the next run resumed from), lost (steps trained but lost), mid_save
    (the kill left an incomplete checkpoint behind, or a complete one not
    yet named latest); and the final run's (exit code, stdout, stderr).
  """
  # Batches of 32, not 8: at upstream's learning rate of 0.1, batches of 8 now
  # and then diverge within 200 steps (which the trainer reports, exit 1).
  args = [impl, '--data_dir', data_dir, '--train_dir', train_dir,
          '--max_steps', max_steps, '--save_every', save_every,
          '--batch_size', 32, '--log_every', 1, '--summary_every', 1000]
  records, start = [], 0
  targets = sorted(rng.sample(range(1, max_steps), kills))
  for target in targets:
    target = max(target, start + 1)
    aim_at_save = rng.random() < 0.5
    if aim_at_save:  # the next save step that is not the last step
      target = -(-target // save_every) * save_every
      if target >= max_steps:
        target, aim_at_save = max_steps - 1, False
    if target >= max_steps:
      break
    run = fs.Running(args, forked=True)
    line = run.wait_for(lambda l, t=target: (_step(l) or 0) >= t)
    if aim_at_save:
      deadline = time.time() + 1.0
      while not _saving(train_dir, target) and time.time() < deadline:
        time.sleep(0.0005)
      time.sleep(rng.uniform(0.0, 0.005))
    else:
      time.sleep(rng.uniform(0.0, 0.05))
    code, out, err = run.kill()
    assert line is not None and code == -signal.SIGKILL, (code, err[-2000:])
    assert 'Traceback' not in err
    killed_after = max(_steps_logged(out))
    # (resume_point removes them, so these are this kill's.)
    leftovers = [n for n in os.listdir(train_dir)
                 if 'tempstate' in n or n.endswith('_temp')]
    resumed_path = checkpoints.resume_point(train_dir)
    resumed = checkpoints.step_of(resumed_path) if resumed_path else 0
    # Nothing completed is lost: every save that finished before the last
    # logged step began is there (or a newer one), and nothing newer than
    # what was trained.
    assert _complete_saves_below(killed_after, save_every, start) <= resumed
    assert resumed <= killed_after
    newer = [n for n in os.listdir(train_dir) if n.endswith('.index')
             and (checkpoints.step_of(n[:-len('.index')]) or 0) > resumed]
    named = tf.train.latest_checkpoint(train_dir)
    records.append(dict(
        killed_after=killed_after, resumed=resumed, lost=killed_after - resumed,
        aimed_at_save=aim_at_save,
        # The kill left a save half-done, or done but not yet named latest.
        mid_save=bool(leftovers or newer) or (
            named is not None and checkpoints.step_of(named) != resumed)))
    start = resumed
  run = fs.Running(args, forked=True)
  code, out, err = run.finish(timeout=300)
  if start:
    # The next run says where it resumes from.
    assert ('Resuming from %s at global step %d.'
            % (os.path.join(train_dir, 'model.ckpt-%d' % start), start)) in out, out
  return records, (code, out, err)


KILLS = int(os.environ.get('FAULTS_KILLS', 3))
KILL_STEPS = int(os.environ.get('FAULTS_KILL_STEPS', 60))
KILL_SAVE_EVERY = 10


@pytest.fixture(scope='module')
def kill_runs(synth_data_dir, tmp_path_factory):
  """Both trainers' kill_and_resume at once (each in a thread of its own):
  impl -> (train_dir, its result or the exception it raised)."""
  seed = int(os.environ.get('FAULTS_SEED', 4))
  results = {}

  def run(impl):
    train_dir = str(tmp_path_factory.mktemp('%s_kills' % impl) / 'train')
    try:
      results[impl] = train_dir, kill_and_resume(
          impl, synth_data_dir, train_dir, KILL_STEPS, KILL_SAVE_EVERY, KILLS,
          random.Random('%s-%d' % (impl, seed)))
    except BaseException as e:  # pylint: disable=broad-except
      results[impl] = train_dir, e

  threads = [threading.Thread(target=run, args=(impl,)) for impl in fs.TRAINERS]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  return results


@pytest.mark.slow
@pytest.mark.parametrize('impl', fs.TRAINERS)
def test_kill_9_at_random_moments_then_resume_finishes(kill_runs, impl):
  kills, max_steps, save_every = KILLS, KILL_STEPS, KILL_SAVE_EVERY
  train_dir, result = kill_runs[impl]
  if isinstance(result, BaseException):
    raise result
  records, (code, out, err) = result
  print('\n%s: %d kills during a %d-step run (save_every %d):' % (
      impl, len(records), max_steps, save_every))
  for r in records:
    print('  killed after step %(killed_after)d%(how)s -> resumed at %(resumed)d, '
          'lost %(lost)d step(s)%(mid)s' % dict(
              r, how=' (aimed at a save)' if r['aimed_at_save'] else '',
              mid=', inside a save' if r['mid_save'] else ''))
  assert len(records) == kills
  assert code == 0, err[-2000:]
  assert 'Traceback' not in err
  final = os.path.join(train_dir, 'model.ckpt-%d' % max_steps)
  assert checkpoints.resume_point(train_dir) == final
  checkpoints.read(final)
  key = 'global_step' if impl == 'legacy' else 'global_step/.ATTRIBUTES/VARIABLE_VALUE'
  assert tf.train.load_variable(final, key) == max_steps
  # A run loses at most the steps since the last completed save.
  assert all(r['lost'] <= save_every for r in records), records


@pytest.fixture(scope='module')
def second_sigint_runs(synth_data_dir, tmp_path_factory):
  """Each trainer given Ctrl-C twice: at step >= 3, and again during the stop's save.

  A test hook holds the save for 30 s after the marker 'HOOK save', so the
  second signal surely comes during it.

  Returns:
    dict impl -> (train_dir, seconds from the second signal to the exit,
    exit code, stdout, stderr).
  """
  save = _SAVE
  runs = {}
  for impl in fs.TRAINERS:
    base = tmp_path_factory.mktemp('%s_sigint_twice' % impl)
    train_dir = str(base / 'train')
    runs[impl] = (train_dir, fs.Running(
        [impl, '--data_dir', synth_data_dir, '--train_dir', train_dir,
         '--max_steps', 100000, '--save_every', 100000] + list(fs.FAST_FLAGS),
        env=fs.hooks_env(str(base / 'hooks'),
                         [fs.hook(save[impl], say='HOOK save', dwell=30)]),
        forked=True))
  results = {}
  try:
    for impl, (train_dir, run) in runs.items():
      assert run.wait_for(lambda l: (_step(l) or 0) >= 3) is not None, run.stderr[-20:]
      run.proc.send_signal(signal.SIGSTOP)
    for impl, (train_dir, run) in runs.items():
      run.proc.send_signal(signal.SIGCONT)
      run.proc.send_signal(signal.SIGINT)
      assert run.wait_for(lambda l: l == 'HOOK save') == 'HOOK save', run.stderr[-20:]
      start = time.time()
      run.proc.send_signal(signal.SIGINT)
      code, out, err = run.finish(timeout=60)
      results[impl] = (train_dir, run.exited - start, code, out, err)
  finally:
    for _, run in runs.values():
      if run.proc.poll() is None:
        run.proc.send_signal(signal.SIGCONT)
        run.kill()
  return results


@pytest.mark.slow
@pytest.mark.parametrize('impl', fs.TRAINERS)
def test_a_second_sigint_ends_the_run_at_once_without_saving(second_sigint_runs,
                                                             impl):
  train_dir, seconds, code, out, err = second_sigint_runs[impl]
  assert 'Traceback' not in out + err, err[-2000:]
  assert fs.ours(err)[-1] == (
      'SIGINT again: stopping at once, without saving; the steps since the last '
      'checkpoint are lost.')
  assert code == 130
  # At once: not after the 30 s the save in progress would have taken.
  assert seconds < fs.exit_bound(EXIT_WITHIN_SECS)
  assert 'Stopped by' not in out + err
  assert not [n for n in os.listdir(train_dir) if n.startswith('model.ckpt')]
