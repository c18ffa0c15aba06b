"""`eval --eval_dir`: precision @ 1 for TensorBoard, as upstream's eval wrote it.

- For a legacy and a modern checkpoint, `eval --run_once --eval_dir D` writes
  the scalar 'Precision @ 1' (TensorBoard's scalars dashboard) equal to the
  printed precision, at the checkpoint's global step.
- Two evaluations of two checkpoints add two points; the event file already
  there is kept, byte for byte.
- The loop (no --run_once) writes each checkpoint's point as it evaluates it.
- An --eval_dir that cannot be written (a file in the way, read-only, a full
  disk) is one line naming --eval_dir, exit 1, and changes nothing.
"""

import os
import re

import pytest

import faults_support as fs
from cifar10_towers.runtime import evaluation

pytestmark = pytest.mark.slow  # every test evaluates a trained dir (faults_support.trained_dir)

NUM_EXAMPLES = 40  # precision k/40 prints exactly with 3 decimals
PRINTED = re.compile(r'^.*: precision @ 1 = (\d\.\d{3}) \(global step (\d+), '
                     r'model\.ckpt-\d+\)$')


def _eval_once(synth_data_dir, train_dir, eval_dir):
  code, out, err, exception = fs.invoke_cli(
      ['eval', '--run_once', '--data_dir', synth_data_dir, '--checkpoint_dir',
       train_dir, '--batch_size', 8, '--num_examples', NUM_EXAMPLES,
       '--eval_dir', eval_dir])
  assert exception is None, exception
  assert 'Traceback' not in out + err, err
  return code, out, err


def _printed(out):
  """[(step, precision)] of the result lines."""
  return [(int(m.group(2)), float(m.group(1)))
          for m in map(PRINTED.match, out.splitlines()) if m]


@pytest.mark.parametrize('impl', fs.TRAINERS)
def test_run_once_writes_the_printed_precision_at_the_global_step(
    impl, synth_data_dir, tmp_path):
  train_dir = fs.copy_trained(impl, synth_data_dir, str(tmp_path / 'train'))
  eval_dir = str(tmp_path / 'not' / 'yet' / 'eval')  # created, parents too
  before = fs.snapshot(train_dir)
  code, out, err = _eval_once(synth_data_dir, train_dir, eval_dir)
  assert code == 0, err
  printed = _printed(out)
  assert [step for step, _ in printed] == [2]
  assert fs.precision_points(eval_dir) == [(2, pytest.approx(printed[0][1]))]
  assert fs.changed(before, fs.snapshot(train_dir)) == []


def test_two_checkpoints_two_points_the_old_file_kept(synth_data_dir, tmp_path):
  """model.ckpt-1 evaluated, then (saved later) model.ckpt-2: two runs, two points."""
  train_dir = fs.copy_trained('modern', synth_data_dir, str(tmp_path / 'train'))
  later = str(tmp_path / 'later')
  fs.move_checkpoint(train_dir, 2, later)
  fs.name_latest(train_dir, 1)
  eval_dir = str(tmp_path / 'eval')
  code, out1, err = _eval_once(synth_data_dir, train_dir, eval_dir)
  assert code == 0, err
  first = fs.snapshot(eval_dir)
  assert len(first) == 1

  fs.move_checkpoint(later, 2, train_dir)
  fs.name_latest(train_dir, 2)
  code, out2, err = _eval_once(synth_data_dir, train_dir, eval_dir)
  assert code == 0, err
  printed = _printed(out1) + _printed(out2)
  assert [step for step, _ in printed] == [1, 2]
  assert fs.precision_points(eval_dir) == [
      (step, pytest.approx(precision)) for step, precision in printed]
  after = fs.snapshot(eval_dir)
  assert fs.changed(first, after) == [] and len(after) == 2


def test_the_loop_writes_each_checkpoint_as_it_comes(synth_data_dir, tmp_path):
  """runtime.evaluation.run, either kind: legacy's model.ckpt-1, then its -2."""
  from cifar10_towers.legacy import eval as legacy_eval
  train_dir = fs.copy_trained('legacy', synth_data_dir, str(tmp_path / 'train'))
  later = str(tmp_path / 'later')
  fs.move_checkpoint(train_dir, 2, later)
  fs.name_latest(train_dir, 1)

  def save():
    fs.move_checkpoint(later, 2, train_dir)
    fs.name_latest(train_dir, 2)

  def evaluate(contents, should_stop):
    return legacy_eval.evaluate_contents(contents, synth_data_dir, 8,
                                         NUM_EXAMPLES, should_stop)

  eval_dir = str(tmp_path / 'eval')
  results = evaluation.run(train_dir, evaluate, fs.ScriptedStop(save), interval_secs=1,
                           max_evals=2, eval_dir=eval_dir)
  assert [r.global_step for r in results] == [1, 2]
  assert fs.precision_points(eval_dir) == [
      (r.global_step, pytest.approx(r.precision)) for r in results]
  assert len(os.listdir(eval_dir)) == 1  # one writer, one event file


def _refused(synth_data_dir, train_dir, eval_dir, cause, advice, watched):
  before = fs.snapshot(train_dir, *watched)
  listed = {d: sorted(os.listdir(d)) for d in watched if os.path.isdir(d)}
  code, out, err = _eval_once(synth_data_dir, train_dir, eval_dir)
  assert code == 1, (out, err)
  errors = [l for l in err.splitlines() if l.startswith('Error')]
  assert errors == [
      'Error: could not write Precision @ 1 to --eval_dir %s (%s). %s, or pass '
      'another --eval_dir; the checkpoints are untouched.'
      % (eval_dir, cause, advice)], err
  assert fs.changed(before, fs.snapshot(train_dir, *watched)) == []
  assert {d: sorted(os.listdir(d)) for d in listed} == listed
  return out


def test_a_file_in_the_way(synth_data_dir, tmp_path):
  train_dir = fs.copy_trained('legacy', synth_data_dir, str(tmp_path / 'train'))
  in_the_way = str(tmp_path / 'eval')
  with open(in_the_way, 'w') as f:
    f.write('notes\n')
  for eval_dir in (in_the_way, os.path.join(in_the_way, 'sub')):
    out = _refused(synth_data_dir, train_dir, eval_dir,
                   '%s is a file, not a directory' % in_the_way, 'Move that file',
                   [in_the_way, str(tmp_path)])
    assert _printed(out) == []  # refused before evaluating


@pytest.fixture()
def small_disk(tmp_path):
  if os.geteuid() != 0:
    pytest.skip('mounting a tmpfs needs root; test_read_only_and_full_simulated runs instead')
  path = str(tmp_path / 'disk')
  if not fs.mount_tmpfs(path, '64k'):
    pytest.skip('mounting a tmpfs is not permitted here; the simulated test runs instead')
  yield path
  fs.umount(path)


def test_read_only_and_full(small_disk, synth_data_dir, tmp_path):
  train_dir = fs.copy_trained('modern', synth_data_dir, str(tmp_path / 'train'))
  # Full: eval_dir exists and takes a new (empty) file, but not a byte more.
  eval_dir = os.path.join(small_disk, 'eval')
  os.makedirs(eval_dir)
  with open(os.path.join(small_disk, 'fill'), 'wb', buffering=0) as f:
    try:
      while True:
        f.write(b'\0' * 4096)
    except OSError:
      pass
  out = _refused(synth_data_dir, train_dir, eval_dir, 'No space left on device',
                 'Free space on that disk', [small_disk, eval_dir])
  assert [step for step, _ in _printed(out)] == [2]  # said, then not written
  # Read-only: refused before evaluating.
  fs.remount(small_disk, 'ro')
  out = _refused(synth_data_dir, train_dir, eval_dir, 'Read-only file system',
                 'Make it writable', [small_disk])
  assert _printed(out) == []


def test_read_only_and_full_simulated(synth_data_dir, tmp_path, monkeypatch):
  """test_read_only_and_full without a tmpfs (it needs root): the same two refusals on any
  machine, each fault raised where the real one comes (the probe file, the event writer)."""
  import errno  # pylint: disable=import-outside-toplevel
  train_dir = fs.copy_trained('modern', synth_data_dir, str(tmp_path / 'train'))
  eval_dir = str(tmp_path / 'eval')
  os.makedirs(eval_dir)

  def fails(code, text):
    def raise_it(*args, **kwargs):
      raise OSError(code, text)
    return raise_it

  def disk_full(*args, **kwargs):  # as TensorFlow's event writer reports it
    raise evaluation.tf.errors.ResourceExhaustedError(None, None, 'No space left on device')

  monkeypatch.setattr(evaluation.tf.summary, 'create_file_writer', disk_full)
  out = _refused(synth_data_dir, train_dir, eval_dir, 'No space left on device',
                 'Free space on that disk', [eval_dir])
  assert [step for step, _ in _printed(out)] == [2]  # said, then not written
  monkeypatch.setattr(evaluation.tempfile, 'TemporaryFile',
                      fails(errno.EROFS, 'Read-only file system'))
  out = _refused(synth_data_dir, train_dir, eval_dir, 'Read-only file system',
                 'Make it writable', [eval_dir])
  assert _printed(out) == []  # refused before evaluating


def test_by_default_precision_goes_under_the_train_dir(synth_data_dir, tmp_path,
                                                       monkeypatch):
  """No --eval_dir, CIFAR10_EVAL_DIR unset: <checkpoint_dir>/eval, beside the training run."""
  monkeypatch.delenv('CIFAR10_EVAL_DIR', raising=False)
  train_dir = fs.copy_trained('legacy', synth_data_dir, str(tmp_path / 'train'))
  code, out, err, exception = fs.invoke_cli(
      ['eval', '--run_once', '--data_dir', synth_data_dir, '--checkpoint_dir',
       train_dir, '--batch_size', 8, '--num_examples', NUM_EXAMPLES])
  assert (code, exception) == (0, None), err
  printed = _printed(out)
  assert fs.precision_points(os.path.join(train_dir, 'eval')) == [
      (2, pytest.approx(printed[0][1]))]
  assert fs.ours(err) == []


def test_a_train_dir_that_cannot_be_written_falls_back_with_a_notice(
    synth_data_dir, tmp_path, monkeypatch):
  """The old default, /tmp/cifar10_eval (here a temp dir), and one line saying so."""
  from cifar10_towers import cli
  from cifar10_towers.runtime import config as config_lib
  monkeypatch.delenv('CIFAR10_EVAL_DIR', raising=False)
  fallback = str(tmp_path / 'cifar10_eval')
  monkeypatch.setattr(config_lib, 'DEFAULT_EVAL_DIR', fallback)
  train_dir = fs.copy_trained('modern', synth_data_dir, str(tmp_path / 'train'))
  access = os.access
  # As a read-only copy would be (root, who runs the tests here, may write anywhere).
  monkeypatch.setattr(cli.os, 'access', lambda path, mode: (
      False if os.path.abspath(path) == train_dir and mode & os.W_OK
      else access(path, mode)))
  before = fs.snapshot(train_dir)
  code, out, err, exception = fs.invoke_cli(
      ['eval', '--run_once', '--data_dir', synth_data_dir, '--checkpoint_dir',
       train_dir, '--batch_size', 8, '--num_examples', NUM_EXAMPLES])
  assert (code, exception) == (0, None), err
  assert fs.ours(err) == [
      '%s cannot be written; precision @ 1 goes to %s for TensorBoard (pass '
      '--eval_dir to choose).' % (train_dir, fallback)]
  assert fs.precision_points(fallback) == [(2, pytest.approx(_printed(out)[0][1]))]
  assert fs.changed(before, fs.snapshot(train_dir)) == []
  assert sorted(set(fs.snapshot(train_dir)) - set(before)) == []
