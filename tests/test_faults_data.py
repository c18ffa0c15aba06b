"""The data commands under attack: data that cannot be real, unreadable files,
full and read-only disks, a kill or Ctrl-C midway, truncated archives.

Each case asserts the exit code, exactly one `Error:` line with the message's
key facts, no traceback (in-process: no exception), the one-line problems of
`data check`, and that every file that existed before is byte-identical
afterwards and no file was added - no partial file, no half-written data set.
Cases run in-process (click's CliRunner); a kill or Ctrl-C in a real process.
What root may always do (read a chmod 000 file) is tried as nobody.
"""

import collections
import contextlib
import glob
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time

import pytest

import faults_support as fs
from cifar10_towers.common import cifar10_format as fmt
from cifar10_towers.datasets import download
from cifar10_towers.datasets import synth

Case = collections.namedtuple('Case', [
    'name',  # test id
    'setup',  # callable(ws) -> (args, env); prepares ws
    'code',  # expected exit code
    'message',  # regex the one 'Error: ...' line must match (re.search)
    'problems',  # regexes of the lines `data check` prints before it, or None
    'mode',  # 'in' (CliRunner), 'user' (CliRunner, not as root)
])

UNPRIVILEGED = 65534  # nobody: root reads any file, so root tests as nobody


class Workspace:
  """A test's files under a directory every user may enter (for 'user' cases)."""

  def __init__(self, root, synth_data_dir):
    self.root = root
    self.data = os.path.join(root, 'data')
    shutil.copytree(synth_data_dir, self.data)
    for d, _, _ in os.walk(self.data):
      os.chmod(d, 0o755)  # pytest's copy source is 0700
    self.env = {'CIFAR10_DATA_URL': fs.closed_port_url()}  # never the network
    self.cleanups = []
    self.locks = []  # (path, mode) applied after the "before" snapshot, then undone

  def batch(self, name):
    return os.path.join(fmt.batches_dir(self.data), name)

  def mount(self, name, size, read_only=False):
    path = os.path.join(self.root, name)
    if not fs.mount_tmpfs(path, size):
      pytest.skip('mounting a tmpfs is not permitted here')
    self.cleanups.append(lambda: fs.umount(path))
    if read_only:
      fs.remount(path, 'ro')
    return path

  def lock(self, path, mode=0):
    self.locks.append((path, mode))


def _rewrite(path, change):
  data = bytearray(open(path, 'rb').read())
  change(data)
  with open(path, 'wb') as f:
    f.write(bytes(data))


def _check_args(ws):
  return ['data', 'check', '--data_dir', ws.data], ws.env


# --- setups -------------------------------------------------------------------

def all_zero_files(ws):
  for name in fmt.TRAIN_FILES + fmt.EVAL_FILES:
    size = os.path.getsize(ws.batch(name))
    with open(ws.batch(name), 'wb') as f:
      f.write(bytes(size))
  return _check_args(ws)


def one_label_only(ws):
  def relabel(data):
    data[0::fmt.RECORD_BYTES] = bytes([3]) * (len(data) // fmt.RECORD_BYTES)
  _rewrite(ws.batch('data_batch_3.bin'), relabel)
  return _check_args(ws)


def copied_training_file(ws):
  shutil.copy(ws.batch('data_batch_1.bin'), ws.batch('data_batch_2.bin'))
  return _check_args(ws)


def copied_test_file(ws):
  shutil.copy(ws.batch('data_batch_4.bin'), ws.batch('test_batch.bin'))
  return _check_args(ws)


def unreadable_file(ws):
  ws.lock(ws.batch('data_batch_2.bin'))
  return _check_args(ws)


def unreadable_directory(ws):
  ws.lock(fmt.batches_dir(ws.data))
  return _check_args(ws)


def directory_for_a_file(ws):
  os.remove(ws.batch('data_batch_2.bin'))
  os.mkdir(ws.batch('data_batch_2.bin'))
  return _check_args(ws)


def batches_dir_is_a_file(ws):
  shutil.rmtree(fmt.batches_dir(ws.data))
  with open(fmt.batches_dir(ws.data), 'w') as f:
    f.write('not a directory\n')
  return _check_args(ws)


def synth_disk_full(ws):
  """Old data on a 10 MB disk; new data of 18 MB does not fit."""
  disk = ws.mount('disk', '10m')
  shutil.copytree(ws.data, os.path.join(disk, 'data'), dirs_exist_ok=True)
  return ['data', 'synth', '--data_dir', os.path.join(disk, 'data'), '--force',
          '--seed', '3'], ws.env


def digits_disk_full(ws):
  disk = ws.mount('disk', '2m')
  return ['data', 'digits', '--data_dir', os.path.join(disk, 'new')], ws.env


def synth_read_only(ws):
  disk = ws.mount('disk', '4m', read_only=True)
  return ['data', 'synth', '--data_dir', os.path.join(disk, 'new')], ws.env


def digits_read_only(ws):
  disk = ws.mount('disk', '4m', read_only=True)
  return ['data', 'digits', '--data_dir', disk], ws.env


def download_read_only(ws):
  disk = ws.mount('disk', '4m', read_only=True)
  return ['data', 'download', '--data_dir', disk], ws.env


def synth_not_permitted(ws):
  target = os.path.join(ws.root, 'theirs')
  os.mkdir(target)
  ws.lock(target, 0o555)
  return ['data', 'synth', '--data_dir', target], ws.env


def digits_batches_dir_is_a_file(ws):
  batches_dir_is_a_file(ws)
  return ['data', 'digits', '--data_dir', ws.data], ws.env


def synth_batches_dir_is_a_file(ws):
  batches_dir_is_a_file(ws)
  return ['data', 'synth', '--data_dir', ws.data], ws.env


def digits_below_a_file(ws):
  with open(os.path.join(ws.root, 'file'), 'w') as f:
    f.write('x\n')
  return ['data', 'digits', '--data_dir', os.path.join(ws.root, 'file', 'new')], ws.env


def _archive(ws, name='cifar-10-binary.tar.gz'):
  """A tar.gz of ws.data's six files; returns its path and SHA-256."""
  path = os.path.join(ws.root, 'mirror', name)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with tarfile.open(path, 'w:gz') as tar:
    for name in fmt.TRAIN_FILES + fmt.EVAL_FILES:
      tar.add(ws.batch(name), arcname='%s/%s' % (fmt.BATCHES_DIR, name))
  with open(path, 'rb') as f:
    return path, hashlib.sha256(f.read()).hexdigest()


def _truncated_archive(ws):
  path, _ = _archive(ws)
  with open(path, 'r+b') as f:
    f.truncate(os.path.getsize(path) // 2)
  return path


def download_truncated_copy(ws):
  url = 'file://' + _truncated_archive(ws)
  return ['data', 'download', '--data_dir', os.path.join(ws.root, 'target')], {
      'CIFAR10_DATA_URL': url}


def download_truncated_local_archive(ws):
  target = os.path.join(ws.root, 'target')
  os.mkdir(target)
  shutil.copy(_truncated_archive(ws), download.archive_path(target))
  return ['data', 'download', '--data_dir', target], ws.env


def download_disk_full(ws):
  disk = ws.mount('disk', '1m')
  path, _ = _archive(ws)
  return ['data', 'download', '--data_dir', disk], {'CIFAR10_DATA_URL': 'file://' + path}


def download_disk_full_while_unpacking(ws):
  """The archive (its digest made the expected one) fits; unpacked it does not."""
  path, ws.expected_sha256 = _archive(ws)
  disk = ws.mount('disk', '%dk' % (os.path.getsize(path) // 1024 + 600))
  return ['data', 'download', '--data_dir', disk], {'CIFAR10_DATA_URL': 'file://' + path}


FULL = (r'^Error: cannot write to .*: No space left on device \(about \d+ MiB are '
        r'needed\); nothing was changed there\. Free some space or pass another '
        r'--data_dir\.$')
READ_ONLY = (r'^Error: cannot write to .*/disk(/new)?: Read-only file system; nothing '
             r'was changed there\. Pass a --data_dir you can write to\.$')
CHECK_FAILED = (r"^Error: %d problem\(s\) in .*/data\. Re-download \(`python cli\.py "
                r"data download`\) or regenerate \(`python cli\.py data synth "
                r"--force`\)\.$")

CASES = [
    Case('check_all_zero_files', all_zero_files, 1, CHECK_FAILED % 6, [
        r'/data_batch_1\.bin: cannot be real data: all 200 images are the same '
        r'image \(every byte 0\); all 200 records have label 0$',
        r'/data_batch_2\.bin: cannot be real data: all 200 images are the same '
        r'image \(every byte 0\); all 200 records have label 0; a byte-for-byte '
        r'copy of data_batch_1\.bin$'] + [r'/data_batch_[345]\.bin: '] * 3 + [
            r'/test_batch\.bin: cannot be real data: all 300 images'], 'in'),
    Case('check_one_label_only', one_label_only, 1, CHECK_FAILED % 1, [
        r'/data_batch_3\.bin: cannot be real data: all 200 records have label 3$'],
         'in'),
    Case('check_copied_training_file', copied_training_file, 1, CHECK_FAILED % 1, [
        r'/data_batch_2\.bin: cannot be real data: a byte-for-byte copy of '
        r'data_batch_1\.bin$'], 'in'),
    Case('check_test_file_copied_from_training', copied_test_file, 1,
         CHECK_FAILED % 1, [r'/test_batch\.bin: cannot be real data: a '
                            r'byte-for-byte copy of data_batch_4\.bin$'], 'in'),
    Case('check_unreadable_file', unreadable_file, 1, CHECK_FAILED % 1, [
        r'/data_batch_2\.bin: cannot be read \(Permission denied\)$'], 'user'),
    Case('check_unreadable_directory', unreadable_directory, 1, CHECK_FAILED % 1, [
        r'/data/cifar-10-batches-bin: cannot be listed \(Permission denied\)$'],
         'user'),
    Case('check_directory_for_a_file', directory_for_a_file, 1, CHECK_FAILED % 1, [
        r'/data_batch_2\.bin: a directory, not a data file$'], 'in'),
    Case('check_batches_dir_is_a_file', batches_dir_is_a_file, 1, CHECK_FAILED % 1, [
        r'/data/cifar-10-batches-bin: a file, not a directory$'], 'in'),
    Case('synth_disk_full_keeps_the_old_data', synth_disk_full, 1, FULL, None, 'in'),
    Case('digits_disk_full', digits_disk_full, 1, FULL, None, 'in'),
    Case('synth_read_only', synth_read_only, 1, READ_ONLY, None, 'in'),
    Case('digits_read_only', digits_read_only, 1, READ_ONLY, None, 'in'),
    Case('download_read_only', download_read_only, 1, READ_ONLY, None, 'in'),
    Case('synth_not_permitted', synth_not_permitted, 1,
         r'^Error: cannot write to .*/theirs: Permission denied; nothing was '
         r'changed there\. Pass a --data_dir you can write to\.$', None, 'user'),
    Case('synth_batches_dir_is_a_file', synth_batches_dir_is_a_file, 1,
         r'^Error: .*/data/cifar-10-batches-bin is a file, not a directory; '
         r'nothing was written\. Move it away or pass another --data_dir\.$', None,
         'in'),
    Case('digits_batches_dir_is_a_file', digits_batches_dir_is_a_file, 1,
         r'^Error: .*/data/cifar-10-batches-bin is a file, not a directory', None,
         'in'),
    Case('digits_below_a_file', digits_below_a_file, 1,
         r"^Error: .*/file/new: Not a directory\. Check the path and its "
         r"permissions\.$", None, 'in'),
    Case('download_truncated_copy', download_truncated_copy, 1,
         r'^Error: the file downloaded from file://.*/mirror/cifar-10-binary\.tar'
         r'\.gz has SHA-256 [0-9a-f]{64}, expected c4a38c50.*: it is corrupt or not the '
         r'CIFAR-10 binary archive, and was not unpacked\. Put a good copy at '
         r'.*/target/cifar-10-binary\.tar\.gz',
         None, 'in'),
    Case('download_truncated_local_archive', download_truncated_local_archive, 1,
         r'^Error: the local archive .*/target/cifar-10-binary\.tar\.gz has SHA-256 '
         r'[0-9a-f]{64}, expected c4a38c50.*: it is corrupt or not the CIFAR-10 '
         r'binary archive, and was not unpacked\. Put a good copy at .*/target/'
         r'cifar-10-binary\.tar\.gz \(or delete the one there\)', None, 'in'),
    Case('download_disk_full', download_disk_full, 1, FULL, None, 'in'),
    Case('download_disk_full_while_unpacking', download_disk_full_while_unpacking,
         1, FULL, None, 'in'),
]


@contextlib.contextmanager
def _unprivileged():
  """As root, act as nobody in this process (root reads any file); else as is."""
  if os.geteuid() != 0:
    yield
    return
  os.setegid(UNPRIVILEGED)
  os.seteuid(UNPRIVILEGED)
  try:
    yield
  finally:
    os.seteuid(0)
    os.setegid(0)


@pytest.fixture
def ws(synth_data_dir):
  # Under /tmp, not pytest's tmp_path (0700): nobody must reach it.
  root = tempfile.mkdtemp(prefix='faults_data_')
  os.chmod(root, 0o755)
  workspace = Workspace(root, synth_data_dir)
  yield workspace
  for cleanup in reversed(workspace.cleanups):
    cleanup()
  shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize('case', CASES, ids=lambda c: c.name)
def test_data_command_fault(case, ws, monkeypatch):
  args, env = case.setup(ws)
  before = fs.snapshot(ws.root)
  modes = [(path, os.stat(path).st_mode) for path, _ in ws.locks]
  for path, mode in ws.locks:
    os.chmod(path, mode)
  try:
    if case.mode == 'user':
      with _unprivileged():
        code, out, err, exception = fs.invoke_cli(args, env=env)
    else:
      if hasattr(ws, 'expected_sha256'):  # the CLI reads it when it downloads
        monkeypatch.setattr(download, 'ARCHIVE_SHA256', ws.expected_sha256)
      code, out, err, exception = fs.invoke_cli(args, env=env)
  finally:
    for path, mode in modes:
      os.chmod(path, mode)
  after = fs.snapshot(ws.root)
  print('\n[%s] exit %d:\n%s' % (case.name, code, err.strip()[-1200:]))
  assert exception is None, 'raised (a user would see a traceback): %r' % exception
  assert 'Traceback' not in out + err, err
  errors = [line for line in err.splitlines() if line.startswith('Error: ')]
  assert len(errors) == 1, err
  assert re.search(case.message, errors[0]), errors[0]
  assert code == case.code, (code, errors[0])
  if case.problems is not None:
    problems = [line for line in err.splitlines() if not line.startswith('Error: ')]
    assert len(problems) == len(case.problems), problems
    for pattern, line in zip(case.problems, problems):
      assert re.search(pattern, line), line
  # Nothing that existed changed, and nothing was added: no partial file.
  assert fs.changed(before, after) == []
  assert sorted(set(after) - set(before)) == []


@pytest.mark.slow
def test_training_warns_on_data_that_cannot_be_real_and_goes_on(ws):
  """All-zero training files: one warning per file naming it; training runs."""
  for name in fmt.TRAIN_FILES:
    size = os.path.getsize(ws.batch(name))
    with open(ws.batch(name), 'wb') as f:
      f.write(bytes(size))
  before = fs.snapshot(ws.data)
  code, out, err, exception = fs.invoke_cli(
      ['legacy', '--data_dir', ws.data, '--train_dir', os.path.join(ws.root, 'train'),
       '--max_steps', 1] + list(fs.FAST_FLAGS), env=ws.env)
  assert exception is None, exception
  assert code == 0, err
  warnings = [line for line in err.splitlines() if line.startswith('Warning: ')]
  assert len(warnings) == 5, err
  for name, line in zip(fmt.TRAIN_FILES, warnings):
    assert re.match(r'^Warning: .*/%s cannot be real data: all 200 images are the '
                    r'same image \(every byte 0\); all 200 records have label 0'
                    % re.escape(name), line), line
    assert line.endswith('; training goes on (`python cli.py data check --data_dir '
                         '%s` lists every problem).' % ws.data)
  assert 'step 1, loss = ' in out
  assert fs.changed(before, fs.snapshot(ws.data)) == []


@pytest.mark.slow
def test_eval_warns_on_a_test_file_that_cannot_be_real(ws, synth_data_dir):
  """An all-zero test file: one warning naming it; the evaluation still runs."""
  path = ws.batch('test_batch.bin')
  size = os.path.getsize(path)
  with open(path, 'wb') as f:
    f.write(bytes(size))
  train_dir = fs.copy_trained('modern', synth_data_dir, os.path.join(ws.root, 'train'))
  before = fs.snapshot(ws.data, train_dir)
  code, out, err, exception = fs.invoke_cli(
      ['eval', '--run_once', '--data_dir', ws.data, '--checkpoint_dir', train_dir],
      env=ws.env)
  assert exception is None, exception
  assert code == 0, err
  assert err.splitlines() == [
      'Warning: %s cannot be real data: all 300 images are the same image (every '
      'byte 0); all 300 records have label 0; a precision measured on it means '
      'nothing.' % path]
  assert 'precision @ 1 = ' in out
  assert fs.changed(before, fs.snapshot(ws.data, train_dir)) == []


def test_content_is_judged_from_ten_records_on(tmp_path):
  """Nine equal records may be a hand-made test file; ten are not real data."""
  path = tmp_path / 'x.bin'

  def judged(data):
    path.write_bytes(data)
    return fmt._judge(str(path), {})  # pylint: disable=protected-access

  record = bytes([7]) + bytes(range(256)) * 12
  for n, expected in ((9, []), (10, ['all 10 images are the same image',
                                      'all 10 records have label 7'])):
    assert judged(record * n) == (n, expected)
  varied = bytearray(record * 10)
  varied[1 + fmt.RECORD_BYTES * 9] ^= 1  # one byte of the last image
  assert judged(bytes(varied)) == (10, ['all 10 records have label 7'])


def _staged(data_dir):
  return glob.glob(os.path.join(data_dir, '.cifar-10-batches-bin.partial-*'))


def _interrupt_midway(ws, data_dir, sig, extra=()):
  """Starts `data synth` into data_dir, signals it once it is writing files."""
  proc = subprocess.Popen(
      [sys.executable, fs.CLI, 'data', 'synth', '--data_dir', data_dir,
       '--train_per_file', '4000', '--num_test', '20000', '--seed', '5']
      + list(extra),
      cwd=fs.ROOT, env=fs.cli_env(ws.env), stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 60
  try:
    while time.time() < deadline and proc.poll() is None:
      if any(os.path.exists(os.path.join(stage, 'data_batch_2.bin'))
             for stage in _staged(data_dir)):
        break
      time.sleep(0.005)
    assert proc.poll() is None, 'synth ended before it could be interrupted'
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.communicate()
  return proc.returncode, out, err


@pytest.mark.slow
def test_synth_force_killed_midway_leaves_the_old_data(ws):
  """SIGKILL while replacing data: the old set stays whole and valid; the next
  writer removes what the killed one left."""
  batches = fmt.batches_dir(ws.data)
  before = fs.snapshot(batches)
  code, _, err = _interrupt_midway(ws, ws.data, signal.SIGKILL, ['--force'])
  assert code == -signal.SIGKILL, err
  after = fs.snapshot(batches)
  assert fs.changed(before, after) == [] and set(after) == set(before)
  assert fmt.check_data_dir(ws.data)[0] == []
  assert len(_staged(ws.data)) == 1  # hidden, and never read as data
  code, out, err, exception = fs.invoke_cli(
      ['data', 'synth', '--data_dir', ws.data, '--force', '--train_per_file', 20])
  assert (code, exception) == (0, None), err
  assert _staged(ws.data) == []
  assert fmt.check_data_dir(ws.data)[1] == dict(
      {name: 20 for name in fmt.TRAIN_FILES}, **{'test_batch.bin': 1000})
  assert 'Wrote 100 training and 1000 test records' in out


@pytest.mark.slow
def test_synth_interrupted_midway_leaves_nothing(ws):
  """Ctrl-C while writing new data: exit 130, one line, no cifar-10-batches-bin, no leftovers."""
  target = os.path.join(ws.root, 'new')
  code, _, err = _interrupt_midway(ws, target, signal.SIGINT)
  assert code == 130, err
  assert 'Traceback' not in err
  assert fs.ours(err)[-1] == ('Stopped by SIGINT; `data synth` did not finish, and '
                              'left nothing half-written.')
  assert not os.path.exists(target)  # the directory it created is removed too
  code, _, err, _ = fs.invoke_cli(['data', 'check', '--data_dir', target])
  assert code == 1 and 'directory not found' in err


def test_a_replaced_data_set_keeps_other_files(ws):
  """--force replaces the six files and the class names, keeps the user's own."""
  with open(ws.batch('readme.html'), 'w') as f:
    f.write('<p>notes</p>\n')
  synth.generate(ws.data, train_per_file=12, num_test=11, seed=9)
  assert open(ws.batch('readme.html')).read() == '<p>notes</p>\n'
  assert fmt.check_data_dir(ws.data)[1]['test_batch.bin'] == 11
  assert _staged(ws.data) == []
