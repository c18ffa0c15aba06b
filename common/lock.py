"""One training run per train_dir: an exclusive OS lock held for the whole run.

`flock` on `<train_dir>/.train.lock`: the kernel releases it when the holder's
process ends in any way (exit, crash, kill -9), so a dead run never leaves a
stale lock behind. The file also records who holds it, for the message the
second run prints. Readers (eval, convert) take no lock.
"""

import contextlib
import datetime
import errno
import fcntl
import os
import socket
import sys

LOCK_FILE = '.train.lock'


class LockError(Exception):
  """Another process holds the lock; the message names it and what to do."""


def _holder(handle):
  handle.seek(0)
  text = handle.read().strip()
  return text or 'a process that did not say which'


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
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, LOCK_FILE)
  handle = open(path, 'a+', encoding='utf-8')  # pylint: disable=consider-using-with
  try:
    try:
      fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      if e.errno not in (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN):
        raise
      raise LockError(
          '%s is in use by another run (%s). Wait for it to end, or pass another '
          '--train_dir; two runs in one train_dir would overwrite each other\'s '
          'checkpoints.' % (directory, _holder(handle))) from None
    handle.seek(0)
    handle.truncate()
    handle.write('PID %d on host %s, %s, since %s (%s)\n' % (
        os.getpid(), socket.gethostname(), what,
        datetime.datetime.now().strftime('%Y-%m-%d %H:%M:%S'),
        ' '.join(os.path.basename(a) if i == 0 else a
                 for i, a in enumerate(sys.argv))[:200]))
    handle.flush()
    yield path
  finally:
    handle.close()  # releases the lock
