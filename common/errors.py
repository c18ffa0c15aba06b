"""The one root of every error a user can cause or the world can do to a run.

Each module raises its own subclass of `Failure` (DataError, CheckpointError,
LockError, ...) with one line that says what is wrong and what to do; the
CLI catches `Failure` in one place and prints that line with `exit_code`.
Anything else that escapes is a bug, and shows its traceback.
(`runtime.training.Stopped`, a stop signal, is not a failure: it is a
BaseException, so that no `except Exception` on the way swallows it.)
"""


class Failure(Exception):
  """What a user did wrong or what the world did to a run: one line, an exit code."""

  exit_code = 1  # 2: a usage error, found before anything ran

  def line(self):
    """The message's first line (the type's name if empty)."""
    text = str(self).strip()
    return text.splitlines()[0] if text else type(self).__name__
