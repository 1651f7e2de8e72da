"""Command line (``deltarefit``): parse, call one library function, render errors as one line with an exit code.

Exit codes: each error's ``exit_code`` (``deltarefit.errors``; a subclass exits as its parent, named in
parentheses). Usage errors too are one line, exit 2, click's own included.

    0    ok
    1    DeltaRefitError     unexpected
    2    UsageError          usage: an option combination or argument that cannot work, an output
                             whose directory does not exist, an output that is one of the inputs
    3    FormatError         bad delta: malformed or corrupt (UnsupportedVersionError, IntegrityError,
                             LimitError, DecodeError)
    4    CheckpointError     bad checkpoint: missing, not a safetensors file, not a regular file or a
                             directory (a FIFO); or a symbolic link or FIFO another user planted at a
                             name kept beside it (the lock file, the staging, a keyframe's temporaries)
    5    BaseMismatchError   wrong base: the checkpoint is not the delta's base (nothing written)
    6    VerificationError   verification: a result does not match its fingerprint or digest, a
                             checkpoint modified by another process while applied or synced, a
                             publisher's input changed while published (InputChangedError)
    7    StoreError          storage: the store's own I/O, permissions, a lost connection (the local
                             side of a download is 12)
    8    SignatureError      signature: a commit record unsigned, or its signature does not verify
                             (UntrustedError: what an engine's pinned trust refuses)
    9    StreamError         version stream: broken chain, lost publish race, no route, another stream
                             (MalformedRecordError, StreamIdentityError, PublishError, BroadcastError)
    10   ProtocolError       relay: failed authentication, a bad frame or part, a relay not reached
                             (AuthError, BadPartError)
    11   LockedError         locked: another run holds the checkpoint or the publisher state (the
                             message names its pid)
    12   FileSystemError     filesystem: a local file could not be written or read (disk full, read-only,
                             permission denied, a missing directory), the checkpoint's lock file and a
                             download's staged copy included; the line names the operation and the path
    130  interrupted (Ctrl-C); rerunning the same command is safe: it resumes where it stopped

Modules:

* ``common``  the group ``main``, ``_run`` (errors as one line and an exit code), shared options
* ``progress`` the progress bars on a terminal (rich, imported only when a bar is shown)
* ``core``    encode, apply, inspect, fingerprint, verify, keygen, compose
* ``stream``  the version-stream commands (publish, sync, log, retain, relay)
* ``status``  status: which stream and version a checkpoint holds, and whether it is behind (read-only)
* ``apps``    demo, simulate and bench (their modules are imported only when the command runs)
"""

# Each command module registers its commands on ``main`` when imported.
from . import apps, core, status, stream  # noqa: F401
from .common import main

__all__ = ["main"]
