"""The vLLM plugin hook's engine-core wrapper (``deltarefit_vllm_plugin.quiet_during_update``), without
vLLM: stand-ins for the engine core, its executor and the executor's reply queues, which carry only the
attributes the wrapper reads (vLLM itself is in ``make test-vllm``, where every update goes through it).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import deltarefit_vllm_plugin as plugin


class _Core:
    def __init__(self, backend: str | None) -> None:
        cfg = SimpleNamespace(backend=backend) if backend else None
        self.vllm_config = SimpleNamespace(weight_transfer_config=cfg)
        self.conds = [SimpleNamespace(busy_loop_s=1), SimpleNamespace(busy_loop_s=0.5)]
        self.model_executor = SimpleNamespace(response_mqs=[SimpleNamespace(_spin_condition=c) for c in self.conds])
        self.seen: list[tuple] = []

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.seen.append((method, timeout, args, kwargs, [c.busy_loop_s for c in self.conds]))
        if kwargs and kwargs.get("fail"):
            raise RuntimeError("worker failed")
        return ["ok"]


def test_an_update_of_the_deltarefit_backend_waits_without_spinning_and_restores_the_spin():
    rpc = plugin.quiet_during_update(_Core.collective_rpc)
    core = _Core("deltarefit")
    assert rpc(core, "update_weights", None, (), {"update_info": {"version": 2}}) == ["ok"]
    assert core.seen[-1][-1] == [0.0, 0.0]  # no busy loop while the workers apply
    assert [c.busy_loop_s for c in core.conds] == [1, 0.5]  # restored after
    with pytest.raises(RuntimeError, match="worker failed"):
        rpc(core, "update_weights", kwargs={"fail": True})
    assert [c.busy_loop_s for c in core.conds] == [1, 0.5]  # and after a failure


@pytest.mark.parametrize("backend, method", [("deltarefit", "start_weight_update"), ("deltarefit", "sample_tokens"),
                                             ("nccl", "update_weights"), (None, "update_weights")])
def test_other_calls_and_other_backends_keep_the_spin(backend, method):
    rpc = plugin.quiet_during_update(_Core.collective_rpc)
    core = _Core(backend)
    rpc(core, method, 5.0, (1,), None)
    assert core.seen == [(method, 5.0, (1,), None, [1, 0.5])]


def test_an_engine_core_without_those_internals_is_left_alone():
    rpc = plugin.quiet_during_update(_Core.collective_rpc)
    core = _Core("deltarefit")
    core.model_executor = SimpleNamespace()  # another executor: no reply queues
    assert rpc(core, "update_weights") == ["ok"]
    assert plugin.quiet_during_update(rpc).__wrapped__ is rpc and rpc._deltarefit_quiet


class _Queue:
    """A worker's reply queue: replies taken in order."""

    def __init__(self, replies: list) -> None:
        self.replies = list(replies)

    def dequeue(self, timeout=None):
        return self.replies.pop(0)


class _MpCore(_Core):
    """An engine core whose executor reads its workers' replies as vLLM 0.32's multiprocess executor does:
    in rank order, raising at the first failure (the later replies stay queued)."""

    def __init__(self, replies: list[list]) -> None:
        super().__init__("deltarefit")
        self.model_executor = SimpleNamespace(response_mqs=[_Queue(r) for r in replies])

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        out = []
        for mq in self.model_executor.response_mqs:
            status, result = mq.dequeue(timeout=timeout)
            if status != "SUCCESS":
                raise RuntimeError(f"Worker failed with error '{result}'")
            out.append(result)
        return out


@pytest.fixture
def mp_executor(monkeypatch):
    """vLLM's reply status, as the wrapper finds it in the engine-core process."""
    import sys

    status = SimpleNamespace(SUCCESS="SUCCESS", FAILURE="FAILURE")
    mod = SimpleNamespace(WorkerProc=SimpleNamespace(ResponseStatus=status))
    monkeypatch.setitem(sys.modules, "vllm.v1.executor.multiproc_executor", mod)


def test_a_failed_update_of_a_group_reads_every_workers_reply(mp_executor):
    replies = [[("FAILURE", "another process of the group refused"), ("SUCCESS", "next")],
               [("FAILURE", "injected failure mid-write"), ("SUCCESS", "next")]]
    plain = _MpCore(replies)
    with pytest.raises(RuntimeError):
        plain.collective_rpc("update_weights")
    # vLLM's own reading: the second worker's failure is what the next call gets back
    with pytest.raises(RuntimeError, match="injected"):
        plain.collective_rpc("sample_tokens")
    rpc = plugin.quiet_during_update(_MpCore.collective_rpc)
    core = _MpCore(replies)
    with pytest.raises(RuntimeError, match="refused; injected failure mid-write"):
        rpc(core, "update_weights")
    assert all("dequeue" not in vars(mq) for mq in core.model_executor.response_mqs)  # unwrapped after
    assert rpc(core, "sample_tokens") == ["next", "next"]  # every reply of the failed call was read
    ok = _MpCore([[("SUCCESS", 1)], [("SUCCESS", 2)]])
    assert rpc(ok, "update_weights") == [1, 2]
    init = _MpCore([[("SUCCESS", None), ("SUCCESS", "next")], [("FAILURE", "layout refused"), ("SUCCESS", "next")]])
    with pytest.raises(RuntimeError, match="layout refused"):  # every call of the backend, not the update alone
        rpc(init, "init_weight_transfer_engine")
    assert rpc(init, "sample_tokens") == ["next", "next"]
