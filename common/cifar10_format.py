"""The CIFAR-10 binary format: one label byte, then 3072 image bytes.

The image bytes are depth-major: 1024 red, 1024 green, 1024 blue values, each
plane row-major 32x32. No TensorFlow here: these are the numpy reader, writer
and validator used by the data commands, the tests and the cross-check.

Besides the format, the validator names content that cannot be real data
(`_judge`; a problem for `data check`, a warning for
training): a file of at least `MIN_RECORDS_TO_JUDGE` records whose images are
all the same image (an all-zero file, say), or whose records all have one
label (CIFAR-10's files mix all ten classes), and a file that is a
byte-for-byte copy of another. These are certain and cheap: real data passes
on the first two images and a sample of bytes; the worst case, six all-zero
files of CIFAR-10's size, costs one comparison per byte (about 0.15 s).

Writers replace a whole data set at once (`staged_batches_dir`): the files go
into a hidden staging directory that is swapped in when every file is
written, so an interrupted or failed write never leaves a mix of old and new
files, or a partial file, in `cifar-10-batches-bin/`.
"""

import contextlib
import errno
import hashlib
import logging
import os
import pathlib
import shutil

import numpy as np

from cifar10_towers.common import errors
from cifar10_towers.common import files
from cifar10_towers.common import hparams
from cifar10_towers.common import prog

logger = logging.getLogger(__name__)

BATCHES_DIR = 'cifar-10-batches-bin'  # what the archive unpacks to
TRAIN_FILES = tuple(f'data_batch_{i}.bin' for i in range(1, 6))
EVAL_FILES = ('test_batch.bin',)
DATA_FILES = TRAIN_FILES + EVAL_FILES  # the six .bin files of a data set
META_FILE = 'batches.meta.txt'
# Written with a generated data set (datasets.generated); never in CIFAR-10's.
GENERATED_FILE = 'GENERATED.json'

LABEL_BYTES = 1
HEIGHT = 32
WIDTH = 32
DEPTH = 3
IMAGE_BYTES = HEIGHT * WIDTH * DEPTH  # 3072
RECORD_BYTES = LABEL_BYTES + IMAGE_BYTES  # 3073


# Files with fewer records are not judged by content: a tiny hand-made file
# may well hold one class or repeat one image; from 10 records on, one label
# in a file mixing ten classes has a chance of 1e-9, ten equal photographs none.
MIN_RECORDS_TO_JUDGE = 10

_STAGING_PREFIX = f'.{BATCHES_DIR}.partial-'  # a files.scratch


class DataError(errors.Failure):
  """A data file or directory is missing or malformed; the message says which and how."""


def batches_dir(data_dir):
  """`<data_dir>/cifar-10-batches-bin`."""
  return os.path.join(data_dir, BATCHES_DIR)


def encode_records(images, labels):
  """Serializes images and labels to CIFAR-10 binary records.

  Args:
    images: uint8 array [N, 32, 32, 3] (height, width, channel).
    labels: integer array [N] with values in 0..9.

  Returns:
    bytes of length N * 3073.
  """
  return np.concatenate([np.asarray(labels, np.uint8)[:, None],
                         np.asarray(images).transpose(0, 3, 1, 2).reshape(-1, IMAGE_BYTES)],
                        1).tobytes()


def write_records(path, images, labels):
  """Writes a CIFAR-10 binary file.

  Data sets are written into a staging directory that replaces theirs whole
  (`staged_batches_dir`), so no reader ever sees a partial file.
  """
  pathlib.Path(path).write_bytes(encode_records(images, labels))


def read_records(path):
  """Reads, parses and validates one CIFAR-10 binary file.

  Args:
    path: str, the file.

  Returns:
    (images uint8 [N, 32, 32, 3], labels int32 [N]).

  Raises:
    DataError: the size is not a multiple of 3073 bytes, or a label is not 0..9.
  """
  records = _records(path)[1]
  images = records[:, 1:].reshape(-1, DEPTH, HEIGHT, WIDTH).transpose(0, 2, 3, 1)
  return images, records[:, 0].astype(np.int32)


def _records(path):
  """(the file's bytes, its records as uint8 [N, 3073]), validated as `read_records` says."""
  data = pathlib.Path(path).read_bytes()
  n, rest = divmod(len(data), RECORD_BYTES)
  records = np.frombuffer(data[:n * RECORD_BYTES], np.uint8).reshape(-1, RECORD_BYTES)
  bad = np.flatnonzero(records[:, 0] >= hparams.NUM_CLASSES)
  if rest:
    why = (f'size {len(data)} bytes is not a multiple of the {RECORD_BYTES}-byte record; '
           f'record {n} is truncated at byte offset {n * RECORD_BYTES}')
  elif bad.size:
    why = (f'record {bad[0]} (byte offset {bad[0] * RECORD_BYTES}) has label byte '
           f'{records[bad[0], 0]}, outside 0..{hparams.NUM_CLASSES - 1}; {bad.size} record(s) '
           'are bad')
  else:
    return data, records
  raise DataError(f'{path}: {why}. Re-download or regenerate the data.')


def _judge(path, seen):
  """Reads and validates the file at `path`; why it cannot be real data.

  Certain signs only, judged on files of at least MIN_RECORDS_TO_JUDGE
  records: every image is the same image; every record has the same label;
  from the second file on, the file is a byte-for-byte copy of one judged
  before (a test file copied from a training file, a training file copied to
  fill a gap). `seen` keeps only a fingerprint of each file (its size and a
  digest of every 4099th byte); a match is confirmed by comparing the whole
  files.

  Args:
    path: the file.
    seen: dict fingerprint -> path, shared by the files of one data set.

  Returns:
    (number of records, a list of phrases, [] if it can be real), e.g.
    (10000, ['all 10000 images are the same image (every byte 0)']).

  Raises:
    DataError: the file is malformed (see `read_records`).
    OSError: it (or the file it matches) cannot be read.
  """
  data, records = _records(path)
  n, problems = len(records), []
  if n < MIN_RECORDS_TO_JUDGE:
    return n, problems
  images, labels = records[:, 1:], records[:, 0]
  # The first two images differ in almost every real file: a cheap early out.
  if np.array_equal(images[0], images[1]) and (images == images[0]).all():
    low, high = images[0].min(), images[0].max()
    same = f' (every byte {low})' if low == high else ''
    problems.append(f'all {n} images are the same image{same}')
  if (labels == labels[0]).all():
    problems.append(f'all {n} records have label {labels[0]}')
  original = seen.setdefault((len(data), hashlib.blake2b(data[::4099]).digest()), path)
  if original != path and pathlib.Path(original).read_bytes() == data:
    problems.append(f'a byte-for-byte copy of {os.path.basename(original)}')
  return n, problems


def _files(data_dir, names, what):
  paths = [os.path.join(batches_dir(data_dir), n) for n in names]
  missing = [p for p in paths if not os.path.isfile(p)]  # a directory there is no file either
  if missing:
    raise DataError(
        f'missing {what} data file {missing[0]} ({len(missing)} of {len(paths)} missing). Run '
        f"`{prog.command('data download', data_dir=data_dir)}` for CIFAR-10, or "
        f"`{prog.command('data synth', data_dir=data_dir)}` for generated data.")
  return paths


def train_files(data_dir):
  """Paths of the five training files; DataError naming the first missing one."""
  return _files(data_dir, TRAIN_FILES, 'training')


def eval_files(data_dir):
  """Path of the test file, in a list; DataError if it is missing."""
  return _files(data_dir, EVAL_FILES, 'test')


def num_examples(paths):
  """Number of records in the files, from their sizes.

  Raises:
    DataError: a file is empty or its size is not a multiple of 3073 bytes.
  """
  sizes = {path: os.path.getsize(path) for path in paths}
  for path, size in sizes.items():
    if size == 0 or size % RECORD_BYTES:
      raise DataError(
          f'{path}: size {size} bytes is not a positive multiple of the {RECORD_BYTES}-byte '
          f"record. Re-download or regenerate the data (`{prog.command('data check')}` lists "
          'every problem).')
  return sum(sizes.values()) // RECORD_BYTES


def checked_files(data_dir, train, then):
  """The training (or test) files of data_dir for a run, every record read and validated.

  A .bin file that training would silently ignore is refused; a file whose
  content cannot be real data (`_judge`) is a warning, ending with `then`,
  and the run goes on (`data check` reports the same as problems).

  Raises:
    DataError: a file is missing, unexpected or malformed (see `read_records`).
    OSError: a file cannot be read.
  """
  paths = train_files(data_dir) if train else eval_files(data_dir)
  if train and (extra := unexpected_files(data_dir)):
    raise DataError(f'{extra[0]} is not a CIFAR-10 data file, and training would silently '
                    f'ignore it ({len(extra)} unexpected .bin file(s)). Move it out of '
                    f"{batches_dir(data_dir)}; `{prog.command('data check')}` lists every "
                    'problem.')
  seen = {}
  for path in paths:
    if why := _judge(path, seen)[1]:
      logger.warning(f"Warning: {path} cannot be real data: {'; '.join(why)}; {then}")
  return paths


def unexpected_files(data_dir):
  """Paths of the .bin files in cifar-10-batches-bin/ that are not CIFAR-10's six."""
  d = batches_dir(data_dir)
  return [os.path.join(d, name) for name in sorted(os.listdir(d))
          if name.endswith('.bin') and name not in DATA_FILES]


def _problem(path, seen, counts):
  """The line saying what is wrong with the data file at `path`, or None (then it is counted)."""
  if not os.path.lexists(path):
    return f'{path}: missing'
  if not os.path.isfile(path):
    kind = 'a directory' if os.path.isdir(path) else 'a broken link or a special file'
    return f'{path}: {kind}, not a data file'
  try:
    n, why = _judge(path, seen)
  except DataError as e:
    return str(e)
  except OSError as e:
    return f'{path}: cannot be read ({e.strerror})'
  if why:
    return f"{path}: cannot be real data: {'; '.join(why)}"
  if not n:
    return f'{path}: empty'
  counts[os.path.basename(path)] = n


def check_data_dir(data_dir):
  """Every problem of a data directory, at once.

  Each file is validated (size, label bytes), then judged by content
  (`_judge`); every problem, a file that cannot be read included, is one
  line.

  Returns:
    (problems, counts): a list of one-line problem descriptions (empty when the
    directory is good) and a dict file name -> number of records of the files
    without a problem.
  """
  d = batches_dir(data_dir)
  if not os.path.isdir(d):
    why = 'a file, not a directory' if os.path.lexists(d) else 'directory not found'
    return [f'{d}: {why}'], {}
  try:
    extra = unexpected_files(data_dir)
  except OSError as e:
    return [f'{d}: cannot be listed ({e.strerror})'], {}
  counts, seen = {}, {}
  problems = [_problem(os.path.join(d, name), seen, counts) for name in DATA_FILES]
  return [p for p in problems if p] + [
      f"{path}: unexpected data file (expected only {', '.join(DATA_FILES)})"
      for path in extra], counts


def write_failure(directory, error, needed_bytes):
  """A one-line message for an error raised writing data into `directory`.

  Args:
    directory: str, where the data was being written.
    error: the exception.
    needed_bytes: int, the size of the new files, named when the disk is full.

  Returns:
    str saying what happened and what to do, or None when `error` is not the
    OSError of a full or read-only disk or a denied write (the caller
    re-raises it).
  """
  code = getattr(error, 'errno', None)  # None: not an OSError
  if code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
    return (f'cannot write to {directory}: {error.strerror} (about {-(-needed_bytes // 2**20)} '
            'MiB are needed); nothing was changed there. Free some space or pass another '
            '--data_dir.')
  if code in (errno.EROFS, errno.EACCES, errno.EPERM):
    return (f'cannot write to {directory}: {error.strerror}; nothing was changed there. Pass '
            'a --data_dir you can write to.')


@contextlib.contextmanager
def staged_batches_dir(data_dir, needed_bytes):
  """A new `cifar-10-batches-bin/` written aside, then swapped in whole.

  Yields a hidden staging directory in `data_dir`; write every file there.
  When the block ends normally, files of the old directory that the new one
  lacks (e.g. readme.html) are linked into it and the two are swapped with
  two renames, so readers see the old set or the new one, never a mix or a
  partial file. On any error or interrupt the staging directory and the
  directories this call created are removed, and the old data is untouched.
  What a writer killed outright (SIGKILL) leaves, its hidden staging
  directory (`files.scratch`), is removed by the next writer on the same host.

  Args:
    data_dir: str, the data directory (created if missing).
    needed_bytes: int, the size of the new files, for the message when the
      disk is full.

  Raises:
    DataError: cifar-10-batches-bin is a file, or the disk is full or
      read-only, or writing is denied; nothing was changed.
    OSError: other errors (e.g. data_dir lies below a file).
  """
  target = batches_dir(data_dir)
  if os.path.lexists(target) and not os.path.isdir(target):
    raise DataError(f'{target} is a file, not a directory; nothing was written. Move '
                    'it away or pass another --data_dir.')
  created = []  # the directories this call makes, deepest first
  d = os.path.abspath(data_dir)
  while not os.path.isdir(d):
    created.append(d)
    d = os.path.dirname(d)
  try:
    os.makedirs(data_dir, exist_ok=True)
    with files.scratch(data_dir, _STAGING_PREFIX) as stage:
      yield stage
      _swap_in(stage, target)
  except BaseException as e:
    for d in created:
      with contextlib.suppress(OSError):
        os.rmdir(d)  # only if still empty
    if message := write_failure(data_dir, e, needed_bytes):
      raise DataError(message) from e
    raise


def _swap_in(stage, target):
  """Replaces the directory `target` by `stage` (two renames)."""
  old = f'{stage}.old'
  if os.path.isdir(target):
    # The old set's marker describes the old set: a new generated set brings
    # its own, and a set written without one must not inherit it.
    new = set(os.listdir(stage)) | {GENERATED_FILE}
    shutil.copytree(target, stage, symlinks=True, dirs_exist_ok=True, copy_function=_link,
                    ignore=lambda d, names: new if d == target else ())
    os.rename(target, old)
  os.rename(stage, target)
  shutil.rmtree(old, ignore_errors=True)


def _link(src, dst):
  """A hard link to `src` at `dst`; a copy where the file system has none."""
  try:
    os.link(src, dst)
  except OSError:
    shutil.copy2(src, dst)
