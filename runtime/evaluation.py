"""Which checkpoint to evaluate, and upstream's loop that evaluates each new one.

Both evaluators (legacy/eval.py, modern/eval.py) evaluate a checkpoint's
`runtime.checkpoints.Contents`: read whole and checked against its checksums
before any graph is built, so a checkpoint the trainer deletes meanwhile
(max_to_keep) is still evaluated whole. This module picks the checkpoint - the
newest intact one, saying what it skipped - and hands it to the evaluator of
its kind, chosen per checkpoint: one directory can hold either trainer's
checkpoints over time. It imports neither evaluator; the caller passes the
dispatch in. Whichever evaluated it, the precision goes to TensorBoard the same
way: `precision_writer`, upstream's 'Precision @ 1' scalar in eval_dir. The batch loop
that counts correct predictions is here too (`count_correct`), for both.

Deviation from upstream: upstream's loop re-evaluated the newest checkpoint
every eval_interval_secs and died on the first unreadable one; this one
evaluates each new checkpoint once, waits for the first one, passes over
damaged and vanished ones, and stops at a signal with a line saying what was
evaluated.
"""

import collections
import contextlib
import datetime
import logging
import os
import tempfile

import tensorflow as tf

from cifar10_towers.common import cifar10_format
from cifar10_towers.common import errors
from cifar10_towers.common import files
from cifar10_towers.common import prog
from cifar10_towers.runtime import checkpoints
from cifar10_towers.runtime import ending
from cifar10_towers.runtime import training

logger = logging.getLogger(__name__)

PRECISION_TAG = 'Precision @ 1'  # upstream's summary tag

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


class EvalError(errors.Failure):
  """Evaluation cannot run (a checkpoint without moving averages, the other
  trainer's; eval_dir cannot be written, the message naming --eval_dir); the
  message says why and what to do. Both evaluators."""


@contextlib.contextmanager
def precision_writer(eval_dir):
  """A context writing 'Precision @ 1' to eval_dir at each checkpoint's global step.

  Entering creates eval_dir if missing and proves a file can be made in it;
  it yields write(precision, global_step), which adds one point, flushed to
  disk. Leaving closes the event file (quietly: every point is flushed as it
  is written, and a failure to write one says so). One event file per
  writer, opened at the first point, so TensorBoard shows a point as soon as
  its evaluation ends. Event files already in eval_dir are kept: a new
  writer adds its own file beside them, and TensorBoard shows the points of
  all of them as one series. Every failure to write is an EvalError (e.g.
  disk full); nothing outside eval_dir is touched. With eval_dir None it
  writes nothing.
  """
  # Deviation from upstream: eval_dir is never deleted; new points are added.
  # Deviation from upstream: upstream also wrote the model's summaries by
  # running them over one more batch; only the precision is written.

  def error(cause, advice=None):
    """EvalError of `cause`, the line saying what failed."""
    return EvalError(
        f'could not write {PRECISION_TAG} to --eval_dir {eval_dir} ({cause}). '
        f'{advice or files.advice(cause)}, or pass another --eval_dir; the checkpoints '
        'are untouched.')

  if eval_dir is None:
    yield lambda precision, global_step: None
    return
  probe = os.path.abspath(eval_dir)  # the nearest existing ancestor must be a directory
  while not os.path.lexists(probe):
    probe = os.path.dirname(probe)
  if not os.path.isdir(probe):
    raise error(f'{probe} is a file, not a directory', 'Move that file')
  try:
    os.makedirs(eval_dir, exist_ok=True)
    # An unnamed file, gone when closed: eval_dir is left as it was.
    with tempfile.TemporaryFile(dir=eval_dir):
      pass
  except OSError as e:
    raise error(e.strerror or str(e)) from None
  writer = None

  def write(precision, global_step):
    nonlocal writer
    try:
      if writer is None:
        before = set(os.listdir(eval_dir))
        try:
          writer = tf.summary.create_file_writer(eval_dir)
        except (tf.errors.OpError, OSError):
          # A full disk leaves the new event file empty: remove it, so a failed
          # write changes nothing.
          for name in set(os.listdir(eval_dir)) - before:
            path = os.path.join(eval_dir, name)
            with contextlib.suppress(OSError):
              if os.path.getsize(path) == 0:
                os.remove(path)
          raise
      with writer.as_default():
        tf.summary.scalar(PRECISION_TAG, precision, step=int(global_step))
      writer.flush()
    except (tf.errors.OpError, OSError) as e:
      raise error(checkpoints.reason(e).rsplit('; ', 1)[-1]) from None

  try:
    yield write
  finally:
    if writer is not None:
      with contextlib.suppress(tf.errors.OpError, OSError):  # every point is flushed already
        writer.close()


def moving_averages(contents, kind, variables):
  """The moving-average (shadow) values an evaluator restores into its model's variables.

  Args:
    contents: runtime.checkpoints.Contents.
    kind: checkpoints.LEGACY or MODERN, the evaluator's own.
    variables: dict checkpoint key -> the variable its value goes into.

  Returns:
    list of (variable, numpy value).

  Raises:
    EvalError: the checkpoint is the other trainer's, or lacks a moving
      average of this model (or holds one of another shape).
  """
  shapes = {key: variable.shape.as_list() for key, variable in variables.items()}
  if contents.kind != kind:
    raise EvalError(f'{contents.path} is a {contents.kind} checkpoint; evaluate it with the '
                    f'{contents.kind} evaluator.')
  if problem := checkpoints.misfit(contents, shapes):
    raise EvalError(f'{contents.path} does not hold the moving averages of this model '
                    f'({problem[0]}). Point --checkpoint_dir at a train_dir written by `{kind}`.')
  return [(variable, contents.tensors[key]) for key, variable in variables.items()]


def count_correct(batches, data_dir, num_examples, contents, should_stop, progress):
  """Both evaluators' batch loop: counts correct top-1 predictions, each record once.

  Args:
    batches: iterable of numpy bool arrays, batch by batch in file order: for
      each record, whether its top prediction is its label.
    data_dir: str, holds the test file.
    num_examples: optional int >= 1, count the first this many test records;
      None or more than the file holds means all.
    contents: runtime.checkpoints.Contents, the checkpoint evaluated.
    should_stop: optional callable() -> bool, asked before each batch.
    progress: optional callable(records_done), called after each batch.

  Returns:
    EvalCounts, or None when should_stop() turned true first.

  Raises:
    EvalError: the input ended before every record was counted.
  """
  available = cifar10_format.num_examples(cifar10_format.eval_files(data_dir))
  num_examples = min(num_examples or available, available)
  batches = iter(batches)
  true_count = total = 0
  while total < num_examples:
    if should_stop and should_stop():
      return None
    correct = next(batches, None)
    if correct is None:
      raise EvalError(f'evaluated {total} of {num_examples} test records from {data_dir}; the '
                      'input ended early.')
    correct = correct[:num_examples - total]  # only the first num_examples records count
    true_count += int(correct.sum())
    total += len(correct)
    if progress:
      progress(total)
  return EvalCounts(true_count, total, checkpoints.global_step(contents))


def _identity(contents):
  """What tells a new checkpoint from one already evaluated: name and time."""
  try:
    mtime = os.stat(f'{contents.path}.index').st_mtime_ns
  except OSError:
    mtime = None  # deleted since it was read; its contents are still whole
  return contents.path, mtime


def run(checkpoint_dir, evaluate, stop=None, interval_secs=None, max_evals=None,
        eval_dir=None):
  """Evaluates the newest intact checkpoint once, or each new one as it comes.

  The one way to evaluate, for the CLI and library callers alike.

  Args:
    checkpoint_dir: str, a train_dir of either trainer.
    evaluate: callable(contents, should_stop=...) -> EvalCounts, or None when
      should_stop() turned true before the evaluation finished; it raises
      for a checkpoint it cannot evaluate (e.g. of another model). A
      trainer's `evaluate_contents` (legacy/eval.py, modern/eval.py), its
      data_dir, batch_size and num_examples bound.
    stop: an entered runtime.training.StopRequest (default: one of its own);
      a signal ends the run with a line saying what was evaluated.
    interval_secs: None to evaluate once; else seconds between looks for a
      new checkpoint.
    max_evals: optional int, stop after this many evaluations.
    eval_dir: optional str; when set, each precision is also written there
      for TensorBoard at the checkpoint's global step (`precision_writer`);
      the directory is created, and checked writable, before anything is
      evaluated.

  Returns:
    list of Evaluation, one per checkpoint evaluated.

  Raises:
    runtime.checkpoints.CheckpointError: evaluating once, and there is no
      intact checkpoint; the message says why and what to do.
    EvalError: eval_dir cannot be written.
  """
  once = interval_secs is None
  results, seen, said = [], set(), set()
  waiting, cut = False, ''  # cut: a stop line's note of an evaluation the stop cut short
  with contextlib.nullcontext(stop) if stop else training.StopRequest() as stop:
    with precision_writer(eval_dir) as write:
      while not stop.requested and (max_evals is None or len(results) < max_evals):
        found = checkpoints.newest_intact(checkpoint_dir)
        # A loop beside a trainer sees its saves in progress: those go unsaid.
        for note in checkpoints.skip_notes(found, checkpoint_dir,
                                           'evaluating the newest intact checkpoint',
                                           unfinished=once):
          if note not in said:
            said.add(note)
            logger.warning(note)
        contents = found.contents
        if contents is None:
          if once:
            damaged = found.skipped or found.unfinished or found.state_problem
            raise checkpoints.CheckpointError(
                f'no intact checkpoint in {checkpoint_dir} (what is wrong with each is said '
                f'above). Train again with --train_dir {checkpoint_dir}, or pass another '
                '--checkpoint_dir.'
                if damaged else
                f"no checkpoint in {checkpoint_dir}. Train first (`{prog.command('legacy')}` or "
                f'`modern` with --train_dir {checkpoint_dir}), or pass the --checkpoint_dir you '
                'trained into.')
          if not waiting:
            damaged = found.skipped or found.state_problem
            logger.info(f"No {'intact ' if damaged else ''}checkpoint in {checkpoint_dir} yet; "
                        f'looking again every {interval_secs:g} s.')
          waiting = True
        elif (identity := _identity(contents)) not in seen:
          waiting = False
          counts = evaluate(contents, should_stop=lambda: stop.requested)
          if counts is None:  # a signal cut it short
            cut = f'; the evaluation of {os.path.basename(contents.path)} was cut short'
            break
          seen.add(identity)
          precision = counts.true_count / counts.total_count
          # Upstream's result line, with the global step and the checkpoint evaluated.
          logger.info(f'{datetime.datetime.now()}: precision @ 1 = {precision:.3f} (global step '
                      f'{counts.global_step}, {os.path.basename(contents.path)})')
          results.append(Evaluation(contents.path, precision, counts.global_step))
          write(precision, counts.global_step)
          if once:
            break
          continue
        stop.wait(interval_secs)
    if stop.requested:  # the one ending line, on stderr: what was evaluated, and what was cut short
      done = (f'{len(results)} checkpoint(s), the last {os.path.basename(results[-1].path)} at '
              f'global step {results[-1].global_step}' if results else 'no checkpoint')
      ending.say(f'Stopped by {stop.signal_name}; evaluated {done}{cut}.')
    return results
