"""One training run per train_dir: an exclusive OS lock held for the whole run.

`flock` on `<train_dir>/.train.lock`: the kernel releases it when the holder's
process ends in any way (exit, crash, kill -9), so a dead run never leaves a
stale lock behind. The file also records who holds it, for the message the
second run prints. The holder removes it before letting go, so a finished run
leaves no file behind (one killed with -9 leaves it, unlocked and harmless),
and a directory it created that is still empty then goes too: a run that
stopped before writing anything leaves no trace.
Readers (eval, convert) take no lock.
"""

import contextlib
import datetime
import fcntl
import os
import socket
import sys

from cifar10_towers.common import errors

LOCK_FILE = '.train.lock'
_held = {}  # lock file path -> the open handle holding it, in this process


class LockError(errors.Failure):
  """Another process holds the lock; the message names it and what to do."""


def _ours(handle, path):
  """Whether the file at `path` is still the one `handle` has open (see `_lock`)."""
  try:
    return os.path.samestat(os.fstat(handle.fileno()), os.stat(path))
  except FileNotFoundError:
    return False


def _lock(path, directory):
  """Opens and locks the file at `path`; the handle.

  The holder before removes the file while it still holds it: a handle opened
  before that refers to the removed file, so its lock would guard nothing.
  Such a lock is dropped and the file now at `path` locked instead.
  """
  while True:
    handle = open(path, 'a+', encoding='utf-8')  # pylint: disable=consider-using-with
    try:
      fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # EWOULDBLOCK: another open file holds it
      handle.seek(0)
      holder = handle.read().strip() or 'a process that did not say which'
      handle.close()
      raise LockError(
          f'{directory} is in use by another run ({holder}). Wait for it to end, or pass '
          'another --train_dir; two runs in one train_dir would overwrite each other\'s '
          'checkpoints.') from None
    if _ours(handle, path):
      return handle
    handle.close()


@contextlib.contextmanager
def exclusive(directory, what='training'):
  """Holds the exclusive lock of `directory` (created if missing) for the block.

  Args:
    directory: str, a train_dir (or a worker's own write directory).
    what: str, what this process does there, recorded for other runs' messages.

  Raises:
    LockError: another process holds it; the message names its PID, host,
      what it does and since when.
    OSError: the directory or the lock file cannot be created.
  """
  created = not os.path.isdir(directory)
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, LOCK_FILE)
  handle = _lock(path, directory)
  _held[path] = handle
  try:
    with contextlib.suppress(OSError):  # e.g. a full disk: it holds without the note
      handle.truncate(0)
      command = ' '.join([os.path.basename(sys.argv[0]), *sys.argv[1:]])[:200]
      handle.write(f'PID {os.getpid()} on host {socket.gethostname()}, {what}, since '
                   f'{datetime.datetime.now():%Y-%m-%d %H:%M:%S} ({command})\n')
      handle.flush()
    yield path
  finally:
    if _held.get(path) is handle:
      del _held[path]
    # While still held (see _lock), and only if it is still ours: if the
    # directory was removed under the run, another run may hold a new one.
    with contextlib.suppress(OSError):
      if _ours(handle, path):
        os.remove(path)
    with contextlib.suppress(OSError):  # a note that could not be written
      handle.close()  # releases the lock; the descriptor is closed either way
    if created:
      with contextlib.suppress(OSError):
        os.rmdir(directory)  # only if still empty


def check(directory):
  """Raises LockError if this process's lock of `directory` went away.

  Removing the directory (or its lock file) while a run holds it takes the
  lock with it: a second run could start there and both would write. Call
  before writing into it; a no-op where this process holds no lock.
  """
  path = os.path.join(directory, LOCK_FILE)
  handle = _held.get(path)
  if handle and not _ours(handle, path):
    raise LockError(
        f'{directory} was removed, or its lock file {LOCK_FILE}, while this run trained in '
        'it; stopped without writing there again, as another run may have started in it since.')
