"""Helpers for the version-stream tests: a chain of checkpoints made by real optimizer steps, real CLI
processes, file hashes and small stream inspections.

The chain: a tiny ``transformers`` BERT (built from a config, offline) trained with ``torch.optim.AdamW``
on fp32 master weights; after each step the bf16 export is saved with ``safetensors.torch.save_file`` as
``step_{i:03d}.safetensors``. At lr 1e-3 each step moves the weights by a few per cent, so most bf16
values change (55-85% per step here): deltas of ~1/3 of a checkpoint, keyframes clearly bigger.
The chain is generated once per test session into a cache directory and reused (``session_chain``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time

N_STEPS = 24
TIMEOUT = 120  # seconds, for any one subprocess
ENV = dict(os.environ, DELTAREFIT_NO_PROGRESS="1")
_CACHE: dict[str, str] = {}


# ------------------------------------------------------------------------------------------ the chain


def make_chain(out_dir: str, steps: int = N_STEPS, *, seed: int = 0, lr: float = 1e-3, hidden: int = 64,
               layers: int = 2, vocab: int = 1000) -> list[str]:
    """Write ``step_000.safetensors`` .. ``step_{steps-1}`` (bf16 exports of real AdamW steps) into
    ``out_dir``; returns their paths. Deterministic for a seed. Files already there are reused."""
    paths = [os.path.join(out_dir, f"step_{i:03d}.safetensors") for i in range(steps)]
    done = os.path.join(out_dir, f"DONE-{steps}-{seed}-{lr}-{hidden}-{layers}-{vocab}")
    if os.path.exists(done) and all(os.path.exists(p) for p in paths):
        return paths
    import torch
    from safetensors.torch import save_file
    from transformers import BertConfig, BertModel

    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(seed)
    cfg = BertConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
                     intermediate_size=2 * hidden, vocab_size=vocab, max_position_embeddings=64)
    model = BertModel(cfg).float()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    g = torch.Generator().manual_seed(seed + 1)
    target = torch.randn(hidden, generator=g)
    for i in range(steps):
        if i > 0:  # step 0 is the initial model
            ids = torch.randint(0, vocab, (8, 16), generator=g)
            out = model(input_ids=ids).last_hidden_state
            loss = ((out - target) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        export = {n: p.detach().to(torch.bfloat16).contiguous() for n, p in model.named_parameters()}
        tmp = paths[i] + ".tmp"
        save_file(export, tmp)  # no metadata: equal tensors give equal files
        os.replace(tmp, paths[i])
    with open(done, "w") as f:
        f.write("ok\n")
    return paths


def session_chain(tmp_path_factory) -> list[str]:
    """The 24 checkpoint files of the chain, generated once per test session (whichever module asks
    first) under the session's base temp directory, then reused. Wrap it in a session fixture."""
    if "chain" not in _CACHE:
        d = str(tmp_path_factory.getbasetemp() / "stream_chain")
        make_chain(d)
        _CACHE["chain"] = d
    return [os.path.join(_CACHE["chain"], f"step_{i:03d}.safetensors") for i in range(N_STEPS)]


def chain_fingerprints(paths: list[str]) -> list[str]:
    """deltarefit fingerprints of the chain's files (computed once per session)."""
    import deltarefit

    if "fps" not in _CACHE:
        _CACHE["fps"] = json.dumps([deltarefit.fingerprint(p) for p in paths])
    return json.loads(_CACHE["fps"])


# ------------------------------------------------------------------------------------------ files


def sha(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(1 << 22):
            h.update(b)
    return h.hexdigest()


def read_bytes(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def flip_tensor_byte(path: str, tensor: str | None = None, offset: int = 11) -> None:
    """Flip one bit in the data of a tensor (the first, by name, if none is given) of a safetensors file."""
    import struct

    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    names = sorted(k for k in header if k != "__metadata__")
    name = tensor or names[0]
    begin = header[name]["data_offsets"][0]
    pos = 8 + n + begin + offset
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x01]))


def state_of(ckpt: str) -> dict | None:
    p = os.path.abspath(ckpt) + ".deltarefit-version.json"
    b = read_bytes(p)
    return None if b is None else json.loads(b)


# ------------------------------------------------------------------------------------------ processes


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def communicate_all(procs: list[subprocess.Popen], timeout: float = TIMEOUT) -> list[tuple[int, str, str]]:
    """(returncode, stdout, stderr) of every process of a group, in order; on a timeout every process
    of the group is killed (a rank stuck in a collective would hold the others) and it is raised."""
    out = []
    for p in procs:
        try:
            so, se = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append((p.returncode, so, se))
    return out


def cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "deltarefit", *args]


def run(*args: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run(cmd(*args), capture_output=True, text=True, timeout=timeout, env=ENV, check=False)


def run_ok(*args: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    r = run(*args, timeout=timeout)
    assert r.returncode == 0, f"deltarefit {' '.join(args)} exited {r.returncode}: {r.stderr}"
    return r


# ------------------------------------------------------------------------------------------ streams


def commits(store) -> dict:
    """{version: CommitRecord} of every committed version."""
    from deltarefit.stream.records import list_versions, load_commit

    return {v: load_commit(store, v) for v in list_versions(store)}


def check_stream_whole(store) -> dict:
    """Every commit record's parts exist and hash to the record; the chain links up. Returns commits."""
    import blake3

    recs = commits(store)
    vs = sorted(recs)
    assert vs == list(range(1, len(vs) + 1)), f"versions not contiguous: {vs}"
    for v, r in recs.items():
        parts = ([r.delta] if r.delta else []) + [p for _, p in r.keyframe]
        for p in parts:
            data = store.get(p.key)
            assert len(data) == p.bytes and blake3.blake3(data).hexdigest() == p.blake3, f"v{v}: {p.key} is bad"
        if v > 1:
            assert r.parent == recs[v - 1].fingerprint, f"v{v}: parent is not v{v - 1}"
    return recs


def kill_at(args: list[str], *, delay: float = 0.0, when=None, after_delay: float = 0.0,
            timeout: float = TIMEOUT) -> tuple[int, float, str]:
    """Start ``deltarefit *args``; SIGKILL it ``delay`` s after the start or, with ``when`` (a predicate
    polled every ~0.2 ms), ``after_delay`` s after ``when()`` first holds. A process that exits first
    is not killed. Returns (exit status, seconds from the start to the kill, stderr)."""
    p = subprocess.Popen(cmd(*args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV)
    t0 = time.monotonic()
    try:
        if when is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=delay)
        else:
            while p.poll() is None and not when() and time.monotonic() - t0 < timeout:
                time.sleep(0.0002)
            if after_delay > 0:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=after_delay)
        t_kill = time.monotonic() - t0
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
        _, err = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=timeout)
    return p.returncode, t_kill, err.decode(errors="replace")
