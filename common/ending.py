"""How a process ends: its one ending line, straight to the real stderr, and its exit.

Every way out that cannot unwind normally (a second signal, a worker whose
peers are gone while its main thread waits in C++, a run already saved that
skips TensorFlow's slow interpreter teardown) passes `exit_now`, the only
caller of os._exit.
"""

import os
import sys

from cifar10_towers.common import stderr_filter


def say(line):
  """Writes the one ending line of a run to the real stderr (past the noise filter); never raises."""
  stderr_filter.say(line)


def exit_now(status, line=None):
  """Flushes stdout, writes `line` (if any) to the real stderr, and exits with `status` at once."""
  try:
    sys.stdout.flush()
  except (OSError, ValueError):
    pass
  if line is not None:
    say(line)
  stderr_filter.restore()
  os._exit(status)  # pylint: disable=protected-access
