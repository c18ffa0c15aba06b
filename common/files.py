"""What a command writes: whole files, one line when a write fails, scratch that goes with it.

Every file a command writes for the user (`bench --json` and `--plot`,
`profile --out`'s files, `crosscheck --dump`'s evidence) is written through
`replacing`: in a scratch directory beside it, renamed into place when whole.
So a stop, a kill or a full disk leaves the file that was there before (or
none), never a partial one; a write that fails is one line naming the file,
the flag and what to do (`write_failed`, the wording of every failed write
into a path the user gave: checkpoints' too).

Every scratch directory (bench's, profile's, convert's staging, the data
writers' staging) is a `scratch`: named `<prefix><host>-<pid>-<random>`, and
removed when its block ends, however it ends. What an owner killed outright
(SIGKILL) leaves is removed by the next `scratch` of the same prefix in the
same directory, once no process of that PID runs on this host.
No TensorFlow here.
"""

import contextlib
import os
import re
import shutil
import socket

from cifar10_towers.common import errors


class WriteError(errors.Failure):
  """A file could not be written; the line names it, the flag and what to do."""


_ADVICE = [  # (what to do, how the operating system words a failed write it fixes)
    ('Make it writable', ('Permission denied', 'Operation not permitted',
                          'Read-only file system')),
    ('Free space on that disk', ('No space left on device', 'Disk quota exceeded')),
    # EFBIG: past the process's file size limit, or the file system's largest file.
    ('Raise the file size limit (ulimit -f)', ('File too large',)),
    ('Move the file in the way', ('Not a directory',)),
]


def advice(cause):
  """What to do about a failed write, from how the operating system worded its `cause`."""
  return next((todo for todo, words in _ADVICE if any(w in cause for w in words)), 'Fix that')


def write_failed(what, directory, cause, flag):
  """The one line of a failed write: what, where, why, and what to do.

  Args:
    what: str, what could not be written, e.g. 'checkpoint model.ckpt-20'.
    directory: str, where, as the user gave it.
    cause: str, the operating system's words, e.g. 'No space left on device'.
    flag: str, the flag that names another place, e.g. '--train_dir'.
  """
  return (f'could not write {what} in {directory} ({cause}). {advice(cause)}, or pass another '
          f'{flag}.')


@contextlib.contextmanager
def scratch(directory, prefix):
  """A new directory `<directory>/<prefix><host>-<pid>-<random>` for the block.

  What dead owners left in `directory` under `prefix` is removed first. The
  scratch directory is removed when the block ends, however it ends (unless
  the block renamed it away).

  Yields:
    str, its path.
  """
  # First the dead owners' ones: those of this host (`<prefix><host>-<pid>-...`,
  # with anything after it, e.g. '.old') whose PID no process has now.
  mine = re.compile(rf'{re.escape(prefix + socket.gethostname())}-(\d+)-')
  for name in os.listdir(directory):
    match = mine.match(name)
    if match:
      try:
        os.kill(int(match[1]), 0)
      except ProcessLookupError:  # the owner is gone
        shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
      except PermissionError:  # it runs, as another user
        pass
  path = os.path.join(directory,
                      f'{prefix}{socket.gethostname()}-{os.getpid()}-{os.urandom(3).hex()}')
  os.mkdir(path)
  try:
    yield path
  finally:
    shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def replacing(flag, *paths):
  """Temporary paths for the block to write, that replace `paths` when it ends normally.

  They lie in a hidden `scratch` directory beside the files, under the same
  names (numpy's savez and matplotlib's savefig go by the extension), and
  are renamed into place one after the other once the block is done. On any
  error or stop they are removed, and the files at `paths` stay as they were.

  Args:
    flag: str, the flag that named the files, for the message.
    *paths: str, the files to write, in one directory (which must exist).

  Yields:
    list of str, the temporary paths, in the order of `paths`.

  Raises:
    WriteError: an OSError (a full disk, a missing directory): one line
      naming the files and `flag`.
  """
  directory = os.path.dirname(paths[0]) or '.'
  try:
    with scratch(directory, '.writing-') as stage:
      temps = [os.path.join(stage, os.path.basename(path)) for path in paths]
      yield temps
      for temp, path in zip(temps, paths):
        os.replace(temp, path)
  except OSError as e:
    names = ', '.join(map(os.path.basename, paths))
    raise WriteError(write_failed(names, directory, e.strerror or e, flag)) from e
