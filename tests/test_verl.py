"""deltarefit as a verl checkpoint engine, against verl's own classes (verl 0.9.1; ``make test-verl``, which
builds ../verl-venv; skipped where verl does not import).

verl's parts used as they are: its Hydra config (``ppo_trainer.yaml``) with the user's overrides, read into
its ``RolloutConfig`` / ``CheckpointEngineConfig``; ``import_external_libs`` and ``CheckpointEngineRegistry``
as verl's trainer worker builds its engine (``verl/workers/engine_workers.py``); ``CheckpointEngineManager``'s
backend lookup; the rollout side's ``CheckpointEngineWorker`` (``verl/checkpoint_engine/base.py``), which
builds the engine itself from the config and hands what ``receive_weights`` yields to its server adapter.
The adapter here records the tensors (verl's vLLM adapter would load them into a GPU engine, which this
machine has not). The round follows ``CheckpointEngineManager.update_weights`` (tests/_verl_rounds.py); Ray
is not started.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import tempfile

import pytest
import torch

verl = pytest.importorskip("verl", reason="verl is not installed (make test-verl)")

from _verl_rounds import model, run_round, same_bits, served, train_step  # noqa: E402

from deltarefit.errors import DeltaRefitError  # noqa: E402
from deltarefit.signing import keygen  # noqa: E402
from deltarefit.stream.records import load_commit  # noqa: E402


def _config(stream: str, state_dir: str, tmp: str, extra: list[str] = ()):
    """verl's own config, with the lines a user adds (docs/FRAMEWORKS.md, "verl")."""
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass

    cfgdir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    ce = "actor_rollout_ref.rollout.checkpoint_engine"
    overrides = [
        "actor_rollout_ref.rollout.name=vllm",
        f"{ce}.backend=deltarefit",
        f"{ce}.custom_backend_module=deltarefit.integrations.verl",
        f"+{ce}.engine_kwargs.deltarefit.stream={stream}",
        f"+{ce}.engine_kwargs.deltarefit.state_dir={state_dir}",
        f"+{ce}.engine_kwargs.deltarefit.served=BF16",
        f"+{ce}.engine_kwargs.deltarefit.checkpoint={tmp}/rollout.safetensors",
        f"+{ce}.engine_kwargs.deltarefit.timeout_s=60",
        *extra,
    ]
    with initialize_config_dir(config_dir=cfgdir, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=overrides)
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)


def _trainer_engine(ce_config, rank: int):
    """As ``ActorRolloutRefWorker.init_model`` builds it (verl/workers/engine_workers.py, "build checkpoint
    engine"), with ``torch.distributed.get_rank()`` given as ``rank``."""
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    backend = ce_config.backend
    bucket_size = ce_config.update_weights_bucket_megabytes << 20
    engine_kwargs = ce_config.engine_kwargs.get(backend, {})
    import_external_libs(ce_config.custom_backend_module or None)
    return CheckpointEngineRegistry.new(backend, is_master=(rank == 0), bucket_size=bucket_size, **engine_kwargs)


class RecordingAdapter:
    """A rollout server adapter (verl's ``BaseRollout``) that keeps what it is handed, as verl's vLLM adapter
    walks it (``ensure_async_iterator``)."""

    def __init__(self) -> None:
        self.received: dict[str, torch.Tensor] = {}
        self.steps: list[int | None] = []

    async def resume(self, tags):
        pass

    async def release(self):
        pass

    async def update_weights(self, weights, global_steps=None, wire_format="named_tensors", **kwargs):
        from verl.workers.rollout.utils import ensure_async_iterator

        self.wire_format = wire_format
        self.received = {}
        async for name, t in ensure_async_iterator(weights):
            self.received[name] = t.clone() if isinstance(t, torch.Tensor) else t
        self.steps.append(global_steps)


@pytest.fixture(scope="module")
def env():
    """The environment verl gives a worker (RANK, WORLD_SIZE, MASTER_*): ``CheckpointEngineWorker`` starts a
    one-process gloo group from it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _rollout_worker(rollout_config):
    from verl.checkpoint_engine.base import BaseRollout, CheckpointEngineWorker

    adapter_cls = type("RecordingRollout", (RecordingAdapter, BaseRollout), {})
    return CheckpointEngineWorker(rollout_config, None, server_adapter=adapter_cls())


def test_configured_engine_refits_bit_exact(tmp_path, env):
    """Selected by configuration alone; four rounds (a keyframe, then deltas) from a trainer of two ranks
    to verl's rollout worker: it hands its adapter exactly the trainer's served bits every round. Then a
    delta changed in the store and a rollout copy that is not the delta's base: the worker's update
    fails, its adapter is handed nothing, and a later good round goes on."""
    from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineManager

    rc = _config(str(tmp_path / "stream"), str(tmp_path / "state"), str(tmp_path))
    manager = CheckpointEngineManager(rc.checkpoint_engine, actor_wg=None, replicas=[])
    assert manager.backend_cls.__name__ == "DeltaRefitCheckpointEngine"
    assert issubclass(manager.backend_cls, CheckpointEngine)
    trainers = [_trainer_engine(rc.checkpoint_engine, rank) for rank in (0, 1)]
    worker = _rollout_worker(rc)
    assert isinstance(worker.checkpoint_engine, manager.backend_cls) and not worker.checkpoint_engine.trainer
    adapter = worker.server_adapter

    async def via_worker(engine, step):  # verl's CheckpointEngineWorker.update_weights
        assert engine is worker.checkpoint_engine
        await worker.update_weights(global_steps=step)

    def weights(m):
        return lambda: ((n, t.detach()) for n, t in m.state_dict().items())

    def round_(m, step):
        sent, got = asyncio.run(run_round(manager.backend_cls, trainers, [worker.checkpoint_engine], weights(m),
                                          step, receive=via_worker))
        return sent, got[0]

    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    for step in range(1, 5):
        if step > 1:
            train_step(m, opt, step)
        sent, err = round_(m, step)
        assert err is None, err
        assert sent[0]["deltarefit/version"] == step and sent[1] == {}
        assert sent[0]["deltarefit/keyframe"] == float(step == 1)
        same_bits(adapter.received, served(m))
        assert adapter.steps[-1] == step
        assert load_commit(trainers[0].store, step).step == step
    assert [load_commit(trainers[0].store, v).kind for v in range(1, 5)] == ["keyframe"] + ["delta"] * 3

    # a delta changed in the store
    engine = worker.checkpoint_engine
    train_step(m, opt, 5)
    handed = len(adapter.steps)
    orig = engine.wait_handoff

    async def tampering_wait():
        body = await orig()
        rec = load_commit(engine.store, body["version"])
        path = os.path.join(str(tmp_path / "stream"), rec.delta.key)
        with open(path, "r+b") as f:
            f.seek(rec.delta.bytes // 2)
            b = f.read(1)
            f.seek(rec.delta.bytes // 2)
            f.write(bytes([b[0] ^ 0x01]))
        return body

    engine.wait_handoff = tampering_wait
    sent, err = round_(m, 5)
    engine.wait_handoff = orig
    assert sent[0]["deltarefit/version"] == 5
    assert isinstance(err, DeltaRefitError), err
    assert len(adapter.steps) == handed and adapter.received == {}  # called, and handed nothing
    assert engine.subscriber.current()[0] == 4


def test_wrong_base_and_signatures(tmp_path, env):
    """Signed records (signing_key / verify_key in engine_kwargs); the rollout's copy edited by hand is
    not the next delta's base: refused, nothing handed over."""
    keygen(str(tmp_path / "trainer.key"))
    ce = "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.deltarefit"
    rc = _config(str(tmp_path / "stream"), str(tmp_path / "state"), str(tmp_path),
                 [f"+{ce}.signing_key={tmp_path}/trainer.key", f"+{ce}.verify_key={tmp_path}/trainer.key.pub"])
    from verl.checkpoint_engine import CheckpointEngineRegistry

    cls = CheckpointEngineRegistry.get("deltarefit")
    trainers = [_trainer_engine(rc.checkpoint_engine, 0)]
    worker = _rollout_worker(rc)

    async def via_worker(engine, step):
        await worker.update_weights(global_steps=step)

    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    for step in (1, 2):
        if step > 1:
            train_step(m, opt, step)
        _, got = asyncio.run(run_round(cls, trainers, [worker.checkpoint_engine],
                                       lambda: iter(list(m.state_dict().items())), step, receive=via_worker))
        assert got[0] is None, got[0]
        same_bits(worker.server_adapter.received, served(m))
    assert load_commit(trainers[0].store, 2).signature

    ck = worker.checkpoint_engine.checkpoint
    with open(ck, "r+b") as f:
        f.seek(os.path.getsize(ck) - 3)
        b = f.read(1)
        f.seek(os.path.getsize(ck) - 3)
        f.write(bytes([b[0] ^ 0x01]))
    train_step(m, opt, 3)
    _, got = asyncio.run(run_round(cls, trainers, [worker.checkpoint_engine],
                                   lambda: iter(list(m.state_dict().items())), 3, receive=via_worker))
    assert isinstance(got[0], DeltaRefitError) and "repair" in str(got[0]), got[0]
    assert worker.server_adapter.received == {}


def test_in_place_reaches_the_adapter(tmp_path, env):
    """in_place=true: verl's rollout worker hands its adapter the wire format ``deltarefit`` and the vLLM
    backend's update request (what the patched adapter in docs/FRAMEWORKS.md sends to the engine)."""
    ce = "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.deltarefit"
    rc = _config(str(tmp_path / "stream"), str(tmp_path / "state"), str(tmp_path), [f"+{ce}.in_place=true"])
    from verl.checkpoint_engine import CheckpointEngineRegistry

    worker = _rollout_worker(rc)

    async def via_worker(engine, step):
        await worker.update_weights(global_steps=step)

    m = model()
    trainers = [_trainer_engine(rc.checkpoint_engine, 0)]
    _, got = asyncio.run(run_round(CheckpointEngineRegistry.get("deltarefit"), trainers, [worker.checkpoint_engine],
                                   lambda: iter(list(m.state_dict().items())), 1, receive=via_worker))
    assert got[0] is None, got[0]
    assert worker.server_adapter.wire_format == "deltarefit"
    assert worker.server_adapter.received == {
        "deltarefit": {"init_info": {"stream": str(tmp_path / "stream")}, "update_info": {"version": 1}}}


def test_verl_checkpoint_manager_over_ray(tmp_path):
    """verl's own ``CheckpointEngineManager.update_weights`` over Ray, as verl's checkpoint-engine tests drive
    it (on the CPU): an actor group of 2 trainer workers and 2 rollout workers (verl's
    ``CheckpointEngineWorker``, one replica of TP=2), each building its engine from the config, the
    manager's real dispatch (prepare, build_topology, init_process_group, the update on both sides,
    finalize). Three rounds; every rollout worker is handed trainer rank 0's served bits each time."""
    ray = pytest.importorskip("ray", reason="Ray is not installed here (make test-verl installs verl with it)")
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.single_controller.ray.base import split_resource_pool

    here = os.path.dirname(os.path.abspath(__file__))
    src = os.path.join(os.path.dirname(here), "src")
    rc = _config(str(tmp_path / "stream"), str(tmp_path / "state"), str(tmp_path),
                 ["actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                  f"+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.deltarefit.local_dir={tmp_path}/copies",
                  "~actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.deltarefit.checkpoint"])
    # A cluster of its own (address="local"), whose files and address record stay in its own temp dir
    # (short: Ray's socket paths must fit AF_UNIX), so that no other Ray user on the host finds it.
    ray_tmp = tempfile.mkdtemp(prefix="dr-ray-", dir="/tmp")
    ray.init(address="local", _temp_dir=ray_tmp, num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([src, here])}})
    try:
        import _verl_ray_workers as w

        pool = RayResourcePool(process_on_nodes=[4], use_gpu=False, max_colocate_count=1)
        trainer_pool, rollout_pool = split_resource_pool(pool, [2, 2])
        trainer = RayWorkerGroup(resource_pool=trainer_pool, ray_cls_with_init=RayClassWithInitArgs(
            cls=ray.remote(w.Trainer), checkpoint_engine_config=rc.checkpoint_engine), device_name="cpu")
        rollout = RayWorkerGroup(resource_pool=rollout_pool, ray_cls_with_init=RayClassWithInitArgs(
            cls=ray.remote(w.Rollout), rollout_config=rc), device_name="cpu")
        replica = w.Replica(replica_rank=0, config=rc, model_config=None)
        asyncio.run(replica.init_hybrid(rollout))
        manager = CheckpointEngineManager(rc.checkpoint_engine, actor_wg=trainer, replicas=[replica])
        assert manager.backend_cls.__name__ == "DeltaRefitCheckpointEngine"
        copies = rollout.copy_path()
        assert len(set(copies)) == 2 and all(c.startswith(f"{tmp_path}/copies/") for c in copies), copies
        for step in (1, 2, 3):
            if step > 1:
                trainer.train(step)
            metrics = manager.update_weights(global_steps=step)
            assert metrics["deltarefit/version"] == step, metrics
            want = trainer.served()[0]
            for got in rollout.received():
                same_bits(got, want)
            assert load_commit(_store(tmp_path), step).kind == ("keyframe" if step == 1 else "delta")
    finally:
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _store(tmp_path):
    from deltarefit.storage.base import open_store

    return open_store(str(tmp_path / "stream"), create=False)
