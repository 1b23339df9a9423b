"""The one place where the package creates, replaces or deletes a file (docs/files.md states the guarantees).

Three kinds of path meet the package:

- **inputs** (caption files, images, score files, saved fits): read with :func:`open_input` /
  :func:`read_input`, regular files only and opened non-blocking, so a FIFO or a device given as a file never
  hangs a run;
- **outputs the user names** (``--out``, ``--json``, a saved fit): checked with :func:`check_output` before
  the work starts and written with :func:`write_output`: a regular file is replaced whole (a private temporary
  file renamed over it, so the old file's other names and a symlink's target are never written); a FIFO, a
  character device or a standard stream (``/dev/stdout``) is written through; anything else, an input of the
  run, and a symbolic link the user did not name as a stream are refused;
- **folders the package fills** (run folders, training outputs, converted and tiny checkpoints, caches):
  :class:`Folder` works on an open folder (a file descriptor), by plain names only (no ``/``, no ``..``), never
  following a symbolic link, creating files exclusively and replacing them by rename; :class:`Claim` adds an
  authenticated list of what the package wrote there, and only what it lists is ever replaced or removed.

The list is authenticated with an HMAC keyed by a secret kept outside every run folder, in a file only the
user can read (:func:`secret`): a marker copied from elsewhere, written by hand or edited (say, to list
``../victim.txt``) does not verify and is refused.

The layer is split along these seams: :mod:`~capeval_plugins.files.base` (errors, path checks, inputs),
:mod:`~capeval_plugins.files.paths` (where the per-user folders are: the cache and config roots),
:mod:`~capeval_plugins.files.secret` (the secret and signed JSON), :mod:`~capeval_plugins.files.folder`
(:class:`Folder`, scratch leftovers, :class:`CacheFolder`, private folders), :mod:`~capeval_plugins.files.claim`
(:class:`Claim`) and :mod:`~capeval_plugins.files.outputs`. Each imports only those before it (but for
:func:`secret`'s import of :class:`Folder` when it makes the key), the standard library and ``core.messages``.
This module is the public face: import from it.
"""
from __future__ import annotations

from capeval_plugins.files.paths import user_base
from capeval_plugins.files.base import (ENVIRONMENT_ERRNOS, STREAMS, Data, FileError, StorageError, UnsafePath,
                                         check_input, check_links, file_kind, is_environment_error, open_input,
                                         plain_name, read_input, relative_name, same_or_inside, storage_error)
from capeval_plugins.files.claim import Claim
from capeval_plugins.files.folder import (LEFTOVER_AGE, CacheFolder, Folder, _hidden_name, private_folder,
                                           remove_private)
from capeval_plugins.files.outputs import check_output, output_kind, stream_fd, write_output
from capeval_plugins.files.secret import (SECRET_FILE, _secret_cache, config_dir, mac, read_signed_json, secret,
                                           signed_json)

__all__ = ["CacheFolder", "Claim", "Data", "ENVIRONMENT_ERRNOS", "FileError", "Folder", "LEFTOVER_AGE", "SECRET_FILE",
           "STREAMS", "StorageError", "UnsafePath", "check_input", "check_links", "check_output", "config_dir",
           "file_kind", "is_environment_error", "mac", "open_input", "output_kind", "plain_name", "private_folder", "read_input",
           "read_signed_json", "relative_name", "remove_private", "same_or_inside", "secret", "signed_json",
           "storage_error", "stream_fd", "user_base", "write_output", "_hidden_name", "_secret_cache"]
