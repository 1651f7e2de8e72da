"""Constants the codec's kernels (numba and native) and their callers share, without importing numba."""

KIND_FLOAT = 0
KIND_INT = 1  # two's complement: flip the sign bit
KIND_UINT = 2  # identity

# Decoder status codes (negative; 0 is success), the same from every decoder.
STATUS = {
    -1: "payload ends early (truncated or corrupt)",
    -2: "bad group header (context id, count or rice parameter out of range)",
    -3: "a position lies beyond the end of its chunk",
    -4: "change counts do not add up to the chunk record's count",
    -5: "output buffer too small",
    -6: "payload has trailing bytes",
    -7: "ulp2: unknown coder variant",
    -8: "ulp2: bad table (context, probability or frequencies out of range)",
    -9: "ulp2: a lane state out of range",
    -10: "ulp2: a lane does not end at the encoder's initial state",
}
