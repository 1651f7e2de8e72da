"""Ray-hosted engines whose trust is pinned by the actor's ``runtime_env`` (``DELTAREFIT_VERIFY_KEY``,
``DELTAREFIT_STREAMS`` in its ``env_vars``; ``deltarefit.engines.vllm.trust``), called as anyone who reaches
them could: an ``EngineActor`` (a vLLM ``LLM``) and an ``AsyncEngineActor`` (an ``AsyncLLM``), each through
vLLM's own ``RayVLLMWeightSyncClient`` and the actor's ``collective_rpc``, and a ``ServerActor`` (``vllm serve`` on loopback) through its open RL routes and the
actor's ``collective_rpc``.

The pins are given only to the actors (the cluster's own environment has none), so they must travel with
the actor into the engine core and the workers vLLM starts under it. Another key, no key, a stream outside
the pins, a missing stream and an unsigned stream are each refused in one line, as are ``apply_delta``,
``deltarefit_live_apply`` and ``deltarefit_reload_all`` on paths outside the roots. After each refusal every
engine still serves the version it verified: the same weight version, the version's fingerprint, the same
weights (``deltarefit_digests``) and greedy tokens; at the end its weights equal the version's checkpoint
(``deltarefit_verify``), and it still follows its pinned stream to the next signed version.

Marked ``slow`` and ``ray`` (``make test-ray``); the cluster and every vLLM process are set up as in
tests/test_ray.py. The refusal logic itself is tested without vLLM in test_engine_trust.py, and a plain
``vllm serve`` with pins in test_vllm_trust.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.ray]
ray = pytest.importorskip("ray", reason="Ray is not installed here (make test-ray installs it)")
pytest.importorskip("vllm", reason="vLLM is not installed here (make test-vllm builds a venv with it)")

from test_ray import WAIT, _free_ports, cluster  # noqa: E402, F401, I001

import ray_refit  # noqa: E402  (examples/ray_refit.py: test_ray put examples/ on sys.path)
from test_vllm import build_models, perturb  # noqa: E402

SERVE_ARGS = ["--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "256", "--max-num-seqs", "8",
              "--seed", "0"]
SPARSE = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.gate_proj.weight"]


def _streams(tmp_path) -> dict[str, str]:
    """Keys, checkpoints and streams: ``signed`` and ``unsigned`` (base, target) under the pinned ``root``,
    ``outside`` (signed) beyond it, a ``stray`` copy of version 2's delta outside the root; ``target`` and
    ``target2`` copied under the root (for ``deltarefit_verify``), and the signed stream's publisher's
    state (version 3 is published from it later)."""
    from deltarefit.storage import LocalStore
    from deltarefit.stream.publisher import Publisher
    from deltarefit.stream.records import load_commit

    base, target, other = build_models(str(tmp_path / "models"))
    target2 = str(tmp_path / "models" / "target2")
    perturb(target, target2, SPARSE)
    key, wrong = str(tmp_path / "k.pem"), str(tmp_path / "wrong.pem")
    for k in (key, wrong):
        assert subprocess.run([sys.executable, "-m", "deltarefit", "keygen", k], check=False).returncode == 0
    root = str(tmp_path / "streams")
    s = {"base": base, "other": other, "target2_src": target2, "key": key + ".pub", "wrong": wrong + ".pub",
         "root": root, "signed": os.path.join(root, "s"), "unsigned": os.path.join(root, "u"),
         "outside": str(tmp_path / "outside" / "s"), "stray": str(tmp_path / "stray.delta"),
         "target": os.path.join(root, "ckpt", "target"), "target2": os.path.join(root, "ckpt", "target2")}
    for store, sign in ((s["signed"], key), (s["unsigned"], None), (s["outside"], key)):
        pub = Publisher(store, store + "-pub", keyframe_every=5, keyframe_ratio=1000.0, signing_key=sign)
        for ck in (base, target):
            pub.publish(ck)
    shutil.copy(os.path.join(s["signed"], load_commit(LocalStore(s["signed"]), 2).delta.key), s["stray"])
    shutil.copytree(target, s["target"])
    shutil.copytree(target2, s["target2"])
    return s


def _look(h) -> dict:
    """What an engine actor serves: its weight version, its workers' fingerprints, digests and greedy tokens."""
    st, dg, toks = ray.get([h.state.remote(), h.digests.remote(), h.generate.remote(ray_refit.PROMPTS)],
                           timeout=WAIT)
    return {"version": st["weight_version"], "fingerprints": st["fingerprints"], "digests": dg, "tokens": toks}


def _one_line(text: str, words: tuple[str, ...]) -> str:
    """The line of ``text`` that holds every one of ``words`` (the refusal's one line)."""
    lines = [ln for ln in text.splitlines() if all(w in ln for w in words)]
    assert lines, (words, text[-3000:])
    return lines[0].strip()


def test_ray_hosted_engines_pinned_by_runtime_env_refuse_other_keys_streams_and_paths(cluster, tmp_path):  # noqa: F811
    import requests

    import deltarefit
    from deltarefit.engines.vllm.backend import HTTPClient
    from deltarefit.engines.vllm.trust import ENV_STREAMS, ENV_VERIFY_KEY
    from deltarefit.integrations.placement import placed
    from deltarefit.integrations.ray import EngineActor, ray_client
    from deltarefit.integrations.ray_async import AsyncEngineActor
    from deltarefit.integrations.ray_http import ServerActor
    from deltarefit.stream.publisher import Publisher

    assert not os.environ.get(ENV_VERIFY_KEY) and not os.environ.get(ENV_STREAMS)  # pins only through the actors
    s = _streams(tmp_path)
    pins = {"env_vars": {ENV_VERIFY_KEY: s["key"], ENV_STREAMS: s["root"]}}
    init = {"stream": s["signed"], "verify_key": s["key"], "version": 1}
    llm = ray.remote(EngineActor).options(**placed(ray_refit.ENGINES["engine-a"], "pinned-llm", runtime_env=pins)).remote(
        s["base"], init_info=init, llm_kwargs=ray_refit.LLM_KWARGS, name="pinned-llm")
    alm = ray.remote(AsyncEngineActor).options(**placed({"trainer": 1.0}, "pinned-asyncllm", runtime_env=pins)).remote(
        s["base"], init_info=init, llm_kwargs=ray_refit.LLM_KWARGS, name="pinned-asyncllm")
    (port,) = _free_ports(1)
    srv = ray.remote(ServerActor).options(**placed(ray_refit.ENGINES["engine-b"], "pinned-serve", runtime_env=pins)).remote(
        s["base"], port=port, init_info=init, serve_args=SERVE_ARGS, name="pinned-serve")
    ray.get([llm.ready.remote(), alm.ready.remote(), srv.ready.remote()], timeout=WAIT)
    url = ray.get(srv.get_url.remote(), timeout=WAIT)
    engines = {"llm": llm, "asyncllm": alm, "serve": srv}
    verified = deltarefit.fingerprint(s["target"])
    at2 = {n: _look(h) for n, h in engines.items()}
    for n, look in at2.items():  # each caught up through the signed stream to its head, version 2
        assert look["version"] == "2" and look["fingerprints"] == [verified], (n, look["version"], look["fingerprints"])
    # vLLM's RayVLLMWeightSyncClient: the trainer's route to an LLM or AsyncLLM actor
    clients = {n: ray_client([h]) for n, h in engines.items() if n != "serve"}
    seen: dict[str, str] = {}

    def still_at_version_2() -> None:
        for n, h in engines.items():
            assert _look(h) == at2[n], f"{n} changed after a refused call"

    def init_refused(name: str, info: dict, *words: str) -> None:
        for n, client in clients.items():
            with pytest.raises(ray.exceptions.RayTaskError) as e:
                client.init_weight_transfer_engine(info)
            seen[f"{n}: {name}"] = _one_line(str(e.value), words)
        r = requests.post(f"{url}/init_weight_transfer_engine", json={"init_info": info}, timeout=300)
        assert r.status_code >= 400, (name, r.status_code, r.text[:300])
        seen[f"serve: {name}"] = _one_line(r.text, words)
        still_at_version_2()

    init_refused("another key", {"stream": s["signed"], "verify_key": s["wrong"]},
                 "init_info.verify_key", " is key ", "this engine pins key")
    init_refused("no key", {"stream": s["signed"]}, "names no verify_key", "this engine pins key")
    init_refused("stream outside the pins", {"stream": s["outside"], "verify_key": s["key"]},
                 "is not one this engine trusts", ENV_STREAMS)
    missing = os.path.join(s["root"], "missing")
    init_refused("missing stream", {"stream": missing, "verify_key": s["key"]}, "no store here")
    assert not os.path.exists(missing)  # never created at init
    init_refused("unsigned stream", {"stream": s["unsigned"], "verify_key": s["key"]}, "commit record is not signed")

    for method, args, what in (("apply_delta", (s["stray"], s["base"]), "delta"),
                               ("deltarefit_live_apply", (s["stray"],), "delta"),
                               ("deltarefit_reload_all", (s["other"],), "checkpoint directory")):
        for n, h in engines.items():
            reports = ray.get(h.collective_rpc.remote(method, args), timeout=WAIT)
            assert [(r["ok"], r["error_type"]) for r in reports] == [(False, "UntrustedError")], (n, method, reports)
            seen[f"{n}: {method}"] = _one_line(reports[0]["error"], (f"{what} ", "lies outside what this engine trusts"))
        still_at_version_2()

    # the weights each engine serves are version 2's checkpoint's, bit for bit
    for n, h in engines.items():
        (check,) = ray.get(h.collective_rpc.remote("deltarefit_verify", (s["target"],)), timeout=WAIT)
        assert check["mismatched"] == [] and check["verified"], (n, check)
    # and each still follows its pinned stream: version 3, signed, through the same routes as the trainer's
    pub = Publisher(s["signed"], s["signed"] + "-pub", keyframe_every=5, keyframe_ratio=1000.0,
                    signing_key=s["key"][: -len(".pub")])
    assert pub.publish(s["target2_src"]).version == 3
    for client in (*clients.values(), HTTPClient(url)):
        client.start_weight_update()
        client.update_weights({"version": 3})
        client.finish_weight_update("3")
    want3 = deltarefit.fingerprint(s["target2"])
    for n, h in engines.items():
        look = _look(h)
        assert look["version"] == "3" and look["fingerprints"] == [want3], (n, look["version"], look["fingerprints"])
        assert look["digests"] != at2[n]["digests"], f"{n} holds version 2's weights at version 3"
        (check,) = ray.get(h.collective_rpc.remote("deltarefit_verify", (s["target2"],)), timeout=WAIT)
        assert check["mismatched"] == [] and check["verified"], (n, check)
    print(json.dumps(seen, indent=1))
