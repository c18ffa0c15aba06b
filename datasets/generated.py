"""Generated data is labelled as such, so no command reports it as CIFAR-10.

`data synth` and `data digits` (`datasets.synth.generate`,
`datasets.digits.convert_digits`) write `cifar-10-batches-bin/GENERATED.json`
with the .bin files, inside the same staged swap, so a data set and its label
appear together or not at all. It names the generator ('synth' or 'digits')
and its version (a new version writes other bytes for the same command), the
command that rewrites the same bytes, the seed and the parameters, and when
it was written. Data without it is taken for CIFAR-10 (or the user's
own): `data download` says CIFAR-10 is present only then, and the generators
replace it only with --force. No TensorFlow here.
"""

import datetime
import json
import os
import pathlib
import shlex

from cifar10_towers.common import cifar10_format as fmt
from cifar10_towers.common import prog

# What the commands that label generated data add: the figure to compare with.
CIFAR10_RESULT = ('on CIFAR-10 the original trainer reaches ~86% precision @ 1 '
                  'after 100K steps')


def marker_path(data_dir):
  """`<data_dir>/cifar-10-batches-bin/GENERATED.json`."""
  return os.path.join(fmt.batches_dir(data_dir), fmt.GENERATED_FILE)


def write_set(data_dir, files, needed_bytes, class_names, mark, generator, version, **params):
  """Writes a generated data set as `<data_dir>/cifar-10-batches-bin/`, marked.

  The files are written aside and replace an existing directory's files all
  at once (`cifar10_format.staged_batches_dir`): an interrupted or failed run
  changes nothing.

  Args:
    data_dir: str, the data directory (created if missing).
    files: iterable of (file name, images uint8 [N, 32, 32, 3], labels [N]),
      each made when it is written.
    needed_bytes: int, the size of the .bin files.
    class_names: the names, in label order, for `batches.meta.txt` (one a line).
    mark: bool, write GENERATED.json; False only for data that stands in
      for CIFAR-10 (the tests' fixtures), which no command will label.
    generator: 'synth' or 'digits'.
    version: int, the generator's version: the same args write other bytes
      under another version.
    **params: everything the set depends on besides the version, recorded as
      is (JSON values): the command's flags after `--data_dir D`, with which
      `data <generator>` writes the same bytes.

  Returns:
    dict file name -> number of records written.

  Raises:
    common.cifar10_format.DataError: the disk is full or read-only, or
      cifar-10-batches-bin is a file; nothing was changed.
  """
  counts = {}
  with fmt.staged_batches_dir(data_dir, needed_bytes) as out_dir:
    for name, images, labels in files:
      fmt.write_records(os.path.join(out_dir, name), images, labels)
      counts[name] = len(labels)
    pathlib.Path(out_dir, fmt.META_FILE).write_text('\n'.join(class_names) + '\n')
    if mark:
      write_marker(out_dir, generator, version, data_dir, **params)
  return counts


def write_marker(directory, generator, version, data_dir, **params):
  """Writes GENERATED.json into `directory` (a staging directory); see `write_set`."""
  command_args = shlex.join(['data', generator, '--data_dir', data_dir] + [
      arg for name, value in params.items() for arg in (f'--{name}', f'{value}')])
  info = {
      'generator': generator,
      'version': version,
      'args': command_args,  # without the program: see `command`
      'command': prog.command(command_args),
      'params': params,
      'written': datetime.datetime.now(datetime.timezone.utc).isoformat(
          timespec='seconds'),
  }
  pathlib.Path(directory, fmt.GENERATED_FILE).write_text(
      json.dumps(info, indent=2, sort_keys=True) + '\n')


def read(data_dir):
  """The marker of `data_dir`'s data set, or None when it has none.

  Returns:
    dict with at least 'generator' (str; 'unknown' when the file is there but
    unreadable or not this format: it still says the data is generated),
    'what' (what every message calls the set: 'generated data (synth)') and
    'command' (the command that rewrites the set, for the program as run now).
  """
  path = marker_path(data_dir)
  if not os.path.lexists(path):
    return None
  try:
    info = json.loads(pathlib.Path(path).read_text(encoding='utf-8'))
  except (OSError, ValueError):
    info = None
  if not isinstance(info, dict):
    info = {}
  if not isinstance(info.get('generator'), str) or not info['generator']:
    info['generator'] = 'unknown'
  args = info.get('args')
  if not isinstance(args, str) or not args:
    args = shlex.join(['data', info['generator'], '--data_dir', data_dir])
  info.update(what=f"generated data ({info['generator']})", command=prog.command(args))
  return info


def holds_data(data_dir):
  """True when cifar-10-batches-bin/ holds any of the six data files."""
  d = fmt.batches_dir(data_dir)
  return any(os.path.lexists(os.path.join(d, name)) for name in fmt.DATA_FILES)
