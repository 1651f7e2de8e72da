"""Work on a GPU: segment hashes (``deltarefit.integrity``'s construction), the encoder's scan, the apply's rank map.

* ``blake3_torch``: a pure-torch, vectorized BLAKE3 over all chunks at once (int64 tensors masked to
  32 bits). Runs on any device; the executable specification the Triton kernels are checked against.
* ``blake3_triton``: the same algorithm as Triton kernels (``segment_hashes_gpu``) plus
  ``tensor_digest_gpu`` / ``fingerprint_gpu``, which move only 16 bytes per MiB to the host.
* ``ulp2`` (kernels in ``_ulp2_kernels``, tables in ``ulp2_tables``): format 2's encodings 6/7 decoded
  and coded on the device, the W rANS lanes as a program's vector, one program per chunk.
* ``scan``: the fused compare-and-compact scan (Triton kernels in ``_scan_kernels``) that the device
  encoder (``encode``) codes from, and the context table the device apply (``apply``) maps decoded
  ranks to positions with.

Nothing here is imported by the rest of the package: importing ``deltarefit`` never needs torch or
Triton.
"""
