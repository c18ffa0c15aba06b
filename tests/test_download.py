"""The download: served locally (file:// and http://127.0.0.1), never the real URL."""

import functools
import hashlib
import http.server
import io
import os
import socket
import tarfile
import threading

import numpy as np
import pytest

from cifar10_towers.common import cifar10_format as fmt
from cifar10_towers.datasets import download
from cifar10_towers.datasets import synth

DATA_NAMES = fmt.TRAIN_FILES + fmt.EVAL_FILES


@pytest.fixture(scope='module')
def source(tmp_path_factory):
  """A small generated data set to pack: its directory and its decoded files."""
  data_dir = str(tmp_path_factory.mktemp('source'))
  # Unmarked, as the archive's files are: it stands in for CIFAR-10's.
  synth.generate(data_dir, train_per_file=4, num_test=6, seed=5, mark=False)
  files = {}
  for name in os.listdir(fmt.batches_dir(data_dir)):
    with open(os.path.join(fmt.batches_dir(data_dir), name), 'rb') as f:
      files[name] = f.read()
  return files


def _make_archive(path, files, extra=()):
  """Writes a tar.gz holding `cifar-10-batches-bin/<name>` for `files`, then `extra`.

  Args:
    path: where to write.
    files: dict name -> bytes.
    extra: (TarInfo, bytes or None) pairs added after the data files.

  Returns:
    hex SHA-256 of the archive.
  """
  with tarfile.open(path, 'w:gz') as tar:
    info = tarfile.TarInfo(fmt.BATCHES_DIR)
    info.type = tarfile.DIRTYPE
    info.mode = 0o755
    tar.addfile(info)
    for name, data in sorted(files.items()):
      info = tarfile.TarInfo('%s/%s' % (fmt.BATCHES_DIR, name))
      info.size = len(data)
      tar.addfile(info, io.BytesIO(data))
    for info, data in extra:
      if data is not None:
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
      else:
        tar.addfile(info)
  with open(path, 'rb') as f:
    return hashlib.sha256(f.read()).hexdigest()


def _snapshot(root):
  """Everything under `root`: relative path -> bytes, link target or 'dir'."""
  if not os.path.exists(root):
    return None
  tree = {}
  for dirpath, dirnames, filenames in os.walk(root):
    for name in dirnames + filenames:
      path = os.path.join(dirpath, name)
      rel = os.path.relpath(path, root)
      if os.path.islink(path):
        tree[rel] = 'link -> ' + os.readlink(path)
      elif os.path.isdir(path):
        tree[rel] = 'dir'
      else:
        with open(path, 'rb') as f:
          tree[rel] = f.read()
  return tree


def _closed_port():
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


class _Handler(http.server.SimpleHTTPRequestHandler):
  requests = None  # set per server: a list the handler appends paths to

  def do_GET(self):  # pylint: disable=invalid-name
    self.requests.append(self.path)
    super().do_GET()

  def log_message(self, *args):  # keep test output quiet
    pass


@pytest.fixture
def server(tmp_path):
  """Serves tmp_path/'www' on 127.0.0.1; yields (base URL, directory, requests)."""
  root = tmp_path / 'www'
  root.mkdir()
  requests = []
  handler = type('Handler', (_Handler,), {'requests': requests})
  httpd = http.server.ThreadingHTTPServer(
      ('127.0.0.1', 0), functools.partial(handler, directory=str(root)))
  thread = threading.Thread(target=httpd.serve_forever,
                            kwargs={'poll_interval': 0.05}, daemon=True)
  thread.start()
  try:
    yield 'http://127.0.0.1:%d' % httpd.server_address[1], root, requests
  finally:
    httpd.shutdown()
    httpd.server_close()
    thread.join(5)


def _assert_extracted(data_dir, files):
  for name, data in files.items():
    with open(os.path.join(fmt.batches_dir(data_dir), name), 'rb') as f:
      assert f.read() == data, name
  problems, counts = fmt.check_data_dir(data_dir)
  assert problems == []
  assert counts == {n: 4 for n in fmt.TRAIN_FILES} | {'test_batch.bin': 6}
  images, labels = fmt.read_records(fmt.eval_files(data_dir)[0])
  assert images.shape == (6, 32, 32, 3) and set(labels) <= set(range(10))


def test_constants_match_spec():
  assert download.DATA_URL == (
      'https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz')
  assert download.ARCHIVE_BYTES == 170052171
  assert download.ARCHIVE_MD5 == 'c32a1d4ab5d03f1284b67883e8d87530'
  assert download.ARCHIVE_SHA256 == (
      'c4a38c50a1bc5f3a1c5537f2155ab9d68f9f25eb1ed8d9ddda3db29a59bca1dd')


def test_file_url_verified_and_extracted(tmp_path, source):
  archive = tmp_path / 'served.tar.gz'
  digest = _make_archive(str(archive), source)
  data_dir = str(tmp_path / 'data')
  calls = []
  result = download.maybe_download_and_extract(
      data_dir, url=archive.as_uri(), sha256=digest,
      progress=lambda done, total: calls.append((done, total)))
  assert result == download.DOWNLOADED
  _assert_extracted(data_dir, source)
  size = archive.stat().st_size
  assert calls[0] == (0, size) and calls[-1] == (size, size)
  # The verified archive is kept; no temp files or directories are left.
  assert sorted(os.listdir(data_dir)) == [fmt.BATCHES_DIR, download.ARCHIVE_NAME]
  assert (tmp_path / 'data' / download.ARCHIVE_NAME).read_bytes() == (
      archive.read_bytes())
  assert sorted(os.listdir(fmt.batches_dir(data_dir))) == sorted(source)


def test_http_url_verified_and_extracted(tmp_path, source, server):
  base, root, requests = server
  digest = _make_archive(str(root / 'c10.tar.gz'), source)
  data_dir = str(tmp_path / 'data')
  calls = []
  result = download.maybe_download_and_extract(
      data_dir, url=base + '/c10.tar.gz', sha256=digest,
      progress=lambda done, total: calls.append((done, total)))
  assert result == download.DOWNLOADED
  assert requests == ['/c10.tar.gz']
  _assert_extracted(data_dir, source)
  size = (root / 'c10.tar.gz').stat().st_size
  assert calls[-1] == (size, size)
  # A second call finds the data and does not download again.
  assert download.maybe_download_and_extract(
      data_dir, url=base + '/c10.tar.gz', sha256=digest) == download.PRESENT
  assert requests == ['/c10.tar.gz']


def test_present_data_means_no_download(tmp_path, source, server):
  base, _, requests = server
  data_dir = str(tmp_path / 'data')
  synth.generate(data_dir, train_per_file=2, num_test=2, mark=False)
  before = _snapshot(data_dir)
  result = download.maybe_download_and_extract(
      data_dir, url=base + '/missing.tar.gz', sha256='0' * 64)
  assert result == download.PRESENT
  assert requests == []
  assert _snapshot(data_dir) == before
  assert download.is_present(data_dir)


@pytest.mark.parametrize('whole', [True, False], ids=['whole', 'partial'])
def test_generated_data_is_not_present_cifar10(tmp_path, source, server, whole):
  """Marked generated data is neither reported as CIFAR-10 nor unpacked over."""
  base, _, requests = server
  data_dir = str(tmp_path / 'data')
  synth.generate(data_dir, train_per_file=2, num_test=2, seed=4)
  if not whole:  # a download would fill the gap, mixing the two sets
    os.remove(os.path.join(fmt.batches_dir(data_dir), 'data_batch_3.bin'))
  before = _snapshot(data_dir)
  with pytest.raises(download.DownloadError) as e:
    download.maybe_download_and_extract(data_dir, url=base + '/c10.tar.gz',
                                        sha256='0' * 64)
  assert str(e.value) == (
      '%s holds generated data (synth), not CIFAR-10; nothing was downloaded. '
      'To get CIFAR-10 there, remove %s and run this again, or pass another '
      '--data_dir.' % (data_dir, fmt.batches_dir(data_dir)))
  assert requests == []
  assert _snapshot(data_dir) == before


def test_wrong_sha256_refused_and_data_dir_unchanged(tmp_path, source, server):
  base, root, _ = server
  digest = _make_archive(str(root / 'c10.tar.gz'), source)
  data_dir = tmp_path / 'data'
  batches = data_dir / fmt.BATCHES_DIR
  batches.mkdir(parents=True)
  (batches / 'data_batch_1.bin').write_bytes(b'old')  # a partial old set
  (data_dir / 'notes.txt').write_text('mine')
  before = _snapshot(str(data_dir))
  wrong = hashlib.sha256(b'something else').hexdigest()
  with pytest.raises(download.DownloadError) as e:
    download.maybe_download_and_extract(
        str(data_dir), url=base + '/c10.tar.gz', sha256=wrong)
  msg = str(e.value)
  assert digest in msg and wrong in msg
  assert 'run this again' in msg
  assert _snapshot(str(data_dir)) == before  # temp file removed, nothing new


def test_local_archive_used_instead_of_network(tmp_path, source):
  data_dir = tmp_path / 'data'
  data_dir.mkdir()
  digest = _make_archive(str(data_dir / download.ARCHIVE_NAME), source)
  result = download.maybe_download_and_extract(
      str(data_dir), url='http://127.0.0.1:%d/x.tar.gz' % _closed_port(),
      sha256=digest, timeout=5)
  assert result == download.LOCAL_ARCHIVE
  _assert_extracted(str(data_dir), source)


def test_bad_local_archive_refused_and_kept(tmp_path, source):
  data_dir = tmp_path / 'data'
  data_dir.mkdir()
  digest = _make_archive(str(data_dir / download.ARCHIVE_NAME), source)
  before = _snapshot(str(data_dir))
  with pytest.raises(download.DownloadError) as e:
    download.maybe_download_and_extract(str(data_dir), sha256='ab' * 32)
  assert digest in str(e.value) and 'ab' * 32 in str(e.value)
  assert str(data_dir / download.ARCHIVE_NAME) in str(e.value)
  assert _snapshot(str(data_dir)) == before


def test_download_fills_a_partial_directory_and_keeps_other_files(
    tmp_path, source):
  archive = tmp_path / 'served.tar.gz'
  digest = _make_archive(str(archive), source)
  data_dir = tmp_path / 'data'
  batches = data_dir / fmt.BATCHES_DIR
  batches.mkdir(parents=True)
  (batches / 'data_batch_1.bin').write_bytes(b'stale')
  (batches / 'README').write_text('mine')
  download.maybe_download_and_extract(
      str(data_dir), url=archive.as_uri(), sha256=digest)
  _assert_extracted(str(data_dir), source)
  assert (batches / 'README').read_text() == 'mine'


def _member(name, kind, target=None):
  info = tarfile.TarInfo(name)
  if kind == 'file':
    return info, b'evil'
  if kind == 'symlink':
    info.type = tarfile.SYMTYPE
  elif kind == 'hardlink':
    info.type = tarfile.LNKTYPE
  elif kind == 'chr':
    info.type = tarfile.CHRTYPE
    info.devmajor, info.devminor = 1, 3
  info.linkname = target or ''
  return info, None


def _unsafe_cases(outside):
  return {
      'dotdot': [_member('cifar-10-batches-bin/../../evil', 'file')],
      'absolute': [_member(os.path.join(outside, 'evil_abs'), 'file')],
      'symlink_out': [_member('cifar-10-batches-bin/escape', 'symlink',
                              '../../outside')],
      'symlink_absolute': [_member('cifar-10-batches-bin/escape', 'symlink',
                                   outside)],
      'through_symlink': [
          _member('cifar-10-batches-bin/inner', 'symlink', '.'),
          _member('cifar-10-batches-bin/inner/x', 'file')],
      'hardlink_out': [_member('cifar-10-batches-bin/hard', 'hardlink',
                               '../outside/victim')],
      'device': [_member('cifar-10-batches-bin/null', 'chr')],
  }


@pytest.mark.parametrize('case', sorted(_unsafe_cases('/x')))
def test_unsafe_archive_refused_before_writing_anything(tmp_path, source, case):
  outside = tmp_path / 'outside'
  outside.mkdir()
  (outside / 'victim').write_text('keep me')
  extra = _unsafe_cases(str(outside))[case]
  evil_name = extra[-1][0].name
  archive = tmp_path / 'www' / 'evil.tar.gz'
  archive.parent.mkdir()
  # The data files come first and the unsafe member last, so an extractor
  # that checks while it writes would already have written the data.
  digest = _make_archive(str(archive), source, extra)
  with tarfile.open(str(archive)) as tar:  # the archive holds what we meant
    assert tar.getnames()[-1] == evil_name
  data_dir = tmp_path / 'data'
  data_dir.mkdir()
  (data_dir / 'notes.txt').write_text('mine')
  before = _snapshot(str(tmp_path))
  with pytest.raises(download.DownloadError) as e:
    download.maybe_download_and_extract(
        str(data_dir), url=archive.as_uri(), sha256=digest)
  msg = str(e.value)
  assert 'refusing to unpack' in msg
  assert repr(evil_name) in msg
  assert _snapshot(str(tmp_path)) == before


def test_unsafe_archive_into_new_data_dir_leaves_nothing(tmp_path, source):
  archive = tmp_path / 'evil.tar.gz'
  digest = _make_archive(str(archive), source,
                         [_member('../escaped', 'file')])
  data_dir = tmp_path / 'new' / 'data'
  with pytest.raises(download.DownloadError, match="'../escaped'"):
    download.maybe_download_and_extract(
        str(data_dir), url=archive.as_uri(), sha256=digest)
  assert not (tmp_path / 'new').exists()  # the directories made are removed
  assert sorted(os.listdir(str(tmp_path))) == ['evil.tar.gz']


def test_archive_without_cifar_files_refused(tmp_path, source):
  archive = tmp_path / 'other.tar.gz'
  partial = {n: d for n, d in source.items() if n != 'test_batch.bin'}
  digest = _make_archive(str(archive), partial)
  data_dir = tmp_path / 'data'
  data_dir.mkdir()
  with pytest.raises(download.DownloadError) as e:
    download.maybe_download_and_extract(
        str(data_dir), url=archive.as_uri(), sha256=digest)
  assert 'test_batch.bin' in str(e.value) and '1 of the 6' in str(e.value)
  assert archive.as_uri() in str(e.value)
  assert os.listdir(str(data_dir)) == []


def test_unreachable_url_says_what_to_do(tmp_path):
  url = 'http://127.0.0.1:%d/cifar-10-binary.tar.gz' % _closed_port()
  data_dir = tmp_path / 'data'
  with pytest.raises(download.DownloadError) as e:
    download.maybe_download_and_extract(str(data_dir), url=url, timeout=5)
  msg = str(e.value)
  assert 'could not reach %s' % url in msg
  assert 'python cli.py data synth --data_dir %s' % data_dir in msg
  assert os.path.join(str(data_dir), 'cifar-10-binary.tar.gz') in msg
  assert not data_dir.exists()  # created for the temp file, then removed


def test_http_404_reported(tmp_path, server):
  base, _, requests = server
  data_dir = tmp_path / 'data'
  data_dir.mkdir()
  with pytest.raises(download.DownloadError, match='HTTP Error 404'):
    download.maybe_download_and_extract(str(data_dir), url=base + '/nope.tar.gz')
  assert requests == ['/nope.tar.gz']
  assert os.listdir(str(data_dir)) == []


def test_missing_file_url_reported(tmp_path):
  url = (tmp_path / 'nowhere.tar.gz').as_uri()
  with pytest.raises(download.DownloadError, match='could not reach'):
    download.maybe_download_and_extract(str(tmp_path / 'data'), url=url)


def test_check_members_accepts_links_inside(tmp_path, source):
  archive = tmp_path / 'ok.tar.gz'
  _make_archive(str(archive), source, [
      _member('cifar-10-batches-bin/latest', 'symlink', 'test_batch.bin'),
      _member('cifar-10-batches-bin/copy', 'hardlink',
              'cifar-10-batches-bin/test_batch.bin')])
  with tarfile.open(str(archive)) as tar:
    members = download.check_members(tar, str(tmp_path / 'unpack'))
  assert len(members) == 1 + len(source) + 2
  assert np.all([m.name.startswith(fmt.BATCHES_DIR) for m in members])


def test_not_a_tar_archive_refused(tmp_path):
  archive = tmp_path / 'junk.tar.gz'
  archive.write_bytes(b'not a tar file at all' * 100)
  digest = hashlib.sha256(archive.read_bytes()).hexdigest()
  data_dir = tmp_path / 'data'
  data_dir.mkdir()
  with pytest.raises(download.DownloadError, match='not a readable tar.gz'):
    download.maybe_download_and_extract(
        str(data_dir), url=archive.as_uri(), sha256=digest)
  assert os.listdir(str(data_dir)) == []


def test_interrupted_download_leaves_no_temp_file(tmp_path, source):
  archive = tmp_path / 'served.tar.gz'
  digest = _make_archive(str(archive), source)
  data_dir = tmp_path / 'data'
  data_dir.mkdir()

  def interrupt(done, total):  # pylint: disable=unused-argument
    if done:
      raise KeyboardInterrupt

  with pytest.raises(KeyboardInterrupt):
    download.maybe_download_and_extract(
        str(data_dir), url=archive.as_uri(), sha256=digest, progress=interrupt)
  assert os.listdir(str(data_dir)) == []
