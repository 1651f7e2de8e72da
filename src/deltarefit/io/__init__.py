"""The local filesystem and untrusted input, for every layer above.

* ``fsutil``      durable writes (fsync, atomic rename), files opened without following planted links or
                  hanging on FIFOs, filesystem errors as one line
* ``locks``       exclusive access to what a run writes (a checkpoint, a publisher's state) and what dead
                  runs leave behind
* ``jsonlimits``  cheap bounds on untrusted JSON text before ``json.loads`` builds it
* ``private``     what is kept in a directory every local user can write (the temp directory, ``/dev/shm``):
                  ``mkdtemp``, or a per-user directory made 0700 and ``lstat``-checked, refused otherwise
"""
