"""Progress of `data synth` and `eval` (issue 11): every wait over ~5 s says what is happening.

On a terminal a click progress bar; on a file or a pipe a line as each stage
begins and, within a slow stage, at most one more per quarter of it
(`runtime.progress`). No test here depends on how fast the machine is: the
clock is a fake one, or the interval between lines is 0.
"""

import io
import os
import re

import pytest

import faults_support as fs
from cifar10_towers.common import cifar10_format as fmt
from cifar10_towers.runtime import progress as progress_lib

NUM_EXAMPLES = 40  # test records per evaluation: 5 batches of 8
RESULT = re.compile(r'^.*: precision @ 1 = \d\.\d{3} \(global step 2, '
                    r'model\.ckpt-2\)$')


class _Clock:
  """A clock that moves only when told."""

  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


class _Terminal(io.StringIO):
  """A stream that says it is a terminal, so click draws its bar into it."""

  def isatty(self):
    return True


def _lines(total, updates):
  """The lines of a stage of `total` records, `updates` as (seconds, done)."""
  out, clock = io.StringIO(), _Clock()
  with progress_lib.Progress(total, 'Evaluating model.ckpt-9', 'records',
                             file=out, clock=clock) as progress:
    assert not progress.terminal
    progress.stage(0, 'Evaluating model.ckpt-9 on %d test records...' % total)
    for seconds, done in updates:
      clock.now = seconds
      progress.update(done)
  return out.getvalue().splitlines()


def test_without_a_terminal_a_fast_stage_says_one_line():
  assert _lines(100, [(1, 25), (2, 50), (3, 75), (4, 100)]) == [
      'Evaluating model.ckpt-9 on 100 test records...']


def test_without_a_terminal_a_slow_stage_says_at_most_a_line_a_quarter():
  # A batch every 6 s: a line at the first quarter passed 10 s after the
  # last line, none at the end (the result comes next).
  updates = [(6 * i, 10 * i) for i in range(1, 11)]
  assert _lines(100, updates) == [
      'Evaluating model.ckpt-9 on 100 test records...',
      'Evaluating model.ckpt-9: 30 of 100 records (30%)...',  # at 18 s
      'Evaluating model.ckpt-9: 50 of 100 records (50%)...',  # at 30 s
      'Evaluating model.ckpt-9: 80 of 100 records (80%)...',  # at 48 s
  ]
  # However slow, no more than a line a quarter.
  assert len(_lines(1000, [(60 * i, i) for i in range(1, 1001)])) == 4


def test_on_a_terminal_a_bar_and_no_lines():
  out = _Terminal()
  with progress_lib.Progress(6, 'Generating', 'files', file=out) as progress:
    assert progress.terminal
    for number, name in enumerate(fmt.TRAIN_FILES + fmt.EVAL_FILES, start=1):
      progress.stage(number - 1, 'Generating %s...' % name, name)
    progress.update(6)
  text = re.sub(r'\x1b\[\?25[lh]', '', out.getvalue())  # hide/show the cursor
  assert 'Generating  [' in text and '3/6  data_batch_4.bin' in text
  assert text.split('\r')[-1].rstrip() == 'Generating  [%s]  6/6' % ('#' * 36)
  assert 'Generating data_batch' not in text  # the lines are for non-terminals


def test_data_synth_says_each_file_and_then_what_it_wrote(tmp_path):
  data_dir = str(tmp_path / 'data')
  code, out, err, exception = fs.invoke_cli(
      ['data', 'synth', '--data_dir', data_dir, '--train_per_file', 3,
       '--num_test', 4])
  assert (code, err, exception) == (0, '', None), err
  assert out.splitlines() == [
      'Generating data_batch_1.bin (1 of 6)...',
      'Generating data_batch_2.bin (2 of 6)...',
      'Generating data_batch_3.bin (3 of 6)...',
      'Generating data_batch_4.bin (4 of 6)...',
      'Generating data_batch_5.bin (5 of 6)...',
      'Generating test_batch.bin (6 of 6)...',
      'Wrote 15 training and 4 test records of generated data (synth) to %s. '
      'It is not CIFAR-10 (on CIFAR-10 the original trainer reaches ~86%% precision '
      '@ 1 after 100K steps).' % data_dir]


@pytest.mark.slow
@pytest.mark.parametrize('impl', fs.TRAINERS)
def test_each_evaluator_reports_the_records_done_after_each_batch(
    impl, synth_data_dir):
  from cifar10_towers.runtime import checkpoints
  if impl == 'legacy':
    from cifar10_towers.legacy import eval as impl_eval
  else:
    from cifar10_towers.modern import eval as impl_eval
  contents = checkpoints.read(os.path.join(
      fs.trained_dir(impl, synth_data_dir), 'model.ckpt-2'))
  done = []
  counts = impl_eval.evaluate_contents(contents, synth_data_dir, 8, 36,
                                       progress=done.append)
  assert counts.total_count == 36
  assert done == [8, 16, 24, 32, 36]


@pytest.mark.slow
def test_eval_says_which_checkpoint_and_how_many_records(synth_data_dir,
                                                         tmp_path, monkeypatch):
  train_dir = fs.trained_dir('legacy', synth_data_dir)  # only read
  args = ['eval', '--run_once', '--data_dir', synth_data_dir, '--checkpoint_dir',
          train_dir, '--batch_size', 8, '--num_examples', NUM_EXAMPLES,
          '--eval_dir', str(tmp_path / 'eval')]
  code, out, err, exception = fs.invoke_cli(args)
  assert (code, err, exception) == (0, '', None), err
  lines = out.splitlines()
  assert lines[0] == 'Evaluating model.ckpt-2 on 40 test records...'
  assert RESULT.match(lines[1]) and len(lines) == 2, out

  # As slow as can be (a line is due at every batch): one a quarter.
  monkeypatch.setattr(progress_lib, 'EVERY_SECS', 0.0)
  code, out, err, exception = fs.invoke_cli(args)
  assert (code, err, exception) == (0, '', None), err
  lines = out.splitlines()
  assert lines[:4] == [
      'Evaluating model.ckpt-2 on 40 test records...',
      'Evaluating model.ckpt-2: 16 of 40 records (40%)...',
      'Evaluating model.ckpt-2: 24 of 40 records (60%)...',
      'Evaluating model.ckpt-2: 32 of 40 records (80%)...']
  assert RESULT.match(lines[4]) and len(lines) == 5, out
