"""Telling the two trainers' checkpoints apart.

Legacy writes name-based `tf.compat.v1.train.Saver` checkpoints; modern writes
object-based `tf.train.Checkpoint`s. Both are `<train_dir>/model.ckpt-<step>`
with a `checkpoint` state file, so the file's contents decide which it is.

Crash safety (checked with strace on TensorFlow 2.21; tests/test_faults_*):
both writers make a checkpoint the latest only once it is complete. The
Saver writes `.data` and `.index` to `*.tempstate*` files and renames each
into place, then replaces the `checkpoint` state file (temp file + rename);
the CheckpointManager writes into `model.ckpt-<step>_temp/`, renames the data
into place, writes the merged `.index`, and only then replaces the state file.
So a `kill -9` at any moment leaves the state file naming a complete
checkpoint, plus at most an incomplete newer one that nothing names.
(TensorFlow does not fsync: a power cut is not covered, a killed process is.)

`resume_point` builds on that: it resumes from the newest checkpoint that is
complete and passes its checksums - the one the state file names, or a newer
complete one a killed run wrote but did not get to name - and ignores
incomplete newer files (they are overwritten when that step is saved again);
the temp files of an interrupted save are removed.
Our own code, because tf.train.latest_checkpoint alone would name a damaged
checkpoint, miss a complete unnamed one and fail on a damaged state file:
tests/test_faults_state.py (test_train, test_eval, test_convert_refuses) and
tests/test_faults_checkpoints.py (test_resume_from_the_newest_intact_checkpoint).
A checkpoint the state file names was complete when it was named, so if it is
damaged now, something else damaged it (the disk, a copy, a hand): training
then stops with an error naming it and the newest intact older checkpoint,
and changes nothing, rather than silently training over the evidence. A named
checkpoint whose files are all gone (deleted by hand) leaves nothing to
protect: training resumes from the newest intact older one and says so.

Eval and convert read (`newest_intact`) without changing anything: eval
evaluates the newest intact checkpoint and says which it skipped; convert
refuses a train_dir whose latest checkpoint or state file is damaged
(`for_conversion`). A checkpoint is read whole into memory, with every
checksum checked (`read`), so a trainer deleting it meanwhile (max_to_keep)
cannot pull it from under an evaluation.
"""

import collections
import errno
import logging
import os
import re

import tensorflow as tf

from cifar10_towers.common import errors
from cifar10_towers.runtime import config as config_lib

logger = logging.getLogger(__name__)

LEGACY = 'legacy'  # tf.compat.v1 Saver: keys are variable names, e.g. 'conv1/weights'
MODERN = 'modern'  # tf.train.Checkpoint: keys like 'model/conv1/weights/.ATTRIBUTES/...'
OBJECT_GRAPH_KEY = '_CHECKPOINTABLE_OBJECT_GRAPH'  # only object-based checkpoints have it


class CheckpointError(errors.Failure):
  """A checkpoint is missing or unreadable; the message says which and what to do."""


Contents = collections.namedtuple('Contents', [
    'path',  # the checkpoint prefix, e.g. '<train_dir>/model.ckpt-1000'
    'kind',  # LEGACY or MODERN
    'tensors',  # dict checkpoint key -> numpy value: every tensor, checksums checked
])


STATE_FILE = 'checkpoint'  # TensorFlow's checkpoint state file in a train_dir
_BASENAME = config_lib.CHECKPOINT_BASENAME  # checkpoints are <train_dir>/model.ckpt-<step>
_VALUE_SUFFIX = '/.ATTRIBUTES/VARIABLE_VALUE'  # of object-based keys


def step_of(path):
  """The global step in a checkpoint prefix's name (`model.ckpt-1000`), or None."""
  match = re.search(r'-(\d+)$', path)
  return int(match.group(1)) if match else None


def global_step(contents):
  """The global step a checkpoint holds (int), else the one in its name, else None.

  Upstream's float32 `global_step` is read as the int it counts.
  """
  for key in ('global_step', 'global_step' + _VALUE_SUFFIX):
    if key in contents.tensors:
      return int(round(float(contents.tensors[key])))
  return step_of(contents.path)


def reason(error):
  """The first line of a TensorFlow error, without its op decorations."""
  text = getattr(error, 'message', None) or str(error)
  if 'Original error:' in text:  # the Saver's restore wraps the cause
    text = text.split('Original error:', 1)[1]
  lines = [line.strip() for line in text.splitlines() if line.strip()]
  if lines and lines[0].startswith('Graph execution error'):
    # A Session's error: the cause follows the "Node: '<name>'" line.
    nodes = [i for i, line in enumerate(lines) if line.startswith('Node: ')]
    lines = lines[nodes[-1] + 1:] if nodes else lines[1:]
  text = lines[0] if lines else type(error).__name__
  text = re.sub(r'\s*\[Op:\w+\]$', '', text)  # eager's op name
  text = re.sub(r'^\{\{function_node [^}]*\}\}\s*', '', text)
  # 'TensorBundle at <prefix> shard 0 (19200 bytes): Checksum does not match'
  return re.sub(r'^TensorBundle at \S+ shard \d+ \(\d+ bytes\): ', '', text)


GONE = 'gone'  # the start of the problem of a checkpoint none of whose files is left


def _size(path):
  try:
    return tf.io.gfile.stat(path).length
  except (tf.errors.OpError, OSError):
    return None


def _read(path):
  """Every tensor of a checkpoint, or what is wrong with its files.

  Returns:
    (Contents, None) when every file is there and every checksum right, else
    (None, problem): 'gone (...)', 'incomplete: ...' or 'damaged (...)',
    naming the file at fault where the reader's error tells which.
  """
  # Own code: tf.train.load_checkpoint alone names neither the file at fault
  # nor what is wrong with it (test_faults_state.py: the DAMAGES of `latest`).
  name = os.path.basename(path)
  data_files = sorted(tf.io.gfile.glob(path + '.data-?????-of-?????'))
  index_size = _size(path + '.index')
  if index_size is None:
    return None, ('incomplete: %s.index is missing' % name if data_files
                  else '%s (no %s.index or .data file is left)' % (GONE, name))
  if index_size == 0:
    return None, 'damaged (%s.index is empty)' % name
  if not data_files:
    return None, 'incomplete: %s.index has no .data file' % name
  try:
    reader = tf.train.load_checkpoint(path)
    # get_tensor checks the CRC32C of each tensor's bytes.
    tensors = {key: reader.get_tensor(key)
               for key in sorted(reader.get_variable_to_shape_map())}
  except IndexError:
    # The reader's 'Read less bytes than requested': a .data file ends early.
    sizes = {os.path.basename(f): _size(f) for f in data_files}
    empty = [f for f, size in sizes.items() if size == 0]
    if empty:
      return None, 'damaged (%s is empty)' % empty[0]
    if len(sizes) > 1:
      return None, 'damaged (a .data file of %s is truncated)' % name
    return None, ('damaged (%s is truncated: %s bytes, a tensor reaches past its end)'
                  % next(iter(sizes.items())))
  except (tf.errors.OpError, ValueError, RuntimeError, UnicodeDecodeError) as e:
    text = reason(e)
    if 'sstable' in text:  # the index is a LevelDB table
      text = '%s.index is not a checkpoint index: %s' % (name, text)
    return None, 'damaged (%s)' % text
  return Contents(path, MODERN if OBJECT_GRAPH_KEY in tensors else LEGACY, tensors), None


def _is_gone(problem):
  return problem is not None and problem.startswith(GONE)


def read(path):
  """Reads every tensor of a checkpoint, so that each one's checksum is checked.

  Args:
    path: a checkpoint prefix, e.g. '<train_dir>/model.ckpt-1000'.

  Returns:
    Contents: the checkpoint whole, in memory.

  Raises:
    CheckpointError: a file is missing, truncated or fails its checksum; the
      message names the checkpoint and the first problem.
  """
  contents, problem = _read(path)
  if problem:
    raise CheckpointError('checkpoint %s is %s' % (path, problem))
  return contents


def _on_disk(directory):
  """{step: prefix} of the checkpoints with an .index file in `directory`.

  The state file's all_model_checkpoint_paths lists only the named ones; a
  complete one a killed run did not get to name is found here
  (test_faults_checkpoints.py: complete_checkpoint_not_yet_named).
  """
  indexes = tf.io.gfile.glob(os.path.join(directory, _BASENAME + '-*.index'))
  prefixes = [index[:-len('.index')] for index in indexes]
  return {step_of(prefix): prefix for prefix in prefixes if step_of(prefix) is not None}


def _delete(path):
  """Removes a file or a directory tree; True if it did."""
  try:
    (tf.io.gfile.rmtree if tf.io.gfile.isdir(path) else tf.io.gfile.remove)(path)
    return True
  except (tf.errors.OpError, OSError):
    return False


def _remove_temp_files(directory):
  """Removes the temp files of saves a kill interrupted; they are never read.

  Only TensorFlow's own temp names of this train_dir's checkpoints:
  `<basename>-<step>.*.tempstate<digits>` and `<basename>-<step>_temp/`
  (test_faults_checkpoints.py: incomplete_newer_checkpoint).
  """
  pattern = re.compile(r'^%s-\d+(\..*\.tempstate\d+|_temp)$' % re.escape(_BASENAME))
  removed = sum(_delete(os.path.join(directory, name.rstrip('/')))
                for name in tf.io.gfile.listdir(directory) if pattern.match(name.rstrip('/')))
  if removed:
    logger.warning('removed %d temp file(s) of an interrupted save from %s.', removed,
                   directory)


def _state(directory):
  """TensorFlow's CheckpointState of `directory`, or why its state file is unreadable.

  Returns:
    (CheckpointState or None, problem or None): (None, None) when there is no
    state file; problem says why an existing one is unreadable (what a crash
    or a hand can leave: empty, not text, torn).
  """
  # tf.train.get_checkpoint_state raises on an empty or non-text file, without
  # saying which (test_faults_state.py: state_empty, state_not_text).
  path = os.path.join(directory, STATE_FILE)
  if not tf.io.gfile.exists(path):
    return None, None
  if _size(path) == 0:
    return None, 'it is empty'
  try:
    state = tf.train.get_checkpoint_state(directory)
  except UnicodeDecodeError:
    return None, 'it is not text'
  except (ValueError, tf.errors.OpError):  # parsed, but names no checkpoint
    state = None
  if state is None or not state.model_checkpoint_path:
    return None, 'it is not a checkpoint state file'
  return state, None


def resume_point(directory):
  """The checkpoint a run in `directory` resumes from: the newest intact one.

  See the module docstring. Every tensor of the chosen checkpoint is read
  once, so a damaged one is found here and not halfway through a restore.

  Args:
    directory: str, a train_dir.

  Returns:
    str, a checkpoint prefix inside `directory`, or None for a fresh start.

  Raises:
    CheckpointError: the checkpoint the state file names is damaged or
      incomplete, or gone with no intact one left; the message names it, the
      newest intact older one, and what to do. No checkpoint file is changed
      (only the temp files of an interrupted save are removed, as on every
      call).
  """
  if not tf.io.gfile.isdir(directory):
    return None
  _remove_temp_files(directory)
  found = newest_intact(directory)
  fallback = found.contents and found.contents.path
  named, problem = found.named, dict(found.skipped).get(found.named)
  if found.state_problem:
    logger.warning('%s is unreadable; resuming from the newest intact checkpoint found '
                   'on disk.', os.path.join(directory, STATE_FILE))
  elif named is None and (fallback or found.skipped):
    logger.warning('%s has checkpoints but no `%s` state file; resuming from the newest '
                   'intact one found on disk.', directory, STATE_FILE)
  # Newer than the named one (or, with none named, any): left by an interrupted save.
  for prefix, reason_ in found.unfinished + found.skipped:
    if prefix == named:
      break
    logger.warning('ignoring %s: it is %s, left by an interrupted save; it will be '
                   'overwritten.', prefix, reason_)
  if problem is None:
    if named and fallback != named:
      logger.warning('%s is complete but was not yet recorded as the latest checkpoint '
                     '(the run writing it was interrupted); resuming from it.', fallback)
    return fallback
  name = os.path.basename(named)
  if _is_gone(problem) and fallback is not None:
    # Deleted by hand, e.g. to go back to an older checkpoint: nothing of it
    # is left to protect.
    logger.warning('`%s` names %s as the latest checkpoint, but none of its files is '
                   'left in %s; resuming from %s, the newest intact one.',
                   STATE_FILE, name, directory, os.path.basename(fallback))
    return fallback
  if fallback is None:
    todo = ('there is no intact older checkpoint; use another --train_dir, or move %s.* and '
            '`%s` out of %s to start from scratch' % (name, STATE_FILE, directory))
  else:
    todo = ('the newest intact one is %s: to resume from it, move %s.* and `%s` out of %s; '
            'or use another --train_dir'
            % (os.path.basename(fallback), name, STATE_FILE, directory))
  raise CheckpointError('checkpoint %s is %s, and it is the latest checkpoint; %s.'
                        % (named, problem, todo))


def replace_unreadable_state(directory, prefix):
  """Rewrites an unreadable `checkpoint` state file to name `prefix`; True if it did.

  For a trainer about to resume from `prefix` (None: to start from scratch)
  whose checkpoint manager reads the state file before its first save
  (modern's CheckpointManager raises on an empty or non-text one:
  test_faults_state.py, test_train with state_empty / state_not_text). That save
  rewrites the file anyway; this only does it first: naming `prefix`, or,
  without one, removing the file. A readable state file is left alone.
  """
  if _state(directory)[1] is None:
    return False
  if prefix is None:
    tf.io.gfile.remove(os.path.join(directory, STATE_FILE))
  else:
    name = os.path.basename(prefix)
    tf.compat.v1.train.update_checkpoint_state(directory, name, [name])
  return True


Found = collections.namedtuple('Found', [
    'contents',  # Contents of the newest intact checkpoint, or None
    'skipped',  # [(prefix, problem)] newest first: the named one, or older, not intact
    'unfinished',  # [(prefix, problem)]: newer than the named one, not intact
    'state_problem',  # why the `checkpoint` state file is unreadable, or None
    'named',  # the prefix the state file names, or None
])


def newest_intact(directory):
  """The newest intact checkpoint of `directory`, read whole, and what was passed over.

  Reads only; changes nothing. The candidates are what the state file names
  and every `<basename>-<step>.index` on disk, newest step first, as for
  `resume_point`: a complete checkpoint newer than the named one (saved,
  not yet named) counts; an incomplete one there is `unfinished` (a save in
  progress, or an interrupted one). A checkpoint that vanishes while this
  looks (deleted by the trainer's max_to_keep) is passed over silently,
  unless it is the named one.

  Args:
    directory: str, a train_dir of either trainer.

  Returns:
    Found.
  """
  if not tf.io.gfile.isdir(directory):
    return Found(None, [], [], None, None)
  on_disk = _on_disk(directory)
  # Upstream's Saver records absolute paths; the checkpoint is looked up by its
  # base name in `directory`, so a copied or moved train_dir resumes from its own
  # files (test_faults_checkpoints.py: state_file_of_a_moved_directory).
  state, state_problem = _state(directory)
  named = state and os.path.join(directory, os.path.basename(state.model_checkpoint_path))
  named_step = step_of(named) if named else None
  candidates = [on_disk[s] for s in sorted(on_disk, reverse=True)]
  if named is not None and named not in candidates:
    later = [p for p in candidates if named_step is None or step_of(p) > named_step]
    candidates.insert(len(later), named)
  skipped, unfinished = [], []
  for prefix in candidates:
    contents, problem = _read(prefix)
    if contents is not None:
      return Found(contents, skipped, unfinished, state_problem, named)
    if _is_gone(problem) and prefix != named:
      continue
    if named_step is not None and prefix != named and step_of(prefix) > named_step:
      unfinished.append((prefix, problem))
    else:
      skipped.append((prefix, problem))
  return Found(None, skipped, unfinished, state_problem, named)


def skip_notes(found, directory, doing, unfinished=True):
  """One line for each thing `newest_intact` passed over, for stderr.

  Args:
    found: Found.
    directory: str, the train_dir.
    doing: str, what happens instead, e.g. 'evaluating the newest intact
      checkpoint'.
    unfinished: bool, also note the unfinished newer checkpoints (an
      ongoing save's, which a loop beside a trainer leaves unsaid).

  Returns:
    list of str.
  """
  notes = []
  if found.state_problem:
    notes.append('%s is unreadable (%s); %s found on disk.'
                 % (os.path.join(directory, STATE_FILE), found.state_problem, doing))
  notes += ['skipping %s: it is %s, and newer than the latest checkpoint `%s` names (a save '
            'in progress or interrupted).' % (prefix, problem, STATE_FILE)
            for prefix, problem in (found.unfinished if unfinished else [])]
  for prefix, problem in found.skipped:
    why = ('`%s` names it as the latest checkpoint, but it is %s' % (STATE_FILE, problem)
           if _is_gone(problem) else 'it is %s' % problem)
    notes.append('skipping %s: %s; %s.' % (prefix, why, doing))
  return notes


def for_conversion(directory):
  """The checkpoint `convert` converts: the latest, which must be intact.

  Unlike eval, convert passes over nothing that the state file (or its
  damage) says is the latest: it refuses, and says what to move to convert
  the newest intact one instead.

  Args:
    directory: str, a train_dir of either trainer.

  Returns:
    Contents, or None when `directory` holds no checkpoint at all.

  Raises:
    CheckpointError: the state file is unreadable, or the latest checkpoint
      is damaged, incomplete or gone; one line naming the file and what to do.
  """
  found = newest_intact(directory)
  intact = found.contents.path if found.contents else None
  if found.state_problem or found.skipped:
    moved = '`%s`' % STATE_FILE
    if found.state_problem:
      what = '%s is unreadable (%s)' % (os.path.join(directory, STATE_FILE), found.state_problem)
    else:
      prefix, problem = found.skipped[0]
      what = 'checkpoint %s is %s, and it is the latest checkpoint' % (prefix, problem)
      if not _is_gone(problem):
        moved = '%s.* and %s' % (os.path.basename(prefix), moved)
    todo = ('The newest intact checkpoint is %s: to convert it, move %s out of %s and run '
            'again.' % (os.path.basename(intact), moved, directory) if intact
            else 'No intact checkpoint is left in %s.' % directory)
    raise CheckpointError('%s; nothing was converted. %s' % (what, todo))
  for prefix, problem in found.unfinished:
    logger.warning('ignoring %s: it is %s, left by an interrupted save.', prefix, problem)
  if intact and found.named is None:
    logger.warning('%s has no `%s` state file; converting %s, the newest intact '
                   'checkpoint found on disk.', directory, STATE_FILE, os.path.basename(intact))
  return found.contents


def check_fits(path, expected_shapes):
  """Checks that a checkpoint holds every expected variable with its shape.

  Args:
    path: a checkpoint prefix.
    expected_shapes: dict checkpoint key -> shape (tuple of ints).

  Raises:
    CheckpointError: a key is missing or has another shape; the message
      names the first such variable, e.g. a checkpoint of another model.
  """
  try:
    saved = tf.train.load_checkpoint(path).get_variable_to_shape_map()
  except (tf.errors.OpError, ValueError) as e:
    raise CheckpointError('cannot read checkpoint %s (%s)'
                          % (path, reason(e))) from e
  missing = [k for k in expected_shapes if k not in saved]
  wrong = [k for k in expected_shapes
           if k in saved and tuple(saved[k]) != tuple(expected_shapes[k])]
  readable = lambda key: key[:-len(_VALUE_SUFFIX)] if key.endswith(_VALUE_SUFFIX) else key
  if wrong:
    what = ('it holds %s with shape %s, this model has %s (%d variable(s) differ)'
            % (readable(wrong[0]), list(saved[wrong[0]]), list(expected_shapes[wrong[0]]),
               len(wrong)))
  elif missing:
    what = ('it lacks %s (%d of this model\'s %d variables are missing)'
            % (readable(missing[0]), len(missing), len(expected_shapes)))
  else:
    return
  raise CheckpointError('%s is a checkpoint of another model: %s. Use another --train_dir, '
                        'or move its checkpoints away.' % (path, what))


def advice(cause):
  """What to do about a failed write, from how the operating system worded its `cause`."""
  if any(text in cause for text in ('Permission denied', 'Operation not permitted',
                                    'Read-only file system')):
    return 'Make it writable'
  if any(text in cause for text in ('No space left on device', 'Disk quota exceeded',
                                    'File too large')):
    return 'Free space on that disk'
  return 'Move the file in the way' if os.strerror(errno.ENOTDIR) in cause else 'Fix that'


def write_failed(directory, what, error):
  """The CheckpointError for a write into train_dir that failed (e.g. disk full).

  Args:
    directory: str, the train_dir.
    what: str, what could not be written, e.g. 'checkpoint model.ckpt-20'.
    error: the exception the writer raised.

  Returns:
    CheckpointError, for the caller to raise: the cause and what to do about
    it. What the run kept is said by the one ending path (runtime.ending).
  """
  cause = reason(error).rsplit('; ', 1)[-1]
  return CheckpointError('could not write %s in %s (%s). %s, or pass another '
                         '--train_dir.' % (what, directory, cause, advice(cause)))


def save_failed(directory, step, error):
  """The CheckpointError for a failed save of `step`; removes its partial files.

  Only files of that one step (`*.tempstate*`, `<basename>-<step>_temp/`, an
  unnamed `.index`/`.data-*` pair), and only when the state file does not name
  it and is readable (or absent), as test_faults_checkpoints.py's full-disk
  tests check. Returns the error for the caller to raise (see `write_failed`).
  """
  name = '%s-%d' % (_BASENAME, step)
  state, problem = _state(directory)
  named = [state.model_checkpoint_path, *state.all_model_checkpoint_paths] if state else []
  if problem is None and name not in map(os.path.basename, named):
    prefix = os.path.join(directory, name)
    for path in tf.io.gfile.glob(prefix + '.*') + tf.io.gfile.glob(prefix + '_temp'):
      _delete(path)
  return write_failed(directory, 'checkpoint ' + name, error)
