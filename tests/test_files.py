"""What the commands write: whole files or none, one line when a write fails, no scratch left.

common/files.py through the commands that use it. A full disk is faked in
process: the writer writes part of its file, then raises OSError(ENOSPC); a
stop (Ctrl-C, KeyboardInterrupt) likewise. A run killed outright is faked by
what it leaves: a scratch directory or temporary file named with a PID that
no process has now.
"""

import errno
import json
import os
import socket
import tempfile
import types

import numpy as np
import pytest
import tensorflow as tf
from click.testing import CliRunner

from cifar10_towers import bench
from cifar10_towers import cli
from cifar10_towers import convert
from cifar10_towers import crosscheck
from cifar10_towers.common import files
from cifar10_towers.datasets import download
from cifar10_towers.modern import checkpoints as modern_checkpoints
from cifar10_towers.runtime import lock
from cifar10_towers.towerprofile import legacy_trace
from cifar10_towers.towerprofile import run as profile_lib

FULL = 'No space left on device'
EARLIER = b'an earlier, whole file'


def _full_disk(path, *unused_args, **unused_kwargs):
  """A writer on a full disk: part of the file, then ENOSPC."""
  with open(path, 'wb') as f:
    f.write(b'partial')
  raise OSError(errno.ENOSPC, FULL)


def _stopped(path, *unused_args, **unused_kwargs):
  """A writer a stop signal interrupts: part of the file, then the stop."""
  with open(path, 'wb') as f:
    f.write(b'partial')
  raise KeyboardInterrupt


def _dead_pid():
  """A PID no process has, as a killed run's (the highest free one: no process
  started for it, so these tests stay in the quick tier)."""
  with open('/proc/sys/kernel/pid_max', encoding='ascii') as f:
    pid = int(f.read()) - 1
  while os.path.exists('/proc/%d' % pid):
    pid -= 1
  return pid


def _left_by_a_killed_run(directory, prefix):
  """The scratch directory a run killed outright left in `directory`, a partial file in it."""
  path = os.path.join(directory, f'{prefix}{socket.gethostname()}-{_dead_pid()}-0a0b0c')
  os.mkdir(path)
  with open(os.path.join(path, 'partial'), 'wb') as f:
    f.write(b'partial')
  return path


def _bench_report():
  return bench.read_json(os.path.join(os.path.dirname(__file__), '..', 'docs', 'bench.json'))


def _bench_json(monkeypatch, directory, writer):
  def partial_print(*unused_args, file):
    writer(file.name)
  monkeypatch.setattr(bench, 'print', partial_print, raising=False)
  bench.write_json(_bench_report(), os.path.join(directory, 'B.json'))


def _bench_plot(monkeypatch, directory, writer):
  pytest.importorskip('matplotlib')
  from matplotlib import figure  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(figure.Figure, 'savefig', lambda self, path, **_: writer(path))
  bench.plot(_bench_report(), os.path.join(directory, 'B.png'))


def _crosscheck_dump(monkeypatch, directory, writer):
  from cifar10_towers.common import optimizer as optimizer_lib  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(np, 'savez_compressed', writer)
  result = types.SimpleNamespace(tower_losses=[1.0], grads={'conv1/weights': [1.0]}, final={},
                                 steps=[])
  report = types.SimpleNamespace(optimizer=optimizer_lib.OptimizerSpec(), legacy=result, modern=result)
  crosscheck.write_evidence(directory, np.zeros([1, 2]), np.zeros([1]), {}, {'towers': report})


def _profile_out(monkeypatch, directory, writer):
  def partial_dump(unused_content, f, **unused_kwargs):
    writer(f.name)

  def no_matplotlib(*unused_args):
    raise ImportError('matplotlib')
  monkeypatch.setattr(json, 'dump', partial_dump)
  monkeypatch.setattr(profile_lib, 'png_timeline', no_matplotlib)
  profile_lib.write_all([], [(0.0, 1.0)], {'verdict': 'made up'}, directory)


OUTPUTS = [  # (writer, the files it writes, its flag)
    (_bench_json, ['B.json'], '--json'),
    (_bench_plot, ['B.png'], '--plot'),
    (_crosscheck_dump, ['crosscheck.npz'], '--dump'),
    (_profile_out, ['trace.json', 'report.json'], '--out'),
]


@pytest.mark.parametrize('write, names, flag', OUTPUTS, ids=[o[2] for o in OUTPUTS])
@pytest.mark.parametrize('fault', [_full_disk, _stopped], ids=['full_disk', 'stopped'])
def test_a_failed_or_stopped_write_leaves_the_earlier_files_whole(write, names, flag, fault,
                                                                  monkeypatch, tmp_path):
  for name in names:
    (tmp_path / name).write_bytes(EARLIER)
  expected = pytest.raises(files.WriteError if fault is _full_disk else KeyboardInterrupt)
  with expected as raised:
    write(monkeypatch, str(tmp_path), fault)
  assert sorted(os.listdir(tmp_path)) == sorted(names)  # no temporary file left
  assert all((tmp_path / name).read_bytes() == EARLIER for name in names)
  if fault is _full_disk:
    assert str(raised.value) == (
        f"could not write {', '.join(names)} in {tmp_path} ({FULL}). Free space on that disk, "
        f'or pass another {flag}.')


def test_a_full_disk_is_one_line_naming_the_file_and_the_flag(monkeypatch, tmp_path):
  pytest.importorskip('matplotlib')
  from matplotlib import figure  # pylint: disable=import-outside-toplevel
  results = tmp_path / 'B.json'
  bench.write_json(_bench_report(), str(results))
  monkeypatch.setattr(figure.Figure, 'savefig', lambda self, path, **_: _full_disk(path))
  result = CliRunner().invoke(cli.cli, ['bench', '--from_json', str(results),
                                        '--plot', str(tmp_path / 'B.png')])
  assert result.exit_code == 1
  assert result.output.splitlines()[-1] == (
      f'Error: could not write B.png in {tmp_path} ({FULL}). Free space on that disk, or pass '
      'another --plot.')
  assert os.listdir(tmp_path) == ['B.json']


def test_a_whole_write_replaces_the_file_and_removes_a_killed_writers_temp(tmp_path):
  path = tmp_path / 'B.json'
  path.write_bytes(EARLIER)
  _left_by_a_killed_run(str(tmp_path), '.writing-')
  bench.write_json(_bench_report(), str(path))
  assert os.listdir(tmp_path) == ['B.json']
  assert json.loads(path.read_text()) == _bench_report()


# --- scratch: removed when its owner ends, or by the next run if it was killed

@pytest.fixture
def temp_dir(tmp_path, monkeypatch):
  """$TMPDIR for the test: where bench's and profile's scratch go."""
  monkeypatch.setattr(tempfile, 'tempdir', str(tmp_path))
  return tmp_path


def test_bench_owns_its_contenders_scratch(temp_dir):
  stale = _left_by_a_killed_run(str(temp_dir), 'bench_')
  running = temp_dir / f'bench_{socket.gethostname()}-{os.getpid()}-0a0b0c'
  running.mkdir()  # a live run's: kept
  specs = []

  def launch(spec):
    specs.append(spec)
    os.mkdir(os.path.join(spec['scratch'], 'train_1'))  # the contender's train_dir
    raise KeyboardInterrupt  # a stop while they start

  config = bench.BenchConfig(num_gpus=(1,), data_dir=None, synth_per_file=10)
  with pytest.raises(KeyboardInterrupt):
    bench.run(config, launch=launch)
  # The generated data, the contenders' train_dirs: all in the one scratch.
  assert specs[0]['data_dir'] == specs[0]['scratch']
  assert os.path.dirname(specs[0]['scratch']) == str(temp_dir)
  assert os.listdir(temp_dir) == [running.name]
  assert not os.path.exists(stale)


@pytest.mark.slow
def test_profile_scratch_goes_with_it(temp_dir, synth_data_dir, device_plan, monkeypatch):
  stale = _left_by_a_killed_run(str(temp_dir), 'towerprofile_')
  used = []

  def trace(config, *unused_args):
    used.append(config.train_dir)
    raise KeyboardInterrupt

  monkeypatch.setattr(legacy_trace, 'trace', trace)
  with pytest.raises(KeyboardInterrupt):
    profile_lib.profile('legacy', device_plan, 8, 1, data_dir=synth_data_dir)
  assert os.path.dirname(used[0]) == str(temp_dir)
  assert os.listdir(temp_dir) == []
  assert not os.path.exists(stale)


# --- convert: its staging, a full disk, a concurrent writer ---------------------

@pytest.fixture(scope='module')
def legacy_dir(tmp_path_factory):
  """A legacy train_dir at global step 30, its variables all zero (cheap to write)."""
  directory = str(tmp_path_factory.mktemp('legacy'))
  values = {name: np.zeros(shape, np.float32)
            for name, shape in modern_checkpoints.legacy_shapes('sgd').items()}
  convert.write_legacy(directory, dict(values, global_step=30), 'sgd')
  return directory


def _convert(legacy_dir, to_dir):
  return CliRunner().invoke(cli.cli, ['convert', '--from_dir', legacy_dir, '--to_dir', to_dir])


def test_convert_removes_a_killed_converts_staging(legacy_dir, tmp_path):
  stale = _left_by_a_killed_run(str(tmp_path), '.C.converting-')
  result = _convert(legacy_dir, str(tmp_path / 'C'))
  assert result.exit_code == 0, result.output
  assert os.listdir(tmp_path) == ['C']
  assert not os.path.exists(stale)


@pytest.mark.parametrize('message', [
    # modern's eager save, then legacy's Saver in a Session (TensorFlow 2.21's words).
    '{{function_node __wrapped__SaveV2_dtypes_23_device_/job:localhost/replica:0/task:0/device:'
    'CPU:0}} %s/model.ckpt-30_temp/part-00000-of-00001.data-00000-of-00001.tempstate1; '
    'No space left on device [Op:SaveV2]',
    "Graph execution error:\n\nDetected at node 'save/SaveV2' defined at (most recent call "
    'last):\n    File "cli.py", line 9, in <module>\nNode: \'save/SaveV2\'\n'
    '%s/model.ckpt-30.data-00000-of-00001.tempstate1; No space left on device\n\t '
    '[[{{node save/SaveV2}}]]',
], ids=['eager', 'graph'])
def test_convert_on_a_full_disk_is_one_line_naming_to_dir(legacy_dir, tmp_path, monkeypatch,
                                                          message):
  def full_disk(staging, *unused_args):
    _full_disk(os.path.join(staging, 'model.ckpt-30.index'))

  def writer(staging, *args):
    try:
      full_disk(staging, *args)
    except OSError as e:
      raise tf.errors.ResourceExhaustedError(None, None, message % staging) from e

  monkeypatch.setattr(convert, 'write_modern', writer)
  to_dir = str(tmp_path / 'C')
  result = _convert(legacy_dir, to_dir)
  assert result.exit_code == 1, result.output
  assert result.output.splitlines()[1:] == [
      f'Error: could not write the converted checkpoint in {to_dir} ({FULL}). Free space on that '
      'disk, or pass another --to_dir.']
  assert os.listdir(tmp_path) == []


def test_convert_into_a_to_dir_written_meanwhile_says_it_is_not_empty(legacy_dir, tmp_path,
                                                                    monkeypatch):
  to_dir = tmp_path / 'C'
  real_writer = convert.write_modern

  def writer(staging, *args):
    to_dir.mkdir()  # another command writes there while this one converts
    (to_dir / 'theirs').write_bytes(b'keep me')
    return real_writer(staging, *args)

  monkeypatch.setattr(convert, 'write_modern', writer)
  result = _convert(legacy_dir, str(to_dir))
  assert result.exit_code == 1, result.output
  assert result.output.splitlines()[1:] == [
      f'Error: {to_dir} is not empty; pass a new or empty directory as --to_dir (nothing there '
      'was changed).']
  assert os.listdir(tmp_path) == ['C']
  assert os.listdir(to_dir) == ['theirs']


# --- a train_dir the run made and left empty; a download that was not kept ------

def test_a_run_that_wrote_nothing_leaves_no_new_train_dir(tmp_path):
  new = tmp_path / 'new'
  with pytest.raises(KeyboardInterrupt), lock.exclusive(str(new)):
    raise KeyboardInterrupt  # stopped before the first step
  assert not new.exists()
  existing = tmp_path / 'existing'
  existing.mkdir()
  with lock.exclusive(str(existing)):
    pass
  assert existing.is_dir()  # not the run's to remove
  written = tmp_path / 'written'
  with lock.exclusive(str(written)):
    (written / 'model.ckpt-1.index').write_bytes(b'')
  assert os.listdir(written) == ['model.ckpt-1.index']


def test_a_corrupt_download_says_nothing_was_kept(tmp_path):
  bad = tmp_path / 'bad.tar.gz'
  bad.write_bytes(b'not the archive')
  data_dir = tmp_path / 'data'
  with pytest.raises(download.DownloadError) as raised:
    download.maybe_download_and_extract(str(data_dir), url=bad.as_uri())
  assert str(raised.value).endswith(
      f'and was not unpacked. Put a good copy at {data_dir}/cifar-10-binary.tar.gz (the '
      'download was not kept) or check the URL, and run this again.')
  assert not data_dir.exists()
