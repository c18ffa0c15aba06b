"""Damaged train_dir state, the same way in train, eval and convert; and upstream's train_dir.

Each damage (a zero-length or truncated .data or .index file of the latest
checkpoint, a bit-flipped .data file, an empty or non-text `checkpoint`
state file, a state file naming a checkpoint whose files were deleted) is
run through all three commands of both trainers, in this process (click's
CliRunner). Each case asserts the exit code, that nothing was raised (a
traceback for a user), the message's facts (the checkpoint at fault, what to do),
and that no checkpoint file changed:

- train resumes from the newest intact checkpoint with a warning (the state
  file cases) or stops with one line naming the damaged file and the newest
  intact checkpoint (the latest checkpoint damaged), changing nothing;
- eval evaluates the newest intact checkpoint and says which it skipped;
- convert refuses with one line, and writes nothing.

A train_dir of the upstream script (float32 global_step, checkpoints named by
the 0-based loop index, absolute paths in the state file) resumes with
`legacy`, evaluates, and converts into one `modern` resumes.
"""

import collections
import os
import re

import numpy as np
import pytest
import tensorflow as tf

import faults_support as fs
from cifar10_towers.common import model_spec

NUM_EXAMPLES = 40  # test records per evaluation: enough to mean something, fast

Damage = collections.namedtuple('Damage', [
    'name',  # test id
    'apply',  # callable(train_dir): damages a copy of a trained dir (ckpt-1, ckpt-2)
    'fact',  # regex of what is wrong, as the messages say it
    'where',  # 'latest': model.ckpt-2 is at fault; 'state': the `checkpoint` file
])


def _ckpt(train_dir, step):
  return os.path.join(train_dir, 'model.ckpt-%d' % step)


def _truncate(path, fraction):
  with open(path, 'r+b') as f:
    f.truncate(int(os.path.getsize(path) * fraction))


def _write(path, data):
  with open(path, 'wb') as f:
    f.write(data)


def _delete_latest(train_dir):
  for name in os.listdir(train_dir):
    if name.startswith('model.ckpt-2.'):
      os.remove(os.path.join(train_dir, name))


# Every damage is one fault: the checkpoint is named, with TensorFlow's reader's reason.
SHORT = r'damaged \(Read less bytes than requested\)'  # a .data file ends early
DAMAGES = [
    Damage('data_empty', lambda d: _truncate(fs.data_file(_ckpt(d, 2)), 0), SHORT, 'latest'),
    Damage('data_truncated', lambda d: _truncate(fs.data_file(_ckpt(d, 2)), 0.5), SHORT,
           'latest'),
    Damage('data_bit_flipped', lambda d: fs.flip_bytes(fs.data_file(_ckpt(d, 2))),
           r'damaged \(Checksum does not match: stored \d+ vs\. calculated on '
           r'the restored bytes \d+\)', 'latest'),
    Damage('index_empty', lambda d: _truncate(_ckpt(d, 2) + '.index', 0),
           r'damaged \(file is too short to be an sstable\)', 'latest'),
    Damage('index_truncated', lambda d: _truncate(_ckpt(d, 2) + '.index', 0.5),
           r'damaged \(not an sstable \(bad magic number\)\)', 'latest'),
    Damage('state_empty', lambda d: _write(os.path.join(d, 'checkpoint'), b''),
           r'unreadable', 'state'),
    Damage('state_not_text',
           lambda d: _write(os.path.join(d, 'checkpoint'), bytes(range(256)) * 4),
           r'unreadable', 'state'),
    Damage('state_names_deleted_checkpoint', _delete_latest,
           r'gone \(`checkpoint` names it, but none of its files is left\)', 'gone'),
]


@pytest.fixture
def damaged(request, synth_data_dir, tmp_path):
  """(damage, impl, train_dir, snapshot of its checkpoint files before the command)."""
  damage, impl = request.param
  train_dir = fs.copy_trained(impl, synth_data_dir, str(tmp_path / 'train'))
  damage.apply(train_dir)
  return damage, impl, train_dir, fs.snapshot(train_dir)


def _cases():
  return [pytest.param((d, impl), id='%s-%s' % (d.name, impl))
          for d in DAMAGES for impl in fs.TRAINERS]


def _errors(err):
  return [line for line in err.splitlines() if line.startswith('Error: ')]


def _no_traceback(out, err, exception):
  assert exception is None, 'raised (a user would see a traceback): %r' % exception
  assert 'Traceback' not in out + err, err


def _checkpoint_files(snapshot):
  return {p: d for p, d in snapshot.items()
          if os.path.basename(p).startswith('model.ckpt-')}


# --- train -------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize('damaged', _cases(), indirect=True)
def test_train(damaged, synth_data_dir):
  damage, impl, train_dir, before = damaged
  code, out, err, exception = fs.invoke_cli(
      [impl, '--data_dir', synth_data_dir, '--train_dir', train_dir,
       '--max_steps', 3] + list(fs.FAST_FLAGS))
  print('[%s %s] exit %d\n%s\n%s' % (damage.name, impl, code, out[-800:], err))
  _no_traceback(out, err, exception)
  after = fs.snapshot(train_dir)
  if damage.where == 'latest':
    # Training over a damaged latest checkpoint would bury the evidence: stop.
    assert _errors(err) == [_errors(err)[0]] and re.fullmatch(
        r'Error: checkpoint %s is %s, and it is the latest checkpoint; the newest '
        r'intact one is model\.ckpt-1: to resume from it, move model\.ckpt-2\.\* '
        r'and `checkpoint` out of %s; or use another --train_dir\.'
        % (re.escape(_ckpt(train_dir, 2)), damage.fact, re.escape(train_dir)),
        _errors(err)[0]), err
    assert code == 1
    assert fs.changed(before, after) == []
    # Only the run's lock file (runtime.lock) may have been added.
    assert [p for p in set(after) - set(before)
            if os.path.basename(p) != '.train.lock'] == []
    return
  assert (code, _errors(err)) == (0, []), err
  if damage.where == 'state':
    assert re.search(r'%s is unreadable; resuming from the newest intact '
                     r'checkpoint found on disk\.'
                     % re.escape(os.path.join(train_dir, 'checkpoint')), err), err
    resumed = 2
  else:
    assert ('skipping %s: it is gone (`checkpoint` names it, but none of its files is '
            'left); resuming from the newest intact checkpoint.' % _ckpt(train_dir, 2)) in err
    resumed = 1
  assert 'Resuming from %s at global step %d.' % (_ckpt(train_dir, resumed),
                                                  resumed) in out
  assert tf.train.load_variable(
      _ckpt(train_dir, 3), 'global_step' if impl == 'legacy'
      else 'global_step/.ATTRIBUTES/VARIABLE_VALUE') == 3
  # The run wrote model.ckpt-3 (and rewrote the state file); the checkpoints
  # that were there are untouched.
  assert fs.changed(_checkpoint_files(before), after) == []


@pytest.mark.slow
@pytest.mark.parametrize('damage', [d for d in DAMAGES if d.where == 'state'],
                         ids=lambda d: d.name)
def test_train_mirrored_resumes_past_an_unreadable_state_file(damage, synth_data_dir,
                                                              tmp_path):
  """The tf.distribute engines restore before their CheckpointManager reads it."""
  train_dir = fs.copy_trained('modern', synth_data_dir, str(tmp_path / 'train'))
  damage.apply(train_dir)
  before = _checkpoint_files(fs.snapshot(train_dir))
  code, out, err, exception = fs.invoke_cli(
      ['modern', '--strategy', 'mirrored', '--data_dir', synth_data_dir,
       '--train_dir', train_dir, '--max_steps', 3] + list(fs.FAST_FLAGS))
  _no_traceback(out, err, exception)
  assert (code, _errors(err)) == (0, []), err
  assert 'Resuming from %s at global step 2.' % _ckpt(train_dir, 2) in out
  assert fs.changed(before, fs.snapshot(train_dir)) == []


# --- eval --------------------------------------------------------------------

def _eval_args(synth_data_dir, train_dir, *extra):
  return ['eval', '--run_once', '--data_dir', synth_data_dir, '--checkpoint_dir',
          train_dir, '--num_examples', NUM_EXAMPLES] + list(extra)


RESULT = r'^.*: precision @ 1 = \d\.\d{3} \(global step %d, model\.ckpt-%d\)$'
# What eval prints as it begins a checkpoint (tests/test_progress.py).
EVALUATING = 'Evaluating model.ckpt-%d on %d test records...'


def _evaluated(out, step, ckpt, records=NUM_EXAMPLES):
  """Whether `out` is eval's start line and result line for model.ckpt-<ckpt>."""
  lines = out.splitlines()
  return (len(lines) == 2 and lines[0] == EVALUATING % (ckpt, records)
          and re.match(RESULT % (step, ckpt), lines[1]) is not None)


@pytest.mark.slow
@pytest.mark.parametrize('damaged', _cases(), indirect=True)
def test_eval(damaged, synth_data_dir):
  damage, impl, train_dir, before = damaged
  code, out, err, exception = fs.invoke_cli(_eval_args(synth_data_dir, train_dir))
  print('[%s %s] exit %d\n%s\n%s' % (damage.name, impl, code, out, err))
  _no_traceback(out, err, exception)
  assert (code, _errors(err)) == (0, []), err
  if damage.where == 'state':
    assert fs.ours(err) == [
        '%s is unreadable; evaluating the newest intact checkpoint found on '
        'disk.' % os.path.join(train_dir, 'checkpoint')]
    evaluated = 2
  else:
    assert len(fs.ours(err)) == 1 and re.fullmatch(
        r'skipping %s: it is %s; evaluating the newest intact checkpoint\.'
        % (re.escape(_ckpt(train_dir, 2)), damage.fact),
        fs.ours(err)[0]), err
    evaluated = 1
  assert _evaluated(out, evaluated, evaluated), out
  after = fs.snapshot(train_dir)
  assert fs.changed(before, after) == []
  assert sorted(set(after) - set(before)) == []


@pytest.mark.slow
@pytest.mark.parametrize('impl', fs.TRAINERS)
def test_eval_with_no_intact_checkpoint_left(impl, synth_data_dir, tmp_path):
  train_dir = fs.copy_trained(impl, synth_data_dir, str(tmp_path / 'train'))
  _truncate(fs.data_file(_ckpt(train_dir, 2)), 0)
  _truncate(_ckpt(train_dir, 1) + '.index', 0)
  before = fs.snapshot(train_dir)
  code, out, err, exception = fs.invoke_cli(_eval_args(synth_data_dir, train_dir))
  _no_traceback(out, err, exception)
  assert code == 1
  lines = err.splitlines()
  assert [re.sub(r': it is .*', '', l) for l in lines[:2]] == [
      'skipping %s' % _ckpt(train_dir, 2), 'skipping %s' % _ckpt(train_dir, 1)]
  assert lines[2:] == [
      'Error: no intact checkpoint in %s (what is wrong with each is said above). '
      'Train again with --train_dir %s, or pass another --checkpoint_dir.'
      % (train_dir, train_dir)]
  assert fs.changed(before, fs.snapshot(train_dir)) == []


@pytest.mark.slow
def test_eval_says_when_num_examples_exceeds_the_test_set(synth_data_dir, tmp_path):
  train_dir = fs.copy_trained('legacy', synth_data_dir, str(tmp_path / 'train'))
  code, out, err, exception = fs.invoke_cli(
      ['eval', '--run_once', '--data_dir', synth_data_dir, '--checkpoint_dir',
       train_dir, '--num_examples', 100000])
  _no_traceback(out, err, exception)
  assert code == 0
  assert err.splitlines() == [
      '--num_examples 100000 is more than the 300 records of the test set in %s; '
      'evaluating all 300.' % synth_data_dir]
  assert _evaluated(out, 2, 2, records=300), out


# --- convert -----------------------------------------------------------------

def _convert_message(damage, train_dir):
  if damage.where == 'state':
    return (r'Error: %s is unreadable; the newest intact one is model\.ckpt-2: to '
            r'convert it, move `checkpoint` out of %s; or use another --from_dir\.'
            % (re.escape(os.path.join(train_dir, 'checkpoint')), re.escape(train_dir)))
  moved = 'model\\.ckpt-2\\.\\* and `checkpoint`' if damage.where == 'latest' \
      else '`checkpoint`'
  return (r'Error: checkpoint %s is %s, and it is the latest checkpoint; the newest '
          r'intact one is model\.ckpt-1: to convert it, move %s out of %s; or use '
          r'another --from_dir\.'
          % (re.escape(_ckpt(train_dir, 2)), damage.fact, moved,
             re.escape(train_dir)))


@pytest.mark.slow
@pytest.mark.parametrize('damaged', _cases(), indirect=True)
def test_convert_refuses(damaged, tmp_path):
  damage, impl, train_dir, before = damaged
  to_dir = str(tmp_path / 'converted')
  code, out, err, exception = fs.invoke_cli(
      ['convert', '--from_dir', train_dir, '--to_dir', to_dir])
  print('[%s %s] exit %d\n%s\n%s' % (damage.name, impl, code, out, err))
  _no_traceback(out, err, exception)
  assert code == 1
  assert err.splitlines() == _errors(err) and len(_errors(err)) == 1, err
  assert re.fullmatch(_convert_message(damage, train_dir), _errors(err)[0]), err
  after = fs.snapshot(train_dir)
  assert fs.changed(before, after) == []
  assert sorted(set(after) - set(before)) == []
  assert sorted(os.listdir(tmp_path)) == ['train']  # no to_dir, no staging dir


# --- a train_dir of the upstream script --------------------------------------

@pytest.fixture
def upstream_dir(tmp_path):
  path = str(tmp_path / 'upstream')
  prefix = fs.upstream_train_dir(path)
  assert os.path.basename(prefix) == 'model.ckpt-%d' % (fs.UPSTREAM_STEP - 1)
  return path, prefix


def _tensors(prefix):
  reader = tf.train.load_checkpoint(prefix)
  return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()}


@pytest.mark.slow
def test_legacy_resumes_an_upstream_train_dir(upstream_dir, synth_data_dir):
  train_dir, prefix = upstream_dir
  upstream = _tensors(prefix)
  assert upstream['global_step'].dtype == np.float32
  before = fs.snapshot(train_dir)
  step = fs.UPSTREAM_STEP + 1
  code, out, err, exception = fs.invoke_cli(
      ['legacy', '--data_dir', synth_data_dir, '--train_dir', train_dir,
       '--max_steps', step] + list(fs.FAST_FLAGS))
  _no_traceback(out, err, exception)
  assert (code, _errors(err)) == (0, []), err
  assert ('Resuming an upstream train_dir from %s at global step %d (float32 '
          'global_step); new checkpoints are named by the global step.'
          % (prefix, fs.UPSTREAM_STEP)) in out.splitlines()
  assert re.findall(r': step (\d+), loss', out) == [str(step)]
  resumed = _tensors(_ckpt(train_dir, step))
  assert resumed['global_step'].dtype == np.int64
  assert resumed['global_step'] == step
  # One SGD step from upstream's weights (a fresh initialization would be
  # uncorrelated with them), and the moving averages went on from upstream's:
  # shadow = d * upstream shadow + (1 - d) * weight, d = min(0.9999,
  # (1 + step) / (10 + step)).
  decay = min(0.9999, (1.0 + step) / (10.0 + step))
  for name in model_spec.VARIABLE_NAMES:
    correlation = np.corrcoef(resumed[name].ravel(), upstream[name].ravel())[0, 1]
    assert correlation > 0.9, (name, correlation)
    shadow = name + '/ExponentialMovingAverage'
    np.testing.assert_allclose(
        resumed[shadow], decay * upstream[shadow] + (1 - decay) * resumed[name],
        rtol=1e-5, atol=1e-6, err_msg=shadow)
  # Upstream's files are untouched (the state file now names model.ckpt-31).
  assert fs.changed(_checkpoint_files(before), fs.snapshot(train_dir)) == []
  assert tf.train.latest_checkpoint(train_dir) == _ckpt(train_dir, step)


@pytest.mark.slow
def test_eval_and_convert_read_an_upstream_train_dir(upstream_dir, synth_data_dir,
                                                     tmp_path):
  train_dir, prefix = upstream_dir
  code, out, err, exception = fs.invoke_cli(_eval_args(synth_data_dir, train_dir))
  _no_traceback(out, err, exception)
  assert (code, err) == (0, ''), err
  assert _evaluated(out, fs.UPSTREAM_STEP, fs.UPSTREAM_STEP - 1), out

  # modern refuses it as it is, and says to convert it.
  code, out, err, exception = fs.invoke_cli(
      ['modern', '--data_dir', synth_data_dir, '--train_dir', train_dir,
       '--max_steps', fs.UPSTREAM_STEP + 1] + list(fs.FAST_FLAGS))
  _no_traceback(out, err, exception)
  assert code == 1
  assert _errors(err) == [
      'Error: %s is a checkpoint of the upstream script (float32 global_step); '
      'the modern trainer resumes only its own checkpoints. Convert it '
      '(`python cli.py convert --from_dir %s --to_dir %s_modern`) and train '
      'with --train_dir %s_modern, or use another --train_dir, or train this '
      'one with the legacy trainer.' % (prefix, train_dir, train_dir, train_dir)]

  converted = str(tmp_path / 'converted')
  code, out, err, exception = fs.invoke_cli(
      ['convert', '--from_dir', train_dir, '--to_dir', converted])
  _no_traceback(out, err, exception)
  assert (code, err) == (0, ''), err
  new_prefix = _ckpt(converted, fs.UPSTREAM_STEP)  # named by the global step
  step = tf.train.load_variable(new_prefix, 'global_step/.ATTRIBUTES/VARIABLE_VALUE')
  assert (step, step.dtype) == (fs.UPSTREAM_STEP, np.int64)

  code, out, err, exception = fs.invoke_cli(
      ['modern', '--data_dir', synth_data_dir, '--train_dir', converted,
       '--max_steps', fs.UPSTREAM_STEP + 1] + list(fs.FAST_FLAGS))
  _no_traceback(out, err, exception)
  assert (code, _errors(err)) == (0, []), err
  assert 'Resuming from %s at global step %d.' % (new_prefix, fs.UPSTREAM_STEP) in out
  assert re.findall(r': step (\d+), loss', out) == [str(fs.UPSTREAM_STEP + 1)]
