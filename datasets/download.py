"""Downloads, verifies and safely unpacks the CIFAR-10 binary archive (docs/equivalence.md §1).

Upstream's `maybe_download_and_extract` trusted the network and the archive:
it did not check a digest and let `tarfile.extractall` write wherever the
member names pointed. This version
- verifies the SHA-256 of the archive before unpacking it;
- checks every member before writing anything (tarfile's 'data' filter, and
  two checks it lacks), and refuses absolute paths, paths that escape through
  '..' or lie below an in-archive link, links that point outside the archive's
  directory, and device files; then unpacks only the regular files of
  `cifar-10-batches-bin/`;
- unpacks into a staging directory inside `data_dir` that replaces
  `cifar-10-batches-bin/` whole (`cifar10_format.staged_batches_dir`), so a
  failure at any point leaves `data_dir` as it was.
"""

import hashlib
import http.client
import os
import posixpath
import tarfile
import urllib.error
import urllib.request

from cifar10_towers.common import cifar10_format as fmt
from cifar10_towers.common import errors
from cifar10_towers.common import prog
from cifar10_towers.datasets import generated

DATA_URL = 'https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz'
ARCHIVE_NAME = 'cifar-10-binary.tar.gz'  # also the name of a local copy in data_dir
ARCHIVE_BYTES = 170052171
ARCHIVE_MD5 = 'c32a1d4ab5d03f1284b67883e8d87530'  # published on the data set's page
ARCHIVE_SHA256 = 'c4a38c50a1bc5f3a1c5537f2155ab9d68f9f25eb1ed8d9ddda3db29a59bca1dd'
# Room a download needs in data_dir: the archive, kept, and the 60,000
# records it unpacks to.
NEEDED_BYTES = ARCHIVE_BYTES + 60000 * fmt.RECORD_BYTES

# What maybe_download_and_extract did.
PRESENT = 'present'  # the data files were there already; nothing was done
DOWNLOADED = 'downloaded'  # fetched from the URL, verified, unpacked
LOCAL_ARCHIVE = 'local_archive'  # unpacked <data_dir>/cifar-10-binary.tar.gz

_CHUNK_BYTES = 1 << 20


class DownloadError(errors.Failure):
  """The archive could not be fetched, verified or safely unpacked; says what to do."""


def archive_path(data_dir):
  """`<data_dir>/cifar-10-binary.tar.gz`, where a local copy of the archive goes."""
  return os.path.join(data_dir, ARCHIVE_NAME)


def is_present(data_dir):
  """True when `<data_dir>/cifar-10-batches-bin` holds all six .bin files."""
  return not _missing(fmt.batches_dir(data_dir))


def _missing(directory):
  """The names of the six .bin files that are not regular files in `directory`."""
  return [n for n in fmt.DATA_FILES if not os.path.isfile(os.path.join(directory, n))]


def _fetch(url, path, data_dir, progress, timeout):
  """Streams `url` into the new file `path`.

  Raises:
    DownloadError: the URL could not be reached.
    OSError: the disk is full, read-only or not writable.
  """
  done, chunk = 0, None
  try:
    with open(path, 'wb') as out, urllib.request.urlopen(url, timeout=timeout) as response:
      total = int(response.headers.get('Content-Length') or 0) or None
      while chunk != b'':
        if progress:
          progress(done, total)
        chunk = response.read(_CHUNK_BYTES)
        done += out.write(chunk)
  except (OSError, ValueError, http.client.HTTPException) as e:
    if fmt.write_failure(data_dir, e, NEEDED_BYTES):
      raise  # the disk's fault, not the network's: said by staged_batches_dir
    # ValueError: not a URL urllib understands; OSError: e.g. an SSL error mid-stream.
    # (A transfer that breaks off without an error fails the digest check.)
    reason = e if isinstance(e, urllib.error.HTTPError) else getattr(e, 'reason', None) or e
    raise DownloadError(
        f'could not reach {url} ({reason}). Without network access, run '
        f"`{prog.command('data synth', data_dir=data_dir)}` for generated data, or copy "
        f'{ARCHIVE_NAME} ({ARCHIVE_BYTES} bytes, SHA-256 {ARCHIVE_SHA256}) to '
        f'{archive_path(data_dir)} and run this again.') from e


def check_members(tar, directory):
  """Checks every member of an open archive before anything is written.

  tarfile's 'data' filter judges each member; it strips a leading '/' rather
  than refuse it, and lets a member through an in-archive symbolic link
  (test_download.py: test_unsafe_archive_refused_before_writing_anything), so
  those two are refused here.

  Args:
    tar: an open `tarfile.TarFile`.
    directory: where the members are to be unpacked.

  Returns:
    the list of members, all safe to extract into `directory`.

  Raises:
    DownloadError: naming the first member that has an absolute path, escapes
      through '..', lies below a symbolic link, is a link pointing outside, or
      is a device or FIFO.
  """
  members = tar.getmembers()
  links = tuple(f'{posixpath.normpath(m.name)}/' for m in members if m.issym())
  for m in members:
    try:
      if m.name.startswith('/') or posixpath.normpath(m.name).startswith(links):
        raise tarfile.FilterError(f'{m.name!r} has an absolute path or lies below a symbolic '
                                  'link')
      tarfile.data_filter(m, directory)
    except tarfile.FilterError as e:
      # It passed the digest check only if another URL and digest were given.
      raise DownloadError(f'refusing to unpack: archive member {e}; nothing was written. This '
                          f'is not the CIFAR-10 archive: fetch it from {DATA_URL} instead (unset '
                          'CIFAR10_DATA_URL).') from e
  return members


def _extract(archive, stage, origin):
  """Safely unpacks the files of `cifar-10-batches-bin/` in `archive` into `stage`.

  Args:
    archive: path of a verified archive.
    stage: the staging directory of `cifar10_format.staged_batches_dir`.
    origin: what to call the archive in errors.
  """
  try:
    with tarfile.open(archive, 'r:*') as tar:
      # Only the regular files of cifar-10-batches-bin/, each under its own name.
      files = [m.replace(name=posixpath.basename(m.name)) for m in check_members(tar, stage)
               if m.isfile() and posixpath.dirname(posixpath.normpath(m.name)) == fmt.BATCHES_DIR]
      tar.extractall(stage, members=files, filter='data')
  except (tarfile.TarError, EOFError, OSError) as e:
    if fmt.write_failure(stage, e, NEEDED_BYTES):
      raise  # the disk's fault, not the archive's: said by staged_batches_dir
    raise DownloadError(f'{origin} is not a readable tar.gz archive ({e}); it is not '
                        'the CIFAR-10 binary archive.') from e
  missing = _missing(stage)
  if missing:
    raise DownloadError(f'{origin} does not contain {fmt.BATCHES_DIR}/{missing[0]} '
                        f'({len(missing)} of the 6 data files are missing); it is not the '
                        'CIFAR-10 binary archive.')


def maybe_download_and_extract(data_dir, url=DATA_URL, sha256=ARCHIVE_SHA256,
                               progress=None, timeout=30):
  """Makes sure `<data_dir>/cifar-10-batches-bin` holds the CIFAR-10 files.

  Does nothing when all six .bin files are there and are not generated data
  (`datasets.generated`); refuses when generated data is there. Otherwise uses
  `<data_dir>/cifar-10-binary.tar.gz` if it exists, else downloads `url` (http,
  https or file) to it through a staging directory; verifies the SHA-256 either way,
  then unpacks safely (see the module docstring). The verified archive is kept,
  as upstream kept it, so it is not fetched again.

  Args:
    data_dir: str, the data directory (created if missing).
    url: str, where to fetch the archive.
    sha256: str, expected hex SHA-256 of the archive.
    progress: optional callable(bytes_done, bytes_total) called as the download
      proceeds; bytes_total is None when the server does not say.
    timeout: float, seconds to wait for the server before giving up.

  Returns:
    PRESENT, LOCAL_ARCHIVE or DOWNLOADED: what was done.

  Raises:
    DownloadError: data_dir holds generated data, the URL could not be
      reached, the digest does not match, or the archive is unsafe or not
      CIFAR-10; data_dir is left as it was.
    common.cifar10_format.DataError: data_dir is full, read-only or not
      writable, or cifar-10-batches-bin is a file; nothing was changed.
  """
  marker = generated.read(data_dir)
  if marker:
    # Not PRESENT: that would call it CIFAR-10. Nor unpack over it: the
    # result would mix the two sets and keep the marker.
    raise DownloadError(
        f"{data_dir} holds {marker['what']}, not CIFAR-10; nothing was downloaded. To get "
        f'CIFAR-10 there, remove {fmt.batches_dir(data_dir)} and run this again, or pass another '
        '--data_dir.')
  if is_present(data_dir):
    return PRESENT
  archive = archive_path(data_dir)
  local = os.path.isfile(archive)
  origin = f'the local archive {archive}' if local else f'the file downloaded from {url}'
  # The new files go into a staging directory that replaces
  # cifar-10-batches-bin/ only when they are all there, verified.
  with fmt.staged_batches_dir(data_dir, NEEDED_BYTES) as stage:
    source = archive if local else os.path.join(stage, ARCHIVE_NAME)
    if not local:
      _fetch(url, source, data_dir, progress, timeout)
    with open(source, 'rb') as f:
      actual = hashlib.file_digest(f, 'sha256').hexdigest()
    if actual != sha256:
      # A download is not kept: there is nothing to delete, and the URL may be at fault.
      fix = ('(or delete the one there)' if local
             else '(the download was not kept) or check the URL,')
      raise DownloadError(
          f'{origin} has SHA-256 {actual}, expected {sha256}: it is corrupt or not the CIFAR-10 '
          f'binary archive, and was not unpacked. Put a good copy at {archive} {fix} and run '
          'this again.')
    _extract(source, stage, origin)
    os.replace(source, archive)  # kept, verified (a no-op for the local one)
  return LOCAL_ARCHIVE if local else DOWNLOADED
