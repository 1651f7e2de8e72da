"""Numba kernels of format 2's ulp class (encodings 6 ``ulp2`` and 7 ``ulp2_hist``; FORMAT.md, "Format
version 2"): the import path of ``ulp2_encode`` and ``ulp2_decode``, whose signatures the C kernels
(``_native.ulp2_encode``, ``_native.ulp2_decode``) share argument for argument.

* ``ulp2_encode(base, target, states, bits, kind, shift, mask, n_exp, hist, variant, pos, out)
  -> (m, nbytes)`` (``ulp2_encode_kernels``);
* ``ulp2_decode(base, states, payload, n_changed, bits, kind, shift, mask, n_exp, hist, pos_out, val_out)
  -> status`` (``ulp2_decode_kernels``; status 0 or a negative code of ``codec.constants.STATUS``).

Both release the GIL (chunks run in parallel on threads). Importing this module imports numba: ``codec.ulp2``
reaches it on first use only.
"""

from __future__ import annotations

from .ulp2_decode_kernels import ulp2_decode
from .ulp2_encode_kernels import ulp2_encode, variant_params

__all__ = ["ulp2_decode", "ulp2_encode", "variant_params"]
