"""Bad input: a one-line error saying what is wrong and what to do, and nothing changed.

Each case runs the CLI as a user would - a real `python cli.py` subprocess
where that costs no TensorFlow import, click's CliRunner in this process
otherwise - and asserts the exit code (2 for usage
errors, 1 for runtime ones), the message, that no traceback was printed (or,
in-process, raised), and that every file that existed before is byte-identical
afterwards and no file was added.
"""

import collections
import hashlib
import io
import os
import re
import shutil
import tarfile

import pytest
import tensorflow as tf

import faults_support as fs
from cifar10_towers.common import cifar10_format as fmt
from cifar10_towers.datasets import download

Case = collections.namedtuple('Case', [
    'name',  # test id
    'setup',  # callable(ws, impl) -> (args, env); prepares ws
    'code',  # expected exit code: 2 usage error, 1 runtime error
    'message',  # regex the one 'Error: ...' line must match (re.search)
    'mode',  # 'sub' (subprocess) or 'in' (CliRunner in this process)
])


class Workspace:
  """A test's files: a copy of the generated data, a train_dir, and room around."""

  def __init__(self, root, synth_data_dir):
    self.root = str(root)
    self.synth = synth_data_dir
    self.data = os.path.join(self.root, 'data')
    shutil.copytree(synth_data_dir, self.data)
    self.train = os.path.join(self.root, 'train')
    self.env = {'CIFAR10_DATA_URL': fs.closed_port_url()}  # never the network
    self.cleanups = []

  def batch(self, name):
    return os.path.join(fmt.batches_dir(self.data), name)

  def trained(self, impl):
    """train_dir := a copy of a trained dir of impl (model.ckpt-1 and -2)."""
    return fs.copy_trained(impl, self.synth, self.train)


def _train_args(impl, ws, *extra):
  return ([impl, '--data_dir', ws.data, '--train_dir', ws.train,
           '--max_steps', 3] + list(fs.FAST_FLAGS) + list(extra))


# --- setups -------------------------------------------------------------------

def missing_data_dir(ws, impl):
  ws.data = os.path.join(ws.root, 'no_such_data')
  return _train_args(impl, ws), ws.env


def missing_data_file(ws, impl):
  os.remove(ws.batch('data_batch_3.bin'))
  return _train_args(impl, ws), ws.env


def extra_data_file(ws, impl):
  shutil.copy(ws.batch('data_batch_5.bin'), ws.batch('data_batch_6.bin'))
  return _train_args(impl, ws), ws.env


def truncated_file(ws, impl):
  path = ws.batch('data_batch_2.bin')
  with open(path, 'r+b') as f:
    f.truncate(os.path.getsize(path) - 100)
  return _train_args(impl, ws), ws.env


def oversized_file(ws, impl):
  with open(ws.batch('data_batch_4.bin'), 'ab') as f:
    f.write(b'\0' * 10)
  return _train_args(impl, ws), ws.env


def label_out_of_range(ws, impl):
  with open(ws.batch('data_batch_1.bin'), 'r+b') as f:
    f.seek(5 * fmt.RECORD_BYTES)  # the label byte of record 5
    f.write(bytes([10]))
  return _train_args(impl, ws), ws.env


def too_few_examples(ws, impl):
  """One record per training file: 5 examples, too few for batch 2000."""
  for name in fmt.TRAIN_FILES:
    with open(ws.batch(name), 'r+b') as f:
      f.truncate(fmt.RECORD_BYTES)
  args = _train_args(impl, ws)
  args[args.index('--batch_size') + 1] = '2000'
  return args, ws.env


def flag(name, value):
  def setup(ws, impl):
    args = _train_args(impl, ws)
    i = args.index(name) if name in args else None
    if i is None:
      args += [name, value]
    else:
      args[i + 1] = value
    return args, ws.env
  return setup


def train_dir_is_a_file(ws, impl):
  with open(ws.train, 'w') as f:
    f.write('not a directory\n')
  return _train_args(impl, ws), ws.env


def train_dir_under_a_file(ws, impl):
  with open(ws.train, 'w') as f:
    f.write('not a directory\n')
  ws.train = os.path.join(ws.train, 'run1')
  return _train_args(impl, ws), ws.env


def train_dir_not_writable(ws, impl):
  """A train_dir (holding a checkpoint) on a read-only filesystem.

  Root ignores permission bits, so as root this mounts a read-only tmpfs
  (and skips when mounting is not permitted); otherwise it is chmod 0555.
  """
  ws.train = os.path.join(ws.root, 'read_only')
  if os.geteuid() == 0:
    if not fs.mount_tmpfs(ws.train, '32m'):
      pytest.skip('running as root, and mounting a read-only tmpfs is not '
                  'permitted here: root can write any directory')
    ws.cleanups.append(lambda: fs.umount(ws.train))
    for name in os.listdir(fs.trained_dir(impl, ws.synth)):
      shutil.copy(os.path.join(fs.trained_dir(impl, ws.synth), name), ws.train)
    fs.remount(ws.train, 'ro')
  else:
    shutil.copytree(fs.trained_dir(impl, ws.synth), ws.train)
    os.chmod(ws.train, 0o555)
    ws.cleanups.append(lambda: os.chmod(ws.train, 0o755))
  return _train_args(impl, ws), ws.env


def _other_model_checkpoint(kind, directory):
  """A checkpoint of `kind` whose conv1/weights is 3x3x3x64 (ours: 5x5x3x64)."""
  os.makedirs(directory, exist_ok=True)
  if kind == 'legacy':
    with tf.Graph().as_default():
      tf.compat.v1.get_variable('conv1/weights', shape=[3, 3, 3, 64])
      tf.compat.v1.train.get_or_create_global_step()
      saver = tf.compat.v1.train.Saver(save_relative_paths=True)
      with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        saver.save(sess, os.path.join(directory, 'model.ckpt'), global_step=5)
  else:
    model = tf.Module()
    model.conv1 = tf.Module()
    model.conv1.weights = tf.Variable(tf.zeros([3, 3, 3, 64]))
    checkpoint = tf.train.Checkpoint(
        global_step=tf.Variable(5, dtype=tf.int64), model=model)
    tf.train.CheckpointManager(checkpoint, directory, 5,
                               checkpoint_name='model.ckpt').save(5)


def checkpoint_of_another_model(ws, impl):
  _other_model_checkpoint(impl, ws.train)
  return _train_args(impl, ws, '--max_steps', 8), ws.env


def checkpoint_of_the_other_trainer(ws, impl):
  ws.trained('modern' if impl == 'legacy' else 'legacy')
  return _train_args(impl, ws), ws.env


def corrupted_checkpoint(ws, impl):
  fs.flip_bytes(fs.data_file(os.path.join(ws.trained(impl), 'model.ckpt-2')))
  return _train_args(impl, ws), ws.env


def latest_checkpoint_missing(ws, impl):
  ws.trained(impl)
  os.remove(os.path.join(ws.train, 'model.ckpt-2.index'))
  return _train_args(impl, ws), ws.env


def eval_no_checkpoint(ws, impl):
  os.makedirs(ws.train)
  return ['eval', '--run_once', '--data_dir', ws.data, '--checkpoint_dir',
          ws.train], ws.env


def eval_missing_test_file(ws, impl):
  ws.trained(impl)
  os.remove(ws.batch('test_batch.bin'))
  return ['eval', '--run_once', '--data_dir', ws.data, '--checkpoint_dir',
          ws.train], ws.env


def _archive(path, members):
  """A tar.gz of (name, bytes) members; returns its SHA-256."""
  with tarfile.open(path, 'w:gz') as tar:
    for name, data in members:
      info = tarfile.TarInfo(name)
      info.size = len(data)
      tar.addfile(info, io.BytesIO(data))
  with open(path, 'rb') as f:
    return hashlib.sha256(f.read()).hexdigest()


def _cifar_members(ws):
  members = []
  for name in fmt.TRAIN_FILES + fmt.EVAL_FILES:
    with open(ws.batch(name), 'rb') as f:
      members.append(('%s/%s' % (fmt.BATCHES_DIR, name), f.read()))
  return members


def download_wrong_checksum(ws, impl):
  archive = os.path.join(ws.root, 'mirror', 'cifar-10-binary.tar.gz')
  os.makedirs(os.path.dirname(archive))
  _archive(archive, _cifar_members(ws))
  target = os.path.join(ws.root, 'target')
  os.makedirs(target)
  with open(os.path.join(target, 'notes.txt'), 'w') as f:
    f.write('the user\'s own file\n')
  return (['data', 'download', '--data_dir', target],
          {'CIFAR10_DATA_URL': 'file://' + archive})


def download_escaping_member(ws, impl):
  """An archive whose SHA-256 is (made) the expected one, with a '../' member."""
  archive = os.path.join(ws.root, 'mirror', 'cifar-10-binary.tar.gz')
  os.makedirs(os.path.dirname(archive))
  sha = _archive(archive, _cifar_members(ws) + [
      ('%s/../../escaped.bin' % fmt.BATCHES_DIR, b'outside')])
  ws.expected_sha256 = sha
  target = os.path.join(ws.root, 'target')
  os.makedirs(target)
  return (['data', 'download', '--data_dir', target],
          {'CIFAR10_DATA_URL': 'file://' + archive})


TRAIN_CASES = [
    Case('missing_data_dir_and_no_download', missing_data_dir, 1,
         r'^Error: could not reach http://127\.0\.0\.1:\d+/cifar-10-binary\.tar\.gz '
         r'\(.*\)\. Without network access, run `python cli\.py data synth '
         r'--data_dir .*no_such_data` for generated data, or copy '
         r'cifar-10-binary\.tar\.gz', 'sub'),
    Case('missing_data_file', missing_data_file, 1,
         r'^Error: missing training data file .*/data_batch_3\.bin \(1 of 5 '
         r'missing\)\. Run `python cli\.py data download --data_dir .*` for '
         r'CIFAR-10, or `python cli\.py data synth', 'sub'),
    Case('extra_data_file', extra_data_file, 1,
         r'^Error: .*/data_batch_6\.bin is not a CIFAR-10 data file, and training '
         r'would silently ignore it \(1 unexpected \.bin file\(s\)\)\. Move it '
         r'out of .*; `python cli\.py data check` lists every problem\.$', 'sub'),
    Case('truncated_file', truncated_file, 1,
         r'^Error: .*/data_batch_2\.bin: size 614500 bytes is not a multiple of '
         r'the 3073-byte record; record 199 is truncated at byte offset 611527\. '
         r'Re-download or regenerate the data\.$', 'sub'),
    Case('wrongly_sized_file', oversized_file, 1,
         r'^Error: .*/data_batch_4\.bin: size 614610 bytes is not a multiple of '
         r'the 3073-byte record', 'sub'),
    Case('label_byte_outside_0_to_9', label_out_of_range, 1,
         r'^Error: .*/data_batch_1\.bin: record 5 \(byte offset 15365\) has label '
         r'byte 10, outside 0\.\.9; 1 record\(s\) are bad\. Re-download or '
         r'regenerate the data\.$', 'sub'),
    Case('num_gpus_0', flag('--num_gpus', 0), 2,
         r"^Error: Invalid value for '--num_gpus': 0 is not in the range "
         r"1<=x<=64\.$", 'sub'),
    Case('num_gpus_more_than_possible', flag('--num_gpus', 65), 2,
         r"^Error: Invalid value for '--num_gpus': 65 is not in the range "
         r"1<=x<=64\.$", 'sub'),
    Case('batch_size_0', flag('--batch_size', 0), 2,
         r"^Error: Invalid value for '--batch_size': 0 is not in the range "
         r"x>=1\.$", 'sub'),
    Case('max_steps_negative', flag('--max_steps', -1), 2,
         r"^Error: Invalid value for '--max_steps': -1 is not in the range "
         r"x>=0\.$", 'sub'),
    Case('train_dir_is_a_file', train_dir_is_a_file, 2,
         r"^Error: Invalid value for --train_dir: .*/train is a file, not a "
         r"directory; pass another --train_dir\.$", 'sub'),
    Case('train_dir_under_a_file', train_dir_under_a_file, 2,
         r"^Error: Invalid value for --train_dir: .*/train is a file, so "
         r".*/train/run1 cannot be created under it; pass another --train_dir\.$",
         'sub'),
    Case('train_dir_not_writable', train_dir_not_writable, 2,
         r"^Error: Invalid value for --train_dir: .*/read_only is not writable; "
         r"pass another --train_dir\.$", 'sub'),
    Case('checkpoint_of_another_model', checkpoint_of_another_model, 1,
         r'^Error: .*/train/model\.ckpt-5 is a checkpoint of another model: it '
         r'holds (model/)?conv1/weights with shape \[3, 3, 3, 64\], this model '
         r'has \[5, 5, 3, 64\] \(\d+ of the \d+ variables differ\)\. Use another '
         r'--train_dir, or move its checkpoints away\.$', 'in'),
    Case('checkpoint_of_the_other_trainer', checkpoint_of_the_other_trainer, 1,
         r'^Error: .*/train/model\.ckpt-2 is a (modern|legacy) \(tf\..*\) '
         r'checkpoint; the (legacy|modern) trainer .*Convert it \(`python cli\.py '
         r'convert --from_dir \S*/train --to_dir \S*/train_(legacy|modern)`\) and '
         r'train with --train_dir \S*/train_(legacy|modern), or use another '
         r'--train_dir',
         'in'),
    Case('decay_steps_zero', too_few_examples, 1,
         r'^Error: decay_steps = int\(5 examples / 2000 batch / 1 towers \* 350 '
         r'epochs\) = 0: too few training examples for this batch size\. Use '
         r'more data or a smaller --batch_size\.$', 'in'),
    Case('corrupted_checkpoint', corrupted_checkpoint, 1,
         r'^Error: checkpoint .*/train/model\.ckpt-2 is damaged \(Checksum does '
         r'not match: stored \d+ vs\. calculated on the restored bytes \d+\), and '
         r'it is the latest checkpoint; the newest intact one is model\.ckpt-1: '
         r'to resume from it, move model\.ckpt-2\.\* and `checkpoint` out of '
         r'.*/train; or use another --train_dir\.$', 'in'),
    Case('latest_checkpoint_files_missing', latest_checkpoint_missing, 1,
         r'^Error: checkpoint .*/train/model\.ckpt-2 is damaged \(Failed to find any '
         r'matching files for .*/train/model\.ckpt-2\), and it is the latest checkpoint; the '
         r'newest intact one is model\.ckpt-1: to resume from it, move '
         r'model\.ckpt-2\.\* and `checkpoint` out of .*/train; or use another '
         r'--train_dir\.$', 'in'),
]

EVAL_CASES = [
    Case('eval_no_checkpoint', eval_no_checkpoint, 1,
         r'^Error: no checkpoint in .*/train\. Train first \(`python cli\.py '
         r'legacy` or `modern` with --train_dir .*/train\), or pass the '
         r'--checkpoint_dir you trained into\.$', 'in'),
    # A damaged newest checkpoint is skipped, not an error: tests/test_faults_state.py.
    Case('eval_missing_test_file', eval_missing_test_file, 1,
         r'^Error: missing test data file .*/test_batch\.bin \(1 of 1 missing\)',
         'in'),
]

DOWNLOAD_CASES = [
    Case('download_wrong_checksum', download_wrong_checksum, 1,
         r'^Error: the file downloaded from file://.*/mirror/cifar-10-binary\.tar\.gz '
         r'has SHA-256 [0-9a-f]{64}, expected c4a38c50a1bc5f3a1c5537f2155ab9d68f9f25eb'
         r'1ed8d9ddda3db29a59bca1dd: it is corrupt or not the CIFAR-10 binary archive, '
         r'and was not unpacked\. Put a good copy at .*/target/cifar-10-binary\.tar\.gz '
         r'\(the download was not kept\) or check the URL, and run this again\.$', 'sub'),
    Case('download_member_escaping_the_target', download_escaping_member, 1,
         r"^Error: refusing to unpack: archive member "
         r"'cifar-10-batches-bin/\.\./\.\./escaped\.bin' would be extracted to '.*', "
         r"which is outside the destination; nothing was written\. This is not the "
         r"CIFAR-10 archive: fetch it from https://www\.cs\.toronto\.edu/~kriz/"
         r"cifar-10-binary\.tar\.gz instead \(unset CIFAR10_DATA_URL\)\.$", 'in'),
]


def _check(case, ws, impl, monkeypatch):
  """Runs one case; asserts code, the one-line message, no traceback, no change."""
  try:
    args, env = case.setup(ws, impl)
    before = fs.snapshot(ws.root)
    if case.mode == 'sub':
      result = fs.run_cli(args, env=env)
      code, out, err, exception = (result.returncode, result.stdout,
                                   result.stderr, None)
    else:
      if hasattr(ws, 'expected_sha256'):  # the CLI reads it when it downloads
        monkeypatch.setattr(download, 'ARCHIVE_SHA256', ws.expected_sha256)
      code, out, err, exception = fs.invoke_cli(args, env=env)
    after = fs.snapshot(ws.root)
  finally:
    for cleanup in reversed(ws.cleanups):
      cleanup()
  print('\n[%s %s] exit %d: %s' % (case.name, impl or '', code, err.strip()[-600:]))
  assert exception is None, 'raised (a user would see a traceback): %r' % exception
  assert 'Traceback' not in out + err, err
  errors = [line for line in err.splitlines() if line.startswith('Error: ')]
  assert len(errors) == 1, err
  assert re.search(case.message, errors[0]), errors[0]
  assert code == case.code, (code, errors[0])
  # Nothing that existed changed, and nothing was added.
  assert fs.changed(before, after) == []
  assert sorted(set(after) - set(before)) == []
  return errors[0]


def _params(cases, trained=()):
  """The cases, marked slow where they start a process ('sub') or use a trained dir."""
  return [pytest.param(c, id=c.name, marks=[pytest.mark.slow] * (
      c.mode == 'sub' or c.name in trained)) for c in cases]


@pytest.fixture
def ws(tmp_path, synth_data_dir):
  return Workspace(tmp_path, synth_data_dir)


@pytest.mark.slow
@pytest.mark.parametrize('impl', fs.TRAINERS)
@pytest.mark.parametrize('case', TRAIN_CASES, ids=lambda c: c.name)
def test_training_bad_input(case, impl, ws, monkeypatch):
  _check(case, ws, impl, monkeypatch)


@pytest.mark.parametrize('impl', fs.TRAINERS)
@pytest.mark.parametrize('case', _params(EVAL_CASES, trained=['eval_missing_test_file']))
def test_eval_bad_input(case, impl, ws, monkeypatch):
  _check(case, ws, impl, monkeypatch)


@pytest.mark.parametrize('case', _params(DOWNLOAD_CASES))
def test_download_bad_archive(case, ws, monkeypatch):
  _check(case, ws, None, monkeypatch)
  assert not os.path.exists(os.path.join(ws.root, 'escaped.bin'))
  assert os.listdir(os.path.join(ws.root, 'target')) in ([], ['notes.txt'])


@pytest.mark.slow
def test_data_check_reports_every_problem_at_once(ws):
  missing_data_file(ws, None)
  extra_data_file(ws, None)
  truncated_file(ws, None)
  label_out_of_range(ws, None)
  before = fs.snapshot(ws.root)
  result = fs.run_cli(['data', 'check', '--data_dir', ws.data])
  assert result.returncode == 1
  assert 'Traceback' not in result.stdout + result.stderr
  problems = result.stderr.splitlines()
  assert [re.sub(r'^.*/', '', p).split(':')[0] for p in problems[:4]] == [
      'data_batch_1.bin', 'data_batch_2.bin', 'data_batch_3.bin',
      'data_batch_6.bin']
  assert problems[4] == (
      'Error: 4 problem(s) in %s. Re-download (`python cli.py data download`) '
      'or regenerate (`python cli.py data synth --force`).' % ws.data)
  assert 'data_batch_4.bin: 200 records, ok' in result.stdout
  assert fs.changed(before, fs.snapshot(ws.root)) == []
