"""How a process ends: its one ending line, straight to the real stderr, and its exit.

Every way out that cannot unwind normally (a second signal, a worker whose
peers are gone while its main thread waits in C++, a run already saved that
skips TensorFlow's slow interpreter teardown) passes `exit_now`, the only
caller of os._exit.
"""

import os
import re

from cifar10_towers.common import errors
from cifar10_towers.runtime import progress
from cifar10_towers.runtime import stderr_filter


def say(line):
  """Writes a run's one ending line to the real stderr (past the noise filter); never raises."""
  progress.end_line()  # on a fresh line, after a log line left open on a terminal
  stderr_filter.say(line)


def exit_now(status, line=None):
  """Flushes Python's streams, writes `line` (if any) to the real stderr, exits with `status`."""
  stderr_filter.flush_python()
  if line:
    say(line)
  stderr_filter.restore()
  os._exit(status)  # pylint: disable=protected-access


# --- a training run that failed: keep what can be kept, say it in one line ----

class RunFailed(errors.Failure):
  """A training run ended by a failure after its first step; the message is its
  one ending line: the cause, what was saved or stays, and what to do."""


def cause(error):
  """What went wrong, in a user's words: one line, no op names, node blocks or traceback.

  Our own errors (errors.Failure) carry their line already, a closed stream
  (progress.StreamClosed) too; an OSError with a file names it; a TensorFlow error loses its
  decorations ([[{{node ...}}]], [Op:...]) and is named by its kind.
  """
  if isinstance(error, errors.Failure):
    return error.line()
  if isinstance(error, OSError) and error.filename:
    return f'{error.filename}: {error.strerror or error}'
  if type(error).__module__.startswith('tensorflow'):
    from cifar10_towers.runtime import checkpoints  # pylint: disable=import-outside-toplevel
    kind = re.sub(r'(?<!^)(?=[A-Z])', ' ', type(error).__name__.replace('Error', ''))
    return f"TensorFlow failed ({kind.lower() or 'error'}): {checkpoints.reason(error)}"
  text = str(error).strip().splitlines()
  return f'{type(error).__name__}: {text[0]}' if text else type(error).__name__


def failed(error, first_step, step, trainer, train_dir):
  """The error a training run ends with after `error` crossed its loop, its work kept.

  Where the variables still hold the last completed step (`trainer.global_step() == step`:
  the failure came before the step's update, which is where input and output
  failures happen), that step is saved unless it already is. Where they may
  not (a NaN, a failure during the update) or the save fails too (disk
  full), the newest intact checkpoint stays as it was.

  A failure before this run completed a step has nothing to keep: it ends
  with its own line (ours), or its cause.

  Args:
    error: the exception that crossed the loop.
    first_step: int, the global step this run started from.
    step: int, the last global step this run completed and checked.
    trainer: runtime.training.Trainer (its global_step() and saver).
    train_dir: str, where the checkpoints are.

  Returns:
    RunFailed whose one line says the cause, what was saved or stays, and
    what to do; `error` itself (or RunFailed with its cause) if the run had
    completed no step.
  """
  if step == first_step:
    return error if isinstance(error, errors.Failure) else RunFailed(cause(error))
  line = f"{cause(error).rstrip('.')}."
  try:
    intact = trainer.global_step() == step
  except Exception:  # pylint: disable=broad-except
    intact = False
  problem = ''
  if intact and step != trainer.saver.last_saved and os.path.isdir(train_dir):
    try:
      path = trainer.saver()
      return RunFailed(f'{line} Saved global step {step} to {path}; the same command resumes '
                       'from it.')
    except Exception as e:  # pylint: disable=broad-except
      again = cause(e).rstrip('.')  # said already if it is what ended the run
      if again not in line:
        problem = f' Saving global step {step} failed too: {again}.'
  if not os.path.isdir(train_dir):  # removed under the run, before or as it saved
    return RunFailed(
        f'{line} {train_dir} is gone: no checkpoint remains; the same command starts again at '
        'step 0.')
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from cifar10_towers.runtime import checkpoints  # pylint: disable=import-outside-toplevel
  try:
    newest = tf.train.latest_checkpoint(train_dir)
  except (tf.errors.OpError, OSError, ValueError):
    newest = None
  if not newest:
    return RunFailed(
        f'{line}{problem} No checkpoint was written; the same command starts again at step 0.')
  return RunFailed(
      f'{line}{problem} The newest intact checkpoint stays: {newest} (global step '
      f'{checkpoints.step_of(newest)}); the same command resumes from it.')
