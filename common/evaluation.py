"""Which checkpoint to evaluate, and upstream's loop that evaluates each new one.

Both evaluators (legacy/eval.py, modern/eval.py) evaluate a checkpoint's
`common.checkpoints.Contents`: read whole and checked against its checksums
before any graph is built, so a checkpoint the trainer deletes meanwhile
(max_to_keep) is still evaluated whole. This module picks the checkpoint - the
newest intact one, saying what it skipped - and hands it to the evaluator of
its kind, chosen per checkpoint: one directory can hold either trainer's
checkpoints over time. It imports neither evaluator; the caller passes the
dispatch in.

Deviation from upstream: upstream's loop re-evaluated the newest checkpoint
every eval_interval_secs and died on the first unreadable one; this one
evaluates each new checkpoint once, waits for the first one, passes over
damaged and vanished ones, and stops at a signal with a line saying what was
evaluated.
"""

import collections
import datetime
import os

from common import checkpoints
from common import prog

EvalCounts = collections.namedtuple('EvalCounts', [
    'true_count',  # records whose top prediction is the label
    'total_count',  # records evaluated, each once
    'global_step',  # global step of the checkpoint
])

Evaluation = collections.namedtuple('Evaluation', [
    'path',  # the checkpoint prefix evaluated
    'precision',  # float in [0, 1]
    'global_step',  # int
])


def result_line(precision, global_step, path):
  """Upstream's result line, with the global step and the checkpoint evaluated."""
  return ('%s: precision @ 1 = %.3f (global step %s, %s)'
          % (datetime.datetime.now(), precision, global_step,
             os.path.basename(path)))


def _identity(contents):
  """What tells a new checkpoint from one already evaluated: name and time."""
  try:
    mtime = os.stat(contents.path + '.index').st_mtime_ns
  except OSError:
    mtime = None  # deleted since it was read; its contents are still whole
  return contents.path, mtime


def run(checkpoint_dir, evaluate, stop, out, warn, interval_secs=None,
        max_evals=None):
  """Evaluates the newest intact checkpoint once, or each new one as it comes.

  Args:
    checkpoint_dir: str, a train_dir of either trainer.
    evaluate: callable(contents, should_stop) -> EvalCounts, or None when
      should_stop() turned true before the evaluation finished; it raises
      for a checkpoint it cannot evaluate (e.g. of another model).
    stop: an entered common.training.StopRequest; a signal ends the run with
      a line saying what was evaluated.
    out: callable(str) for results and progress (stdout).
    warn: callable(str) for what was skipped (stderr).
    interval_secs: None to evaluate once; else seconds between looks for a
      new checkpoint.
    max_evals: optional int, stop after this many evaluations.

  Returns:
    list of Evaluation, one per checkpoint evaluated.

  Raises:
    common.checkpoints.CheckpointError: evaluating once, and there is no
      intact checkpoint; the message says why and what to do.
  """
  once = interval_secs is None
  results, seen, said = [], set(), set()
  waiting = False
  current = None  # the checkpoint being evaluated, for the stop line

  def say(note):
    if note not in said:
      said.add(note)
      warn(note)

  while not stop.requested and (max_evals is None or len(results) < max_evals):
    found = checkpoints.newest_intact(checkpoint_dir)
    # A loop beside a trainer sees its saves in progress: those go unsaid.
    for note in checkpoints.skip_notes(found, checkpoint_dir,
                                       'evaluating the newest intact checkpoint',
                                       unfinished=once):
      say(note)
    contents = found.contents
    if contents is None:
      if once:
        raise _nothing_to_evaluate(checkpoint_dir, found)
      if not waiting:
        damaged = found.skipped or found.state_problem
        out('No %scheckpoint in %s yet; looking again every %g s.'
            % ('intact ' if damaged else '', checkpoint_dir, interval_secs))
        waiting = True
      stop.wait(interval_secs)
      continue
    identity = _identity(contents)
    if identity in seen:
      stop.wait(interval_secs)
      continue
    waiting = False
    current = contents.path
    counts = evaluate(contents, lambda: stop.requested)
    if counts is None:  # a signal cut it short
      break
    current = None
    seen.add(identity)
    precision = counts.true_count / counts.total_count
    out(result_line(precision, counts.global_step, contents.path))
    results.append(Evaluation(contents.path, precision, counts.global_step))
    if once:
      break
  if stop.requested:
    out(stop_line(stop.signal_name, results, current))
  return results


def stop_line(signal_name, results, current=None):
  """The one line a signal leaves: what was evaluated, and what was cut short."""
  if results:
    line = ('Stopped by %s; evaluated %d checkpoint(s), the last %s at global '
            'step %s' % (signal_name, len(results),
                         os.path.basename(results[-1].path),
                         results[-1].global_step))
  else:
    line = 'Stopped by %s; evaluated no checkpoint' % signal_name
  if current:
    line += '; the evaluation of %s was cut short' % os.path.basename(current)
  return line + '.'


def _nothing_to_evaluate(checkpoint_dir, found):
  if found.skipped or found.unfinished or found.state_problem:
    return checkpoints.CheckpointError(
        'no intact checkpoint in %s (what is wrong with each is said above). '
        'Train again with --train_dir %s, or pass another --checkpoint_dir.'
        % (checkpoint_dir, checkpoint_dir))
  return checkpoints.CheckpointError(
      'no checkpoint in %s. Train first (`%s` or `modern` with --train_dir '
      '%s), or pass the --checkpoint_dir you trained into.'
      % (checkpoint_dir, prog.command('legacy'), checkpoint_dir))
