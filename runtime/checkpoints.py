"""Telling the two trainers' checkpoints apart, and finding the newest intact one.

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
complete one a killed run wrote but did not get to name - and skips
incomplete newer files (they are overwritten when that step is saved again);
the temp files of an interrupted save are removed.
Our own code, because tf.train.latest_checkpoint alone would name a damaged
checkpoint, miss a complete unnamed one and fail on a damaged state file:
tests/test_faults_state.py (test_train, test_eval, test_convert_refuses) and
tests/test_faults_checkpoints.py (test_resume_from_the_newest_intact_checkpoint).
A checkpoint the state file names was complete when it was named, so if it
cannot be read now, something else damaged it (the disk, a copy, a hand):
training then stops with an error naming it and the newest intact older
checkpoint, and changes nothing, rather than silently training over the
evidence. A named checkpoint whose files are all gone (deleted by hand)
leaves nothing to protect: training resumes from the newest intact older one
and says so.

Both trainers save through `StepSaver`, which removes a failed save's partial
files (and writes nothing into a train_dir removed under the run); each trainer
gives it only its own write.

Every way a checkpoint's files can be damaged (empty, truncated, bit-flipped,
missing) is one fault here: TensorFlow's reader fails, and its reason is said.

Both trainers resume through `resume`: that checkpoint, refused if the
other trainer wrote it (`other_trainers`, naming the convert command), if
another optimizer did, or if another model's variables are in it (`misfit`,
which eval and convert check with too); each trainer loads what it hands back.

Eval and convert read (`newest_intact`) without changing anything: eval
evaluates the newest intact checkpoint and says which it skipped; convert
refuses a train_dir whose latest checkpoint or state file is damaged
(`for_conversion`). A checkpoint is read whole into memory, with every
checksum checked (`read`), so a trainer deleting it meanwhile (max_to_keep)
cannot pull it from under an evaluation.
"""

import collections
import logging
import os
import re
import threading

import tensorflow as tf

from cifar10_towers.common import errors
from cifar10_towers.common import files
from cifar10_towers.common import optimizer as optimizer_lib
from cifar10_towers.common import prog
from cifar10_towers.runtime import config as config_lib
from cifar10_towers.runtime import lock

logger = logging.getLogger(__name__)
gfile = tf.io.gfile  # checkpoints' files, on any of TensorFlow's file systems

LEGACY = 'legacy'  # tf.compat.v1 Saver: keys are variable names, e.g. 'conv1/weights'
MODERN = 'modern'  # tf.train.Checkpoint: keys like 'model/conv1/weights/.ATTRIBUTES/...'
OBJECT_GRAPH_KEY = '_CHECKPOINTABLE_OBJECT_GRAPH'  # only object-based checkpoints have it
_FORMATS = {LEGACY: 'tf.compat.v1 Saver', MODERN: 'tf.train.Checkpoint'}


class CheckpointError(errors.Failure):
  """A checkpoint is missing or unreadable; the message says which and what to do."""


Contents = collections.namedtuple('Contents', [
    'path',  # the checkpoint prefix, e.g. '<train_dir>/model.ckpt-1000'
    'kind',  # LEGACY or MODERN
    'tensors',  # dict checkpoint key -> numpy value: every tensor, checksums checked
])

Found = collections.namedtuple('Found', [
    'contents',  # Contents of the newest intact checkpoint, or None
    'skipped',  # [(prefix, problem)] newest first: the named one, or older, not intact
    'unfinished',  # [(prefix, problem)]: newer than the named one, not intact
    'state_problem',  # 'unreadable' when the `checkpoint` state file is, else None
    'named',  # the prefix the state file names, or None
])

STATE_FILE = 'checkpoint'  # TensorFlow's checkpoint state file in a train_dir
_BASENAME = config_lib.CHECKPOINT_BASENAME  # checkpoints are <train_dir>/model.ckpt-<step>
_VALUE_SUFFIX = '/.ATTRIBUTES/VARIABLE_VALUE'  # of object-based keys
# The problem of a checkpoint none of whose files is left (only the named one is said).
GONE = f'gone (`{STATE_FILE}` names it, but none of its files is left)'


def step_of(path):
  """The global step in a checkpoint prefix's name (`model.ckpt-1000`), or None."""
  match = re.search(r'-(\d+)$', path)
  return int(match[1]) if match else None


def global_step(contents):
  """The global step a checkpoint holds (int), else the one in its name, else None.

  Upstream's float32 `global_step` is read as the int it counts.
  """
  for key in ('global_step', f'global_step{_VALUE_SUFFIX}'):
    if key in contents.tensors:
      return round(float(contents.tensors[key]))  # an int
  return step_of(contents.path)


def reason(error):
  """The first line of a TensorFlow error, without its op decorations."""
  text = getattr(error, 'message', None) or str(error)
  # The Saver's restore wraps the cause; a Session's error says it after its
  # header and the last "Node: '<name>'" line.
  text = re.split(r'Original error:|^\s*(?:Graph execution error:|Node: .*)$', text,
                  flags=re.M)[-1]
  # A traced function's error names the node and where it was defined first.
  text = re.sub(r'^Detected at node .*\n(?:(?:[ \t].*)?\n)*', '', text, flags=re.M)
  text = next((line.strip() for line in text.splitlines() if line.strip()),
              type(error).__name__)
  text = re.sub(r'\s*(\[\[|\[Op:).*', '', text)  # a node's decorations, eager's op name
  text = re.sub(r'^\{\{function_node [^}]*\}\}\s*', '', text)
  # 'TensorBundle at <prefix> shard 0 (19200 bytes): Checksum does not match'
  return re.sub(r'^(TensorBundle at \S+ shard \d+ \(\d+ bytes\)|Unsuccessful '
                r'TensorSliceReader constructor): ', '', text)


def _read(path):
  """(Contents, None) when every file is there and every checksum right, else (None, problem).

  The problem is GONE, or 'damaged (<the reader's reason>)' for any damage.
  """
  try:
    reader = tf.train.load_checkpoint(path)
    # get_tensor checks the CRC32C of each tensor's bytes.
    tensors = {key: reader.get_tensor(key)
               for key in sorted(reader.get_variable_to_shape_map())}
  # ValueError: also UnicodeDecodeError, a subclass. IndexError: the reader's 'Read less bytes
  # than requested' (a .data file ends early).
  except (tf.errors.OpError, ValueError, RuntimeError, IndexError) as e:
    return None, f'damaged ({reason(e)})' if gfile.glob(f'{path}.*') else GONE
  return Contents(path, MODERN if OBJECT_GRAPH_KEY in tensors else LEGACY, tensors), None


def read(path):
  """Reads every tensor of a checkpoint, so that each one's checksum is checked.

  Args:
    path: a checkpoint prefix, e.g. '<train_dir>/model.ckpt-1000'.

  Returns:
    Contents: the checkpoint whole, in memory.

  Raises:
    CheckpointError: a file is missing, truncated or fails its checksum; the
      message names the checkpoint and the reader's reason.
  """
  contents, problem = _read(path)
  if problem:
    raise CheckpointError(f'checkpoint {path} is {problem}')
  return contents


def on_disk(directory):
  """The prefixes of the checkpoints with an .index file in `directory`.

  The state file's all_model_checkpoint_paths lists only the named ones; a
  complete one a killed run did not get to name is found here
  (test_faults_checkpoints.py: complete_checkpoint_not_yet_named).
  """
  return [prefix for index in gfile.glob(os.path.join(directory, f'{_BASENAME}-*.index'))
          if step_of(prefix := index.removesuffix('.index')) is not None]


def _remove(prefix, *suffixes):
  """Removes the files and directory trees `prefix + suffix` matches (globs); how many."""
  removed = 0
  for suffix in suffixes:
    for path in gfile.glob(prefix + suffix):
      try:
        (gfile.rmtree if gfile.isdir(path) else gfile.remove)(path)
        removed += 1
      except (tf.errors.OpError, OSError):
        pass
  return removed


def _state(directory):
  """TensorFlow's CheckpointState of `directory`, and 'unreadable' if its state file is.

  Returns:
    (CheckpointState or None, None or 'unreadable'): (None, None) when there
    is no state file.
  """
  if not gfile.exists(os.path.join(directory, STATE_FILE)):
    return None, None
  try:
    state = tf.train.get_checkpoint_state(directory)
  # It raises on an empty or non-text file (test_faults_state.py: state_empty,
  # state_not_text; UnicodeDecodeError is a ValueError) and returns None for a torn one.
  except (ValueError, tf.errors.OpError):
    state = None
  return (state, None) if state else (None, 'unreadable')


def _refusal(found, directory, do, flag):
  """The CheckpointError of a latest checkpoint (or state file) that cannot be read.

  Args:
    found: Found, with a state_problem or a skipped latest checkpoint.
    directory: str, the train_dir.
    do: str, what the user may do with the newest intact one, e.g. 'convert'.
    flag: str, the flag that names another directory, e.g. '--from_dir'.
  """
  moved = f'`{STATE_FILE}`'
  if found.state_problem:
    what = f'{os.path.join(directory, STATE_FILE)} is unreadable'
  else:
    prefix, problem = found.skipped[0]
    what = f'checkpoint {prefix} is {problem}, and it is the latest checkpoint'
    if problem != GONE:
      moved = f'{os.path.basename(prefix)}.* and {moved}'
  todo = (f'the newest intact one is {os.path.basename(found.contents.path)}: to {do} it, move'
          if found.contents else 'no intact checkpoint is left: move')
  return CheckpointError(f'{what}; {todo} {moved} out of {directory}; or use another {flag}.')


def _say_passed_over(found, directory, doing):
  """Logs what `newest_intact` skipped, and a newest intact checkpoint the state file misses."""
  for note in skip_notes(found, directory, doing):
    logger.warning(note)
  path = found.contents and found.contents.path
  if (path and path != found.named and not found.state_problem
      and found.named not in dict(found.skipped)):
    logger.warning(f'{path} is complete, but `{STATE_FILE}` does not name it (the file is '
                   f'missing, or a run was interrupted as it saved); {doing}.')


def resume_point(directory):
  """The checkpoint a run in `directory` resumes from: the newest intact one.

  See the module docstring. Every tensor of the chosen checkpoint is read
  once, so a damaged one is found here and not halfway through a restore.

  Args:
    directory: str, a train_dir.

  Returns:
    str, a checkpoint prefix inside `directory`, or None for a fresh start.

  Raises:
    CheckpointError: the checkpoint the state file names is damaged, or
      gone with no intact one left; the message names it, the newest intact
      older one, and what to do. No checkpoint file is changed (only the
      temp files of an interrupted save are removed, as on every call).
  """
  # The temp files of saves a kill interrupted are never read: removed, only
  # TensorFlow's own temp names of this train_dir's checkpoints,
  # `<basename>-<step>.*.tempstate*` and `<basename>-<step>_temp/`
  # (test_faults_checkpoints.py: incomplete_newer_checkpoint).
  if removed := _remove(os.path.join(directory, f'{_BASENAME}-*'), '.tempstate*', '_temp'):
    logger.warning(f'removed {removed} temp file(s) of an interrupted save from {directory}.')
  found = newest_intact(directory)
  problem = dict(found.skipped).get(found.named)
  # Gone (deleted by hand, e.g. to go back to an older checkpoint): nothing of it to protect.
  if problem and (problem != GONE or found.contents is None):
    raise _refusal(found, directory, 'resume from', '--train_dir')
  _say_passed_over(found, directory, 'resuming from the newest intact checkpoint')
  return found.contents and found.contents.path


def replace_unreadable_state(directory, prefix):
  """Rewrites an unreadable `checkpoint` state file to name `prefix`.

  For a trainer about to resume from `prefix` (None: to start from scratch)
  whose checkpoint manager reads the state file before its first save
  (modern's CheckpointManager raises on an empty or non-text one:
  test_faults_state.py, test_train with state_empty / state_not_text). That save
  rewrites the file anyway; this only does it first: naming `prefix`, or,
  without one, removing the file. A readable state file is left alone.
  """
  if not _state(directory)[1]:  # readable, or absent
    return
  if prefix is None:
    gfile.remove(os.path.join(directory, STATE_FILE))
  else:
    name = os.path.basename(prefix)
    tf.compat.v1.train.update_checkpoint_state(directory, name, [name])


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
  # Upstream's Saver records absolute paths; the checkpoint is looked up by its
  # base name in `directory`, so a copied or moved train_dir resumes from its own
  # files (test_faults_checkpoints.py: state_file_of_a_moved_directory).
  state, state_problem = _state(directory)
  named = state and os.path.join(directory, os.path.basename(state.model_checkpoint_path))
  named_step = named and step_of(named)
  contents, skipped, unfinished = None, [], []
  for prefix in sorted({*on_disk(directory), named} - {None}, key=lambda p: step_of(p) or 0,
                       reverse=True):
    contents, problem = _read(prefix)
    if contents:
      break
    if prefix == named or problem != GONE:
      newer = named_step is not None and step_of(prefix) > named_step  # never the named one
      (unfinished if newer else skipped).append((prefix, problem))
  return Found(contents, skipped, unfinished, state_problem, named)


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
  notes = ([f'{os.path.join(directory, STATE_FILE)} is unreadable; {doing} found on disk.']
           if found.state_problem else [])
  newer = [(prefix, f'{problem}, newer than the latest checkpoint (a save in progress or '
            'interrupted)') for prefix, problem in (found.unfinished if unfinished else [])]
  return notes + [f'skipping {prefix}: it is {problem}; {doing}.'
                  for prefix, problem in newer + found.skipped]


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
      is damaged or gone; one line naming the file and what to do.
  """
  found = newest_intact(directory)
  if found.state_problem or found.skipped:
    raise _refusal(found, directory, 'convert', '--from_dir')
  _say_passed_over(found, directory, 'converting the newest intact checkpoint')
  return found.contents


def resume(directory, kind, optimizer, shapes, error, key=str):
  """What a run of trainer `kind` resumes from: the newest intact checkpoint, checked.

  Both trainers' one resume path: `resume_point`, read whole (`read`), then
  refused if the other trainer (or upstream's script) wrote it
  (`other_trainers`), if another optimizer did, or if it is another model's.
  The trainer loads what it gets back its own way.

  Args:
    directory: str, the train_dir.
    kind: LEGACY or MODERN, the resuming trainer.
    optimizer: str, the run's optimizer ('sgd', 'momentum', 'adam').
    shapes: dict legacy name -> shape (tuple of ints) of everything it restores.
    error: the errors.Failure class of a refusal of the other trainer's or
      another optimizer's checkpoint (runtime.training.TrainingError, which
      this module cannot import: runtime.training imports it).
    key: callable legacy name -> the checkpoint's key for it
      (modern.checkpoints.checkpoint_key for modern).

  Returns:
    Contents, or None for a fresh start.

  Raises:
    CheckpointError: see `resume_point`; or a variable is missing or has
      another shape: the message names the first such, e.g. a checkpoint of
      another model.
    error: it is the other trainer's, or another optimizer's.
  """
  path = resume_point(directory)
  contents = path and read(path)
  if not contents:
    return None
  if contents.kind != kind:
    raise error(other_trainers(contents, directory))
  # Before the shapes: an SGD checkpoint lacks Adam's slots, which is not
  # another model but another optimizer; an Adam checkpoint resumed with SGD
  # would lose its slots silently.
  if refusal := optimizer_lib.mismatch(path, optimizer_lib.of_names(contents.tensors, key),
                                       optimizer):
    raise error(refusal)
  if problem := misfit(contents, shapes, key):
    raise CheckpointError(f'{path} is a checkpoint of another model: {problem[0]} ({problem[1]} of '
                          f'the {len(shapes)} variables differ). Use another --train_dir, or '
                          'move its checkpoints away.')
  return contents


def misfit(contents, shapes, key=str):
  """How a checkpoint differs from the variables a model needs, or None when it holds them all.

  Args:
    contents: Contents.
    shapes: dict name -> shape (a sequence of ints) of each variable needed.
    key: callable name -> the checkpoint's key for it.

  Returns:
    (what, count): what is 'it holds <name> with shape [..], this model has
    [..]' for the first variable of another shape, else 'it lacks <name>' for
    the first one missing; count how many of `shapes` differ. Or None.
  """
  held = {name: contents.tensors.get(key(name)) for name in shapes}
  differ = [name for name in shapes
            if list(getattr(held[name], 'shape', [-1])) != list(shapes[name])]
  if differ:
    name = min(differ, key=lambda n: held[n] is None)  # a wrong shape first
    return (f'it lacks {name}' if held[name] is None else f'it holds {name} with shape '
            f'{list(held[name].shape)}, this model has {list(shapes[name])}'), len(differ)


def other_trainers(contents, directory):
  """The one refusal of a checkpoint the other trainer (or upstream's script) wrote: convert it.

  Args:
    contents: Contents, read from `directory`.
    directory: str, the train_dir as the user named it.

  Returns:
    str, one line naming the `convert` command that makes it the resuming
    trainer's (the other kind than `contents.kind`).
  """
  trainer = LEGACY if contents.kind == MODERN else MODERN
  step = contents.tensors.get('global_step')
  what = ('a checkpoint of the upstream script (float32 global_step)'
          if step is not None and step.dtype.kind == 'f' else
          f'a {contents.kind} ({_FORMATS[contents.kind]}) checkpoint')
  own = " and upstream's" if trainer == LEGACY else ''
  return (f'{contents.path} is {what}; the {trainer} trainer resumes only its own checkpoints'
          f'{own}. Convert it (`{prog.convert_command(directory, trainer)}`) and train with '
          f'--train_dir {prog.converted_dir(directory, trainer)}, or use another --train_dir, or '
          f'train this one with the {contents.kind} trainer.')


def write_failed(directory, what, error, flag='--train_dir'):
  """The CheckpointError for a write into a train_dir that failed (e.g. disk full).

  Args:
    directory: str, the train_dir.
    what: str, what could not be written, e.g. 'checkpoint model.ckpt-20'.
    error: the exception the writer raised (TensorFlow's or the OS's).
    flag: str, the flag that names another directory.

  Returns:
    CheckpointError, for the caller to raise: the cause and what to do about
    it (`common.files.write_failed`). What the run kept is said by the one
    ending path (runtime.ending).
  """
  return CheckpointError(files.write_failed(what, directory, reason(error).rsplit('; ', 1)[-1],
                                            flag))


class StepSaver:
  """Both trainers' one save path: `<directory>/model.ckpt-<step>`, at most once per global step.

  Calling it saves the current global step unless that step is saved
  already, and returns the checkpoint's path. Each trainer gives only its own
  TensorFlow write, `write(step)`: legacy's Saver, modern's CheckpointManager.
  Both name a checkpoint latest only after writing it whole (see the module
  docstring), so a failed write (e.g. disk full) leaves the previous one in
  place; it is a one-line CheckpointError, and the partial files of that one
  step (`*.tempstate*`, `<basename>-<step>_temp/`, an unnamed `.index`/`.data-*`
  pair) are removed, only when the state file does not name it and is
  readable (or absent), as test_faults_checkpoints.py's full-disk tests
  check. Nothing is written if the directory, locked by this process, was
  removed under it (`runtime.lock.LockError`). Safe to call from another
  thread (the multiworker watchdog saves while the main thread waits for the
  peers).

  Args:
    directory: str, where this process writes its checkpoints.
    global_step: callable() -> int, the global step the variables hold now.
    write: callable(step), writes the checkpoint `<prefix>-<step>`.

  Attributes:
    prefix: str, `<directory>/model.ckpt`, the path of every checkpoint less its `-<step>`.
    last_saved: int, the global step of the newest checkpoint written or
      resumed from, or None.
  """

  def __init__(self, directory, global_step, write, last_saved=None):
    self.directory, self.global_step, self.write, self.last_saved = (
        directory, global_step, write, last_saved)
    self.prefix = os.path.join(directory, _BASENAME)  # of every checkpoint's path
    self._lock = threading.Lock()

  def __call__(self):
    with self._lock:
      step = self.global_step()
      path = f'{self.prefix}-{step}'
      name = os.path.basename(path)
      if step != self.last_saved:
        lock.check(self.directory)
        try:
          self.write(step)
        except (tf.errors.OpError, OSError) as e:
          state, problem = _state(self.directory)
          named = [state.model_checkpoint_path, *state.all_model_checkpoint_paths] if state else []
          if problem is None and name not in map(os.path.basename, named):
            _remove(path, '.*', '_temp')
          raise write_failed(self.directory, f'checkpoint {name}', e) from e
        self.last_saved = step
      return path
