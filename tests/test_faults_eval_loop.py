"""The eval loop (`python cli.py eval` without --run_once) beside training.

- Beside a real legacy run that saves every step (so its Saver deletes each
  checkpoint about as soon as eval picks it): every evaluation finishes and
  prints its global step; Ctrl-C ends it with one line and exit 130.
- Started before any checkpoint, it waits and says so; then it evaluates a
  modern run's checkpoints and, in the same directory later, a legacy run's
  (the evaluator is chosen per checkpoint); SIGTERM ends it with exit 143.
- In this process, deterministically: a checkpoint deleted during its
  evaluation is still evaluated whole; a damaged latest checkpoint is
  skipped with one warning, not one per look; a save in progress goes
  unsaid; a signal in the middle of an evaluation cuts it short with one
  line and 128 + the signal's number.
"""

import os
import re
import shutil
import signal

import pytest

import faults_support as fs
from cifar10_towers.runtime import checkpoints
from cifar10_towers.runtime import evaluation

NUM_EXAMPLES = 40  # test records per evaluation
RESULT = re.compile(r'^.*: precision @ 1 = \d\.\d{3} \(global step (\d+), '
                    r'(model\.ckpt-\d+)\)$')


def _results(lines):
  return [(int(m.group(1)), m.group(2)) for m in map(RESULT.match, lines) if m]


def _eval_loop(synth_data_dir, train_dir, *extra):
  return fs.Running(['eval', '--data_dir', synth_data_dir, '--checkpoint_dir',
                     train_dir, '--eval_interval_secs', 1, '--num_examples',
                     NUM_EXAMPLES] + list(extra), forked=True)


def _clean(code, out, err):
  assert 'Traceback' not in out + err, err[-3000:]
  assert not [l for l in err.splitlines() if l.startswith('Error')], err[-3000:]


# --- real processes -------------------------------------------------------------

@pytest.mark.slow
def test_beside_a_legacy_run_that_saves_every_step(synth_data_dir, tmp_path):
  train_dir = str(tmp_path / 'train')
  evaluating = _eval_loop(synth_data_dir, train_dir)
  try:
    waiting = evaluating.wait_for(lambda l: 'yet' in l, timeout=120)
    assert waiting == ('No checkpoint in %s yet; looking again every 1 s.'
                       % train_dir), '\n'.join(evaluating.stderr)
    # The trainer in this process, the eval loop in its own.
    code, _, err, exception = fs.invoke_cli(
        ['legacy', '--data_dir', synth_data_dir, '--train_dir', train_dir,
         '--max_steps', 60, '--save_every', 1] + list(fs.FAST_FLAGS))
    assert (code, exception) == (0, None), err[-2000:]
    assert evaluating.wait_for(lambda l: 'model.ckpt-60)' in l, timeout=120)
  finally:
    if evaluating.proc.poll() is None:
      evaluating.proc.send_signal(signal.SIGINT)
    code, out, err = evaluating.finish(timeout=60)
  print(out, err, sep='\n')
  _clean(code, out, err)
  assert code == 130
  evaluated = _results(out.splitlines())
  steps = [step for step, _ in evaluated]
  assert len(steps) >= 3 and steps == sorted(set(steps)) and steps[-1] == 60
  assert [name for _, name in evaluated] == ['model.ckpt-%d' % s for s in steps]
  # The Saver keeps 5: most checkpoints evaluated were deleted meanwhile.
  assert [s for s in steps if not os.path.exists(
      os.path.join(train_dir, 'model.ckpt-%d.index' % s))]
  assert fs.ours(err)[-1] == (
      'Stopped by SIGINT; evaluated %d checkpoint(s), the last model.ckpt-60 at '
      'global step 60.' % len(steps))


@pytest.mark.slow
def test_either_trainer_in_one_directory_over_time(synth_data_dir, tmp_path):
  """Waits, evaluates modern's model.ckpt-2, then (the dir cleared) legacy's model.ckpt-3."""
  train_dir = str(tmp_path / 'train')
  evaluating = _eval_loop(synth_data_dir, train_dir)
  try:
    assert evaluating.wait_for(lambda l: 'yet' in l, timeout=120)
    code, out, err, exception = fs.invoke_cli(
        ['modern', '--data_dir', synth_data_dir, '--train_dir', train_dir,
         '--max_steps', 2] + list(fs.FAST_FLAGS))
    assert (code, exception) == (0, None), err
    assert evaluating.wait_for(lambda l: RESULT.match(l), timeout=120)
    shutil.rmtree(train_dir)  # a new run from scratch, with the other trainer
    code, out, err, exception = fs.invoke_cli(
        ['legacy', '--data_dir', synth_data_dir, '--train_dir', train_dir,
         '--max_steps', 3] + list(fs.FAST_FLAGS))
    assert (code, exception) == (0, None), err
    assert evaluating.wait_for(lambda l: 'model.ckpt-3)' in l, timeout=120)
  finally:
    if evaluating.proc.poll() is None:
      evaluating.proc.send_signal(signal.SIGTERM)
    code, out, err = evaluating.finish(timeout=60)
  print(out, err, sep='\n')
  _clean(code, out, err)
  assert code == 143
  assert _results(out.splitlines()) == [(2, 'model.ckpt-2'), (3, 'model.ckpt-3')]
  assert fs.ours(err)[-1] == ('Stopped by SIGTERM; evaluated 2 checkpoint(s), '
                              'the last model.ckpt-3 at global step 3.')


# --- in this process ------------------------------------------------------------


def _evaluator(impl, synth_data_dir, during=None):
  """evaluate(contents, should_stop) of `impl`; `during(contents)` runs mid-way."""
  if impl == 'legacy':
    from cifar10_towers.legacy import eval as impl_eval
  else:
    from cifar10_towers.modern import eval as impl_eval

  def evaluate(contents, should_stop):
    asked = []

    def ask():
      asked.append(1)
      if len(asked) == 2 and during is not None:
        during(contents)
      return should_stop()

    return impl_eval.evaluate_contents(contents, synth_data_dir, 8, NUM_EXAMPLES,
                                       ask)
  return evaluate


def _run(train_dir, evaluate, looks, warnings):
  with fs.Logged() as logged:
    results = evaluation.run(train_dir, evaluate, looks, interval_secs=1, max_evals=2)
  warnings.extend(logged.err)
  return [(r.global_step, os.path.basename(r.path)) for r in results], logged.out


@pytest.mark.slow
@pytest.mark.parametrize('impl', fs.TRAINERS)
def test_a_checkpoint_deleted_during_its_evaluation(impl, synth_data_dir, tmp_path):
  """The trainer saves model.ckpt-2 and deletes model.ckpt-1 while it is evaluated."""
  train_dir = fs.copy_trained(impl, synth_data_dir, str(tmp_path / 'train'))
  later = str(tmp_path / 'later')
  os.makedirs(later)
  fs.move_checkpoint(train_dir, 2, later)
  fs.name_latest(train_dir, 1)

  def save_and_delete(contents):
    if contents.path.endswith('-1'):
      fs.move_checkpoint(later, 2, train_dir)
      fs.name_latest(train_dir, 2)
      for name in os.listdir(train_dir):
        if name.startswith('model.ckpt-1.'):
          os.remove(os.path.join(train_dir, name))

  warnings = []
  results, lines = _run(train_dir, _evaluator(impl, synth_data_dir, save_and_delete),
                        fs.ScriptedStop(), warnings)
  assert results == [(1, 'model.ckpt-1'), (2, 'model.ckpt-2')]
  assert (warnings, len(lines)) == ([], 2)
  assert not os.path.exists(os.path.join(train_dir, 'model.ckpt-1.index'))


@pytest.mark.slow
@pytest.mark.parametrize('impl', fs.TRAINERS)
def test_a_damaged_latest_is_said_once_and_a_save_in_progress_not_at_all(
    impl, synth_data_dir, tmp_path):
  pristine = fs.trained_dir(impl, synth_data_dir)

  def restore(step):
    def change():
      for name in os.listdir(pristine):
        if name.startswith('model.ckpt-%d.' % step):
          shutil.copy(os.path.join(pristine, name), train_dir)
    return change

  # The latest checkpoint damaged: skipped, with one warning over three looks,
  # until it is whole again.
  train_dir = fs.copy_trained(impl, synth_data_dir, str(tmp_path / 'damaged'))
  with open(fs.data_file(os.path.join(train_dir, 'model.ckpt-2')), 'r+b') as f:
    f.truncate(100)
  warnings = []
  results, _ = _run(train_dir, _evaluator(impl, synth_data_dir),
                    fs.ScriptedStop(lambda: None, lambda: None, restore(2)), warnings)
  assert results == [(1, 'model.ckpt-1'), (2, 'model.ckpt-2')]
  assert warnings == [
      'skipping %s/model.ckpt-2: it is damaged (Read less bytes than requested); '
      'evaluating the newest intact checkpoint.' % train_dir]

  # A newer checkpoint not yet named and incomplete: a save in progress.
  train_dir = fs.copy_trained(impl, synth_data_dir, str(tmp_path / 'saving'))
  fs.name_latest(train_dir, 1)
  with open(os.path.join(train_dir, 'model.ckpt-2.index'), 'r+b') as f:
    f.truncate(10)

  def finish_save():
    restore(2)()
    fs.name_latest(train_dir, 2)

  warnings = []
  results, _ = _run(train_dir, _evaluator(impl, synth_data_dir),
                    fs.ScriptedStop(finish_save), warnings)
  assert results == [(1, 'model.ckpt-1'), (2, 'model.ckpt-2')]
  assert warnings == []


@pytest.mark.slow
def test_a_checkpoint_gone_between_listing_and_reading(synth_data_dir, tmp_path,
                                                       monkeypatch):
  """A newer checkpoint listed, then deleted before it is read: passed over, unsaid."""
  train_dir = fs.copy_trained('legacy', synth_data_dir, str(tmp_path / 'train'))
  listed = checkpoints.on_disk
  monkeypatch.setattr(checkpoints, checkpoints.on_disk.__name__, lambda d: [
      os.path.join(d, 'model.ckpt-9'), *listed(d)])
  found = checkpoints.newest_intact(train_dir)
  assert os.path.basename(found.contents.path) == 'model.ckpt-2'
  assert (found.skipped, found.unfinished, found.state_problem) == ([], [], None)
  assert checkpoints.skip_notes(found, train_dir, 'evaluating') == []


@pytest.mark.slow
@pytest.mark.parametrize('sig', [signal.SIGINT, signal.SIGTERM],
                         ids=lambda s: s.name)
@pytest.mark.parametrize('impl', fs.TRAINERS)
def test_a_signal_in_the_middle_of_an_evaluation(impl, sig, synth_data_dir, tmp_path,
                                                 monkeypatch):
  """The CLI's loop; the signal comes between two batches of the first evaluation."""
  train_dir = fs.copy_trained(impl, synth_data_dir, str(tmp_path / 'train'))
  if impl == 'legacy':
    from cifar10_towers.legacy import eval as impl_eval
  else:
    from cifar10_towers.modern import eval as impl_eval
  original = impl_eval.evaluate_contents
  batches = []

  def signalled(contents, data_dir, batch_size, num_examples, should_stop,
                progress):
    def ask():
      batches.append(1)
      if len(batches) == 3:
        os.kill(os.getpid(), sig)
      return should_stop()
    return original(contents, data_dir, batch_size, num_examples, ask,
                    progress=progress)

  monkeypatch.setattr(impl_eval, 'evaluate_contents', signalled)
  before = fs.snapshot(train_dir)
  code, out, err, exception = fs.invoke_cli(
      ['eval', '--data_dir', synth_data_dir, '--checkpoint_dir', train_dir,
       '--batch_size', 8, '--eval_interval_secs', 1])
  assert exception is None, exception
  _clean(code, out, err)
  assert code == 128 + sig
  assert out.splitlines() == ['Evaluating model.ckpt-2 on 300 test records...']
  assert fs.ours(err) == ['Stopped by %s; evaluated no checkpoint; the evaluation '
                          'of model.ckpt-2 was cut short.' % sig.name]
  assert 3 <= len(batches) <= 4  # it stopped at the next batch
  assert fs.changed(before, fs.snapshot(train_dir)) == []
