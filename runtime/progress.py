"""Progress of the long waits: a bar on a terminal, a few plain lines elsewhere.

`data synth` at CIFAR-10 size and `eval` work for seconds to minutes before
their result line. On a terminal they draw click's progress bar. When the
stream is a file or a pipe (a log, a CI job), where a bar would be a heap of
carriage returns, they print a line as each stage begins (`stage`) and,
within a long stage (`update`, after each batch), a line at a quarter, half
and three quarters of it, each only when EVERY_SECS have passed since the
line before: a fast stage says one line, a slow one at most four.

Like the other progress of the CLI (training's step lines and heartbeats,
logged through LogHandler), it goes to stdout, with the results;
diagnostics go to stderr.
"""

import errno
import logging
import sys
import time

import click

from cifar10_towers.common import errors

EVERY_SECS = 10.0  # without a terminal, no line within a stage sooner after the last


class Progress:
  """A context: the progress of one task of `total` units (files, records).

  Args:
    total: int >= 0, the units of the task.
    label: str, what the task is doing, e.g. 'Evaluating model.ckpt-2': the
      bar's label, and the start of the lines within a stage.
    unit: str, what the lines call a unit, e.g. 'records'.
    file: the text stream; default sys.stdout, looked up when made (so
      click's CliRunner captures it).
    clock: callable() -> float seconds, for tests.
  """

  def __init__(self, total, label, unit, file=None, clock=time.monotonic):
    self.total, self.label, self.unit = total, label, unit
    self.file = file or sys.stdout
    self.terminal = _isatty(self.file)  # draw a bar, not lines
    self._bar = click.progressbar(length=total, label=label, file=self.file, show_pos=True,
                                  item_show_func=lambda item: item) if self.terminal else None
    self._clock = clock
    self._said_at = clock()  # of the last line
    self._quarters = 0  # quarters of the total said so far

  def __enter__(self):
    if self.terminal:
      self._bar.__enter__()
    return self

  def __exit__(self, *exc):
    if self.terminal:
      self._bar.__exit__(*exc)  # ends the bar's line

  def stage(self, done, line, item=None):
    """A stage begins with `done` units done.

    Args:
      done: int, units done so far.
      line: str, what the stage does, printed without a terminal.
      item: optional str, what the bar shows beside it on a terminal.
    """
    if self.terminal:
      self._move(done, item)
    else:
      self._say(line)

  def update(self, done):
    """`done` units of the total are done; prints at most a quarter's line."""
    if self.terminal:
      self._move(done)
      return
    # Nothing to say at 0, nor at the end: the result comes next.
    quarters = 4 * done // self.total if 0 < done < self.total else 0
    if quarters > self._quarters and self._clock() - self._said_at >= EVERY_SECS:
      self._quarters = quarters
      self._say(f'{self.label}: {done} of {self.total} {self.unit} '
                f'({100 * done // self.total}%)...')

  def _say(self, line):
    echo(line, self.file)
    self._said_at = self._clock()

  def _move(self, done, item=None):
    # All done: no stage to name.
    self._bar.current_item = None if done >= self.total else item or self._bar.current_item
    if done != self._bar.pos:
      self._bar.update(done - self._bar.pos)
    else:
      self._bar.render_progress()  # the item changed, not the position


def _isatty(stream):
  try:
    return stream.isatty()
  except (AttributeError, ValueError):  # no such method, or closed
    return False


# --- what the library says: the CLI's one log handler ---------------------

class StreamClosed(errors.Failure):
  """A write to stdout or stderr failed: its reader is gone (a pipe, a terminal) or its disk full.

  Every such failure alike (EPIPE, EBADF, ENOSPC, EIO, ...) is a closed
  stream, named by `echo`, the one place where the CLI writes to either.
  """

  def __init__(self, stream, error):  # stream: 'stdout' or 'stderr'
    gone = ": a pipe's reader ended or the terminal is gone" if error.errno in (
        errno.EPIPE, errno.EIO, errno.EBADF) else ''
    super().__init__(f'{stream} closed ({error.strerror or error}{gone})')


def echo(text, stream=None, nl=True):
  """click.echo to `stream` (default sys.stdout, looked up now); a failed write is StreamClosed.

  Each later write fails again (the unwritten text stays buffered), so a
  thread that swallows the error (a heartbeat) cannot hide it from the run.
  """
  stream = stream or sys.stdout
  try:
    click.echo(text, file=stream, nl=nl)
  except OSError as e:
    raise StreamClosed('stderr' if stream is sys.stderr else 'stdout', e) from e


IN_PLACE = {'in_place': True}  # `extra` of a training log line: rewritten in place on a terminal
_open_line = None  # the stream whose line a log line left open, or None


def end_line():
  """Ends the line a log line left open on a terminal, so what follows starts on its own."""
  global _open_line  # pylint: disable=global-statement
  stream, _open_line = _open_line, None
  if stream:
    try:
      stream.write('\n')
      stream.flush()
    except (OSError, ValueError):
      pass


class LogHandler(logging.Handler):
  """Records below WARNING (progress, metrics) to stdout, the others (diagnostics) to stderr.

  Each stream is looked up as a record comes, so that click's CliRunner and
  pytest's capsys capture it. On a terminal each training log line (logged
  with extra=IN_PLACE: step, loss, speed, step/max_steps, time left) replaces
  the one before, as Keras' fit draws its bar line; any other line (a
  heartbeat, a warning, the last line) ends it first, and so does the
  ending line (runtime.ending). Elsewhere (a log, a pipe) every line is
  printed as it is, so the log keeps upstream's lines for the scripts that
  parse them. A failed write raises StreamClosed (no handleError): a closed
  stdout ends a run, saying what it kept (runtime.ending).
  """

  def emit(self, record):
    global _open_line  # pylint: disable=global-statement
    stream = sys.stdout if record.levelno < logging.WARNING else sys.stderr
    line = self.format(record)
    if getattr(record, 'in_place', False) and _isatty(stream):
      echo(f'\r{line}\x1b[K', stream, nl=False)  # \x1b[K: clear the rest
      _open_line = stream
      return
    end_line()
    echo(line, stream)
