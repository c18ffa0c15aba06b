"""runtime.lock: one run per train_dir, and no stale lock after a kill."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from cifar10_towers.runtime import lock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_second_holder_is_refused_with_the_first_ones_pid(tmp_path):
  with lock.exclusive(str(tmp_path), what='legacy training'):
    with pytest.raises(lock.LockError) as raised:
      with lock.exclusive(str(tmp_path)):
        pass
  message = str(raised.value)
  assert 'PID %d on host ' % os.getpid() in message
  assert 'legacy training' in message and '--train_dir' in message
  assert '\n' not in message
  with lock.exclusive(str(tmp_path)):  # released when the block ended
    pass


@pytest.mark.slow
def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
  script = textwrap.dedent('''
      import sys, time
      sys.path.insert(0, %r)
      from cifar10_towers.runtime import lock
      with lock.exclusive(%r, what='a run about to be killed'):
        print('locked', flush=True)
        time.sleep(60)
  ''' % (ROOT, str(tmp_path)))
  proc = subprocess.Popen([sys.executable, '-c', script], stdout=subprocess.PIPE,
                          text=True)
  try:
    assert proc.stdout.readline().strip() == 'locked'
    with pytest.raises(lock.LockError, match='PID %d ' % proc.pid):
      with lock.exclusive(str(tmp_path)):
        pass
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
  finally:
    if proc.poll() is None:
      proc.kill()
  with lock.exclusive(str(tmp_path)):
    pass


def test_the_lock_file_goes_with_the_run_and_a_removed_one_is_noticed(tmp_path):
  train_dir = str(tmp_path / 'train')
  with lock.exclusive(train_dir, what='legacy training'):
    pass
  # A finished run leaves no lock file, nor the directory it made, still empty.
  assert not os.path.exists(train_dir)
  first = lock.exclusive(train_dir, what='legacy training')
  path = first.__enter__()
  lock.check(train_dir)  # still its own
  os.remove(path)  # e.g. the train_dir emptied under the run
  with pytest.raises(lock.LockError, match='was removed'):
    lock.check(train_dir)
  # The directory is free for another run now; the first one ending does not
  # take that one's lock file away.
  with lock.exclusive(train_dir, what='the next run'):
    first.__exit__(None, None, None)
    assert os.listdir(train_dir) == [lock.LOCK_FILE]
    with pytest.raises(lock.LockError, match='the next run'):
      with lock.exclusive(train_dir):
        pass
  assert os.listdir(train_dir) == []
  lock.check(train_dir)  # no lock of this process there: nothing to check
