"""Generated data is labelled (GENERATED.json) and never reported as CIFAR-10.

`data synth` and `data digits` replace their own kind of data, and anything
else - unmarked data, which is taken for CIFAR-10, and the other generator's
data - only with --force; `data download` refuses marked data instead of
calling it present; `data check`, training and eval name it. In-process
(click's CliRunner); every refusal is one `Error:` line, exit 1, and leaves
every file as it was.
"""

import json
import os
import shutil

import pytest

import faults_support as fs
from cifar10_towers.common import cifar10_format as fmt
from cifar10_towers.datasets import generated
from cifar10_towers.datasets import synth

SMALL = ['--train_per_file', '20', '--num_test', '20']
# `data synth`'s progress without a terminal (tests/test_progress.py).
GENERATING = ''.join(
    'Generating %s (%d of 6)...\n' % (name, number)
    for number, name in enumerate(fmt.TRAIN_FILES + fmt.EVAL_FILES, start=1))
# What every line that names generated data adds (issue 22: the demo's figure
# is not CIFAR-10's).
CIFAR10_RESULT = ('on CIFAR-10 the original trainer reaches ~86% precision @ 1 '
                  'after 100K steps')
NOT_CIFAR10 = ' It is not CIFAR-10 (%s).\n' % CIFAR10_RESULT


def _errors(err):
  return [line for line in err.splitlines() if line.startswith('Error: ')]


def _cli(args):
  code, out, err, exception = fs.invoke_cli(args)
  assert exception is None, 'raised (a user would see a traceback): %r' % exception
  assert 'Traceback' not in out + err
  return code, out, err


def _synth(data_dir, *extra):
  return _cli(['data', 'synth', '--data_dir', data_dir] + SMALL + list(extra))


def _marked(data_dir, generator):
  """Small generated data marked as `generator`'s (digits without scikit-learn)."""
  synth.generate(data_dir, train_per_file=20, num_test=20, seed=1)
  if generator != 'synth':
    path = generated.marker_path(data_dir)
    with open(path) as f:
      info = json.load(f)
    info['generator'] = generator
    info['args'] = 'data %s --data_dir %s --seed 1' % (generator, data_dir)
    with open(path, 'w') as f:
      json.dump(info, f)
  return data_dir


def _cifar10(data_dir, partial=False):
  """Data without a marker, as `data download` unpacks CIFAR-10."""
  synth.generate(data_dir, train_per_file=20, num_test=20, seed=2, mark=False)
  if partial:
    for name in fmt.TRAIN_FILES[2:]:
      os.remove(os.path.join(fmt.batches_dir(data_dir), name))
  with open(os.path.join(fmt.batches_dir(data_dir), 'readme.html'), 'w') as f:
    f.write('<p>CIFAR-10</p>\n')
  return data_dir


def test_synth_writes_the_marker_with_its_data(tmp_path):
  data_dir = str(tmp_path / 'data')
  code, out, err = _synth(data_dir, '--seed', '7')
  assert (code, err) == (0, ''), err
  assert out == GENERATING + ('Wrote 100 training and 20 test records of '
                              'generated data (synth) to %s.' % data_dir) + NOT_CIFAR10
  with open(generated.marker_path(data_dir)) as f:
    info = json.load(f)
  assert info['generator'] == 'synth'
  assert info['version'] == synth.VERSION == 2  # 1 wrote other bytes (issue 22)
  assert info['params'] == {'train_per_file': 20, 'num_test': 20, 'seed': 7}
  assert info['command'] == ('python cli.py data synth --data_dir %s '
                             '--train_per_file 20 --num_test 20 --seed 7' % data_dir)
  assert info['written'][:2] == '20'  # an ISO date
  # The command in the marker writes the same bytes again.
  before = fs.snapshot(fmt.batches_dir(data_dir))
  args = info['args'].split()
  assert _cli(args)[0] == 0
  after = fs.snapshot(fmt.batches_dir(data_dir))
  # All but the marker, whose date may differ.
  assert set(fs.changed(before, after)) <= {generated.marker_path(data_dir)}
  assert set(after) == set(before)


def test_digits_writes_the_marker_with_its_data(tmp_path):
  pytest.importorskip('sklearn.datasets')
  data_dir = str(tmp_path / 'data')
  code, out, err = _cli(['data', 'digits', '--data_dir', data_dir, '--seed', '3'])
  assert (code, err) == (0, ''), err
  assert out == ('Converting scikit-learn\'s digits to CIFAR format in %s...\n'
                 'Wrote 1498 training and 299 test records of generated data '
                 '(digits) to %s.' % (data_dir, data_dir) + NOT_CIFAR10)
  info = generated.read(data_dir)
  assert (info['generator'], info['version']) == ('digits', 1)
  assert info['command'] == 'python cli.py data digits --data_dir %s --seed 3' % data_dir
  # Its own kind is replaced, and says so.
  code, out, err = _cli(['data', 'digits', '--data_dir', data_dir])
  assert (code, err) == (0, ''), err
  assert out.endswith('to %s, replacing the generated data (digits) there.'
                      % data_dir + NOT_CIFAR10)


def test_synth_replaces_its_own_kind(tmp_path):
  data_dir = _marked(str(tmp_path / 'data'), 'synth')
  code, out, err = _synth(data_dir, '--seed', '9')
  assert (code, err) == (0, ''), err
  assert out == GENERATING + (
      'Wrote 100 training and 20 test records of generated data (synth) to %s, '
      'replacing the generated data (synth) there.' % data_dir + NOT_CIFAR10)
  assert generated.read(data_dir)['params']['seed'] == 9


@pytest.mark.parametrize('generator,other', [('synth', 'digits'),
                                             ('digits', 'synth')])
def test_the_other_generators_data_needs_force(tmp_path, generator, other):
  data_dir = _marked(str(tmp_path / 'data'), other)
  before = fs.snapshot(str(tmp_path))
  code, out, err = _cli(['data', generator, '--data_dir', data_dir])
  assert (code, out) == (1, '')
  assert _errors(err) == err.splitlines() == [
      'Error: %s holds generated data (%s); left it as it is. Pass --force to '
      'replace it with generated data (%s), or pass another --data_dir.'
      % (data_dir, other, generator)]
  assert fs.snapshot(str(tmp_path)) == before
  if generator == 'synth':  # digits' conversion needs scikit-learn
    code, out, err = _synth(data_dir, '--force')
    assert (code, err) == (0, ''), err
    assert out.endswith('replacing the generated data (digits) there (--force).'
                        + NOT_CIFAR10)
    assert generated.read(data_dir)['generator'] == 'synth'


@pytest.mark.parametrize('partial', [False, True], ids=['whole', 'partial'])
@pytest.mark.parametrize('generator', ['synth', 'digits'])
def test_real_cifar10_is_never_overwritten(tmp_path, generator, partial):
  """Unmarked data (CIFAR-10, or the user's own) is left alone without --force."""
  data_dir = _cifar10(str(tmp_path / 'data'), partial)
  before = fs.snapshot(str(tmp_path))
  for extra in ([], ['--seed', '5']):
    code, out, err = _cli(['data', generator, '--data_dir', data_dir] + extra)
    assert (code, out) == (1, '')
    assert err.splitlines() == [
        'Error: %s holds data not marked as generated (CIFAR-10, or your own); '
        'left it as it is. Pass --force to replace it with generated data (%s), '
        'or pass another --data_dir.' % (data_dir, generator)]
    assert fs.snapshot(str(tmp_path)) == before


def test_force_replaces_unmarked_data_and_keeps_other_files(tmp_path):
  data_dir = _cifar10(str(tmp_path / 'data'))
  code, out, err = _synth(data_dir, '--force')
  assert (code, err) == (0, ''), err
  assert out.endswith('to %s, replacing the data not marked as generated '
                      '(CIFAR-10, or your own) there (--force).' % data_dir + NOT_CIFAR10)
  assert generated.read(data_dir)['generator'] == 'synth'
  with open(os.path.join(fmt.batches_dir(data_dir), 'readme.html')) as f:
    assert f.read() == '<p>CIFAR-10</p>\n'


def test_a_set_written_without_a_marker_does_not_inherit_one(tmp_path):
  data_dir = _marked(str(tmp_path / 'data'), 'synth')
  synth.generate(data_dir, train_per_file=20, num_test=20, seed=3, mark=False)
  assert generated.read(data_dir) is None


def test_download_never_calls_generated_data_cifar10(tmp_path):
  for generator in ('synth', 'digits'):
    data_dir = _marked(str(tmp_path / generator), generator)
    before = fs.snapshot(data_dir)
    code, out, err = _cli(['data', 'download', '--data_dir', data_dir])
    assert (code, out) == (1, '')
    assert 'CIFAR-10 in' not in out + err
    assert err.splitlines() == [
        'Error: %s holds generated data (%s), not CIFAR-10; nothing was '
        'downloaded. To get CIFAR-10 there, remove %s and run this again, or '
        'pass another --data_dir.' % (data_dir, generator,
                                      fmt.batches_dir(data_dir))]
    assert fs.snapshot(data_dir) == before
  # Unmarked data is CIFAR-10 as far as anyone can tell.
  data_dir = _cifar10(str(tmp_path / 'real'))
  code, out, err = _cli(['data', 'download', '--data_dir', data_dir])
  assert (code, out, err) == (0, 'CIFAR-10 in %s: present.\n' % data_dir, '')


def test_check_names_generated_data(tmp_path):
  data_dir = _marked(str(tmp_path / 'data'), 'digits')
  code, out, err = _cli(['data', 'check', '--data_dir', data_dir])
  assert (code, err) == (0, ''), err
  assert out.splitlines()[-1] == (
      '%s: all 6 files are valid generated data (digits), not CIFAR-10.' % data_dir)
  os.remove(os.path.join(fmt.batches_dir(data_dir), 'test_batch.bin'))
  code, out, err = _cli(['data', 'check', '--data_dir', data_dir])
  assert code == 1
  assert _errors(err) == [
      'Error: 1 problem(s) in %s (generated data (digits)). Regenerate it '
      '(`python cli.py data digits --data_dir %s --seed 1`).' % (data_dir, data_dir)]
  # Unmarked: as before.
  data_dir = _cifar10(str(tmp_path / 'real'))
  code, out, err = _cli(['data', 'check', '--data_dir', data_dir])
  assert (code, err) == (0, ''), err
  assert out.splitlines()[-1] == '%s: all 6 files are valid.' % data_dir


@pytest.mark.slow
def test_training_and_eval_say_once_they_run_on_generated_data(tmp_path,
                                                                synth_data_dir):
  data_dir = str(tmp_path / 'data')
  shutil.copytree(synth_data_dir, data_dir)
  generated.write_marker(fmt.batches_dir(data_dir), 'synth', synth.VERSION, data_dir, seed=0)
  train_dir = str(tmp_path / 'train')
  code, out, err = _cli(['modern', '--data_dir', data_dir, '--train_dir', train_dir,
                         '--max_steps', '1'] + list(fs.FAST_FLAGS))
  assert code == 0, err
  assert err.splitlines() == [
      'Training on generated data (synth) in %s, not on CIFAR-10 (%s).'
      % (data_dir, CIFAR10_RESULT)]
  code, out, err = _cli(['eval', '--run_once', '--data_dir', data_dir,
                         '--checkpoint_dir', train_dir])
  assert code == 0, err
  assert err.splitlines() == [
      'Evaluating on generated data (synth) in %s, not on CIFAR-10 (%s).'
      % (data_dir, CIFAR10_RESULT)]
  assert 'precision @ 1 = ' in out
