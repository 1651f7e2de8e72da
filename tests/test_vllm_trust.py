"""A ``vllm serve`` engine whose trust is pinned by its own environment (``DELTAREFIT_VERIFY_KEY``,
``DELTAREFIT_STREAMS``; ``deltarefit.engines.vllm.trust``), called over its open dev and RL routes as anyone who
reaches it could: another key, no key, a stream outside the pins, a missing stream, an unsigned stream, a
malformed update and paths outside the roots through ``/collective_rpc`` are each refused in one line, and
the engine keeps serving the version it verified (same weight version, same fingerprint, same greedy
completions), and still updates from its pinned stream.

Marked slow and skipped without vLLM (``make test-vllm``); every vLLM process is set up by
``tests/_vllm_env.py`` (AMX off). The refusal logic itself is tested without vLLM in test_engine_trust.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request

import pytest
from _vllm_env import vllm_processes_env, vllm_serve
from test_vllm import build_models

_env = pytest.fixture(autouse=True)(vllm_processes_env)


def _post(url: str, path: str, body: dict | None = None):
    import requests

    return requests.post(f"{url}/{path}", json=body, timeout=300)


def _completions(url: str, model: str) -> list[list[int]]:
    import requests

    r = requests.post(f"{url}/v1/completions", timeout=300, json={
        "model": model, "prompt": ["the trainer sends weights", "one two three"], "max_tokens": 16,
        "temperature": 0.0, "ignore_eos": True, "return_token_ids": True})
    r.raise_for_status()
    return [c["token_ids"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


def _weight_version(url: str) -> str:
    with urllib.request.urlopen(f"{url}/weight_info", timeout=30) as r:
        return json.loads(r.read())["weight_version"]


def _rpc(url: str, method: str, *args: str) -> list:
    r = _post(url, "collective_rpc", {"method": method, "args": list(args)})
    r.raise_for_status()
    return r.json()["results"]


@pytest.mark.slow
def test_a_pinned_engine_refuses_other_keys_streams_and_paths_and_keeps_its_verified_version(tmp_path):
    import deltarefit
    from deltarefit.engines.vllm import EXTENSION
    from deltarefit.engines.vllm.backend import HTTPClient
    from deltarefit.storage import LocalStore
    from deltarefit.stream.publisher import Publisher
    from deltarefit.stream.records import load_commit

    base, target, other = build_models(str(tmp_path / "models"))
    key, wrong = str(tmp_path / "k.pem"), str(tmp_path / "wrong.pem")
    for k in (key, wrong):
        assert subprocess.run([sys.executable, "-m", "deltarefit", "keygen", k], check=False).returncode == 0
    root = str(tmp_path / "streams")
    signed, unsigned, outside = os.path.join(root, "s"), os.path.join(root, "u"), str(tmp_path / "outside" / "s")
    for store, sign in ((signed, key), (unsigned, None), (outside, key)):
        pub = Publisher(store, store + "-pub", keyframe_every=5, keyframe_ratio=1000.0, signing_key=sign)
        for ck in (base, target):
            pub.publish(ck)
    stray = str(tmp_path / "stray.delta")  # version 2's own delta, copied outside the roots
    shutil.copy(os.path.join(signed, load_commit(LocalStore(signed), 2).delta.key), stray)

    env = {"DELTAREFIT_VERIFY_KEY": key + ".pub", "DELTAREFIT_STREAMS": root}
    seen: dict[str, str] = {}
    try:
        with vllm_serve(base, str(tmp_path / "serve.log"), args=("--worker-extension-cls", EXTENSION), env=env) as url:
            client = HTTPClient(url)
            client.init_weight_transfer_engine({"stream": signed, "verify_key": key + ".pub", "version": 1})
            client.start_weight_update()
            client.update_weights({"version": 2})
            client.finish_weight_update("2")
            verified = deltarefit.fingerprint(target)
            want = _completions(url, base)
            assert _weight_version(url) == "2"

            def still_serving_version_2() -> None:
                assert _weight_version(url) == "2"
                assert [d["fingerprint"] for d in _rpc(url, "deltarefit_live_describe")] == [verified]
                assert _completions(url, base) == want

            def refused(name: str, path: str, body: dict, *words: str) -> None:
                r = _post(url, path, body)
                seen[name] = f"{r.status_code} {r.text[:300]}"
                assert r.status_code >= 400, seen[name]
                # the worker's one line, in the reply (vLLM shows each path in it as <path>)
                assert all(w in r.text for w in words), (name, words, r.text)
                still_serving_version_2()

            init = "init_weight_transfer_engine"
            refused("another key", init, {"init_info": {"stream": signed, "verify_key": wrong + ".pub"}},
                    "init_info.verify_key", " is key ", "this engine pins key")
            refused("no key", init, {"init_info": {"stream": signed}}, "names no verify_key")
            refused("stream outside the pins", init, {"init_info": {"stream": outside, "verify_key": key + ".pub"}},
                    "is not one this engine trusts", "DELTAREFIT_STREAMS")
            missing = os.path.join(root, "missing")
            refused("missing stream", init, {"init_info": {"stream": missing, "verify_key": key + ".pub"}},
                    "no store here")
            assert not os.path.exists(missing)  # never created at init
            for bad in ("3", 2.5, [1], True):
                client.rl.start_weight_update()  # no pause: the engine serves; a failed update ends the session
                refused(f"version {bad!r}", "update_weights", {"update_info": {"version": bad}},
                        f"update_info.version is {type(bad).__name__}", "expected an int from 1")

            for method, args, words in (("apply_delta", (stray, base), "delta"),
                                        ("deltarefit_live_apply", (stray,), "delta"),
                                        ("deltarefit_live_prepare", (stray,), "delta"),
                                        ("deltarefit_reload_all", (other,), "checkpoint directory")):
                reports = _rpc(url, method, *args)
                seen[method] = reports[0].get("error", "")
                assert [(r["ok"], r["error_type"]) for r in reports] == [(False, "UntrustedError")], reports
                error = reports[0]["error"]
                assert f"{words} " in error and "lies outside what this engine trusts" in error
                still_serving_version_2()

            # the backend still follows its pinned stream: an update to the version it holds is a no-op
            client.start_weight_update()
            client.update_weights({"version": 2})
            client.finish_weight_update("2")
            still_serving_version_2()
            # an unsigned stream under the roots, with the right key: refused at its head record, before the
            # backend it would replace is shut down
            refused("unsigned stream", init, {"init_info": {"stream": unsigned, "verify_key": key + ".pub"}},
                    "commit record is not signed")
            client.start_weight_update()
            client.update_weights({"version": 2})
            client.finish_weight_update("2")
            still_serving_version_2()
    finally:
        print(json.dumps(seen, indent=1))
