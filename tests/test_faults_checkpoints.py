"""Checkpoints are never half-written, resume finds the newest intact one, a full disk loses nothing.

- Both writers (legacy's Saver, modern's CheckpointManager) name a checkpoint
  in the `checkpoint` state file only once all its files are complete.
- What a kill leaves behind (an incomplete newer checkpoint, a complete one
  not yet named, a missing or unreadable state file, a state file with the
  absolute paths of another directory) does not stop the next run: it resumes
  from the newest intact checkpoint and says what it skipped.
- A full disk while saving stops training with one line; the previous
  checkpoint stays intact and latest, the partial files are removed, and the
  next run, with space again, resumes from it. On a real tiny tmpfs when this
  process may mount one (root), and always with the writer made to fail in
  this process.
"""

import errno
import os
import re
import shutil

import pytest
import tensorflow as tf
from tensorflow.python.checkpoint import checkpoint_management

import faults_support as fs
from cifar10_towers.runtime import checkpoints

NO_SPACE = 'No space left on device'


def _train_args(impl, data_dir, train_dir, max_steps, *extra):
  return ([impl, '--data_dir', data_dir, '--train_dir', train_dir,
           '--max_steps', max_steps] + list(fs.FAST_FLAGS) + list(extra))


def _ckpt(train_dir, step):
  return os.path.join(train_dir, 'model.ckpt-%d' % step)


def _checkpoint_files(snapshot, train_dir, steps):
  return {p: d for p, d in snapshot.items()
          if any(os.path.basename(p).startswith('model.ckpt-%d.' % s) for s in steps)}


@pytest.mark.slow
@pytest.mark.parametrize('impl', fs.TRAINERS)
def test_a_checkpoint_is_named_latest_only_once_complete(impl, synth_data_dir,
                                                         tmp_path, monkeypatch):
  """Both writers go through update_checkpoint_state_internal; check each call."""
  named = []
  original = checkpoint_management.update_checkpoint_state_internal

  def checked(save_dir, model_checkpoint_path, *args, **kwargs):
    path = model_checkpoint_path
    if not os.path.isabs(path):
      path = os.path.join(save_dir, path)
    checkpoints.read(path)  # every file there, every checksum right
    named.append(checkpoints.step_of(path))
    return original(save_dir, model_checkpoint_path, *args, **kwargs)

  monkeypatch.setattr(checkpoint_management, 'update_checkpoint_state_internal',
                      checked)
  train_dir = str(tmp_path / 'train')
  code, out, err, exception = fs.invoke_cli(
      _train_args(impl, synth_data_dir, train_dir, 3, '--save_every', 1))
  assert (code, exception) == (0, None), err
  assert sorted(set(named)) == [1, 2, 3]


def _incomplete_newer(train_dir):
  """What a kill during the save of step 3 can leave: temp files, a torn index."""
  with open(_ckpt(train_dir, 2) + '.index', 'rb') as f:
    index = f.read()
  with open(_ckpt(train_dir, 3) + '.index', 'wb') as f:
    f.write(index[:len(index) // 2])
  shutil.copy(fs.data_file(_ckpt(train_dir, 2)), fs.data_file(_ckpt(train_dir, 3)))
  os.makedirs(_ckpt(train_dir, 3) + '_temp')  # modern's
  with open(os.path.join(_ckpt(train_dir, 3) + '_temp',
                         'part-00000-of-00001.data-00000-of-00001.tempstate1'),
            'wb') as f:
    f.write(b'\0' * 1000)
  with open(fs.data_file(_ckpt(train_dir, 3)) + '.tempstate42', 'wb') as f:
    f.write(b'\0' * 1000)  # legacy's


def _name_only_step_1(train_dir):
  """A kill after step 2's files were complete, before the state named them."""
  tf.compat.v1.train.update_checkpoint_state(train_dir, 'model.ckpt-1', ['model.ckpt-1'])


def _no_state_file(train_dir):
  os.remove(os.path.join(train_dir, checkpoints.STATE_FILE))


def _garbage_state_file(train_dir):
  with open(os.path.join(train_dir, checkpoints.STATE_FILE), 'w') as f:
    f.write('model_checkpoint_path: "model.ckp')  # torn by hand or disk


def _state_of_another_directory(train_dir):
  """Legacy's Saver used to record absolute paths; the dir was then moved."""
  tf.compat.v1.train.update_checkpoint_state(
      train_dir, '/moved/away/model.ckpt-2',
      ['/moved/away/model.ckpt-1', '/moved/away/model.ckpt-2'])


NOT_NAMED = (r'.*/model\.ckpt-2 is complete, but `checkpoint` does not name it \(the file '
             r'is missing, or a run was interrupted as it saved\); resuming from the newest '
             r'intact checkpoint\.')
RESUME_CASES = [
    # (name, damage, the warning on stderr (regex) or None)
    ('incomplete_newer_checkpoint', _incomplete_newer,
     r'removed 2 temp file\(s\) of an interrupted save from .*/train\.\n'
     r'skipping .*/model\.ckpt-3: it is damaged \(.*\), newer than the latest checkpoint '
     r'\(a save in progress or interrupted\); resuming from the newest intact checkpoint\.'),
    ('complete_checkpoint_not_yet_named', _name_only_step_1,
     NOT_NAMED),
    ('no_state_file', _no_state_file, NOT_NAMED),
    ('unreadable_state_file', _garbage_state_file,
     r'/checkpoint is unreadable; resuming from the newest intact checkpoint '
     r'found on disk\.'),
    ('state_file_of_a_moved_directory', _state_of_another_directory, None),
]


@pytest.mark.slow
@pytest.mark.parametrize('impl', fs.TRAINERS)
@pytest.mark.parametrize('name, damage, warning', RESUME_CASES,
                         ids=[c[0] for c in RESUME_CASES])
def test_resume_from_the_newest_intact_checkpoint(name, damage, warning, impl,
                                                  synth_data_dir, tmp_path):
  del name
  train_dir = fs.copy_trained(impl, synth_data_dir, str(tmp_path / 'train'))
  damage(train_dir)
  kept = _checkpoint_files(fs.snapshot(train_dir), train_dir, (1, 2))
  code, out, err, exception = fs.invoke_cli(
      _train_args(impl, synth_data_dir, train_dir, 4, '--save_every', 2))
  assert (code, exception) == (0, None), err
  assert 'Resuming from %s at global step 2.' % _ckpt(train_dir, 2) in out
  assert re.findall(r': step (\d+), loss', out) == ['3', '4']
  if warning:
    assert re.search(warning, err), err
  assert not [n for n in os.listdir(train_dir) if 'temp' in n]
  assert checkpoints.resume_point(train_dir) == _ckpt(train_dir, 4)
  assert fs.changed(kept, fs.snapshot(train_dir)) == []


# --- a full disk -------------------------------------------------------------

def _one_checkpoint_dir(impl, synth_data_dir, train_dir):
  """train_dir (existing) := model.ckpt-2 of a trained dir, named latest."""
  src = fs.trained_dir(impl, synth_data_dir)
  for name in os.listdir(src):
    if name.startswith('model.ckpt-2.'):
      shutil.copy(os.path.join(src, name), train_dir)
  tf.compat.v1.train.update_checkpoint_state(train_dir, 'model.ckpt-2', ['model.ckpt-2'])


def _full_disk_message(train_dir):
  return ('Error: could not write checkpoint model.ckpt-3 in %s (%s). Free space on '
          'that disk, or pass another --train_dir. The newest intact checkpoint '
          'stays: %s (global step 2); the same command resumes from it.'
          % (train_dir, NO_SPACE, os.path.join(train_dir, 'model.ckpt-2')))


@pytest.fixture(scope='module')
def tiny_disk(tmp_path_factory):
  """A 10 MB tmpfs: room for one checkpoint (8.6 MB) and the event file, not two."""
  if os.geteuid() != 0:
    pytest.skip('mounting a tmpfs needs root; the simulated full disk runs instead')
  path = str(tmp_path_factory.mktemp('tiny_disk'))
  if not fs.mount_tmpfs(path, '10m'):
    pytest.skip('mounting a tmpfs is not permitted here; the simulated full disk '
                'runs instead')
  yield path
  fs.umount(path)


@pytest.mark.slow
def test_full_disk_on_a_real_tiny_filesystem(tiny_disk, synth_data_dir):
  """Both trainers, one after the other, on one 10 MB tmpfs (a real ENOSPC)."""
  for impl in fs.TRAINERS:
    train_dir = os.path.join(tiny_disk, impl)
    os.makedirs(train_dir)
    _one_checkpoint_dir(impl, synth_data_dir, train_dir)
    before = fs.snapshot(train_dir)
    code, out, err, exception = fs.invoke_cli(
        _train_args(impl, synth_data_dir, train_dir, 4, '--save_every', 1))
    after = fs.snapshot(train_dir)
    assert exception is None, exception  # a user would see a traceback
    assert 'Traceback' not in out + err, err
    errors = [l for l in err.splitlines() if l.startswith('Error: ')]
    assert errors == [_full_disk_message(train_dir)], err[-2000:]
    assert code == 1
    assert fs.changed(before, after) == []  # model.ckpt-2 and the state file
    # The partial files of model.ckpt-3 are gone; only an event file was added.
    added = [os.path.basename(p) for p in set(after) - set(before)]
    assert all(n.startswith('events.out.tfevents') for n in added), added
    assert not [n for n in os.listdir(train_dir) if n.startswith('model.ckpt-3')]
    # Space again: the next run resumes from model.ckpt-2 and finishes.
    shutil.rmtree(train_dir)  # this trainer's files make room for the next one
  fs.remount(tiny_disk, 'size=64m')
  for impl in fs.TRAINERS:
    train_dir = os.path.join(tiny_disk, impl + '_again')
    os.makedirs(train_dir)
    _one_checkpoint_dir(impl, synth_data_dir, train_dir)
    code, out, err, exception = fs.invoke_cli(
        _train_args(impl, synth_data_dir, train_dir, 4, '--save_every', 1))
    assert (code, exception) == (0, None), err
    assert 'Resuming from %s at global step 2.' % _ckpt(train_dir, 2) in out


@pytest.mark.slow
@pytest.mark.parametrize('impl', fs.TRAINERS)
def test_full_disk_simulated_in_process(impl, synth_data_dir, tmp_path,
                                        monkeypatch):
  """The writer writes part of model.ckpt-3, then fails as on a full disk."""
  train_dir = str(tmp_path / 'train')
  os.makedirs(train_dir)
  _one_checkpoint_dir(impl, synth_data_dir, train_dir)
  partial = fs.data_file(_ckpt(train_dir, 3)) + '.tempstate123'

  def fail(original):
    def save(*args, **kwargs):
      with open(partial, 'wb') as f:
        f.write(b'\0' * 4096)
      raise tf.errors.ResourceExhaustedError(None, None, '%s; %s' % (partial, NO_SPACE))
    return save

  if impl == 'legacy':
    monkeypatch.setattr(tf.compat.v1.train.Saver, 'save',
                        fail(tf.compat.v1.train.Saver.save))
  else:
    monkeypatch.setattr(tf.train.CheckpointManager, 'save',
                        fail(tf.train.CheckpointManager.save))
  before = fs.snapshot(train_dir)
  code, out, err, exception = fs.invoke_cli(
      _train_args(impl, synth_data_dir, train_dir, 4, '--save_every', 1))
  assert exception is None, exception
  assert 'Traceback' not in out + err
  assert [l for l in err.splitlines() if l.startswith('Error: ')] == [
      _full_disk_message(train_dir)]
  assert code == 1
  assert fs.changed(before, fs.snapshot(train_dir)) == []
  assert not os.path.exists(partial)
  monkeypatch.undo()
  code, out, err, exception = fs.invoke_cli(
      _train_args(impl, synth_data_dir, train_dir, 4, '--save_every', 1))
  assert (code, exception) == (0, None), err
  assert 'Resuming from %s at global step 2.' % _ckpt(train_dir, 2) in out


@pytest.mark.parametrize('error, advice', [
    (OSError(errno.ENOSPC, 'No space left on device'), 'Free space on that disk'),
    (OSError(errno.EDQUOT, 'Disk quota exceeded'), 'Free space on that disk'),
    (OSError(errno.EFBIG, 'File too large'), 'Raise the file size limit (ulimit -f)'),
    (OSError(errno.EACCES, 'Permission denied'), 'Make it writable'),
    (OSError(errno.EPERM, 'Operation not permitted'), 'Make it writable'),
    (OSError(errno.EROFS, 'Read-only file system'), 'Make it writable'),
    (OSError(errno.EIO, 'Input/output error'), 'Fix that'),
], ids=lambda v: v if isinstance(v, str) else errno.errorcode[v.errno])
def test_a_failed_write_advises_what_fits_its_cause(error, advice, tmp_path):
  message = str(checkpoints.write_failed(str(tmp_path), 'checkpoint model.ckpt-5',
                                         error))
  assert message == ('could not write checkpoint model.ckpt-5 in %s (%s). %s, or pass '
                     'another --train_dir.' % (tmp_path, str(error), advice))
