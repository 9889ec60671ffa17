"""With config.mesh the jobs load the policy straight onto the trainer's mesh
(`distributed.load_policy`: every tensor from the file to its shards, never whole on a device), and
whatever samples takes a copy where this process samples (`distributed.sampling_copy`, through the
sampler bridge as every later parameter push). Without a mesh nothing changes. With a mesh (8
virtual devices, tests/conftest.py) a SWiRL run runs its stages and collects what one device
collects, and an RL run warm-starts, trains LoRA adapters against a KL reference and evaluates.
"""
import os

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, SingleDeviceSharding

from steprl_jax.models import export_hf, load_pretrained
from steprl_jax.models.sharding import state_shardings
from steprl_jax.training import distributed
from swirl_helpers import smol_tokenizer, tiny_config, tiny_model

mesh_spec = distributed.MeshSpec.from_config  # config.mesh, read once as the jobs do


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    tokenizer = smol_tokenizer()
    model = tiny_model(tokenizer, seed=3, hidden_size=64, num_heads=4, num_kv_heads=2)
    return export_hf(model, tokenizer, str(tmp_path_factory.mktemp("mesh_load") / "model"))


def _config(workdir, source, mesh: bool, **sampler):
    config = tiny_config(workdir)
    config.model.source = source
    if mesh:
        config.mesh.data, config.mesh.fsdp = 2, -1  # 2 x 4 over the 8 devices
    for axis, size in sampler.items():
        setattr(config.mesh.sampler, axis, size)
    return config


def _leaves(tree) -> dict:
    """keystr(path) -> array of a pytree of nnx Variables (or of their shardings)."""
    leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return {jax.tree_util.keystr(p): (v.get_value() if isinstance(v, nnx.Variable) else v) for p, v in leaves}


def _arrays(model) -> dict:
    return _leaves(nnx.state(model, nnx.Param))


def test_the_policy_loads_straight_onto_the_trainer_mesh(folder, tmp_path, monkeypatch):
    assert len(jax.devices()) == 8
    config = _config(tmp_path, folder, mesh=True)
    mesh = distributed.train_mesh(mesh_spec(config.mesh))
    placed, real_put = [], jax.device_put

    def spy(x, *args, **kwargs):  # every placement during the load
        placed.append(args[0] if args else kwargs.get("device"))
        return real_put(x, *args, **kwargs)

    monkeypatch.setattr(jax, "device_put", spy)
    model, _ = distributed.load_policy(config)
    monkeypatch.undo()
    arrays = _arrays(model)
    assert len(placed) >= len(arrays)
    assert all(isinstance(s, NamedSharding) and s.mesh == mesh for s in placed), placed  # each tensor to its shards
    # right after the load: the trainer's shardings (those create_train_state places by), shares not wholes
    expected = _leaves(state_shardings(nnx.state(model, nnx.Param), mesh))
    split = 0
    for name, array in arrays.items():
        assert array.sharding == expected[name], name
        if any(axis is not None for axis in expected[name].spec):
            assert array.addressable_shards[0].data.size < array.size, name
            split += 1
    assert split >= 5  # embedding and the stacked layer weights at least
    plain, _ = load_pretrained(folder)
    for name, array in _arrays(plain).items():
        assert np.array_equal(np.asarray(arrays[name]), np.asarray(array)), name

    # the copy the sampler and local judges take: whole on this process's first device (config.mesh.sampler
    # all 1), the same values; the trainer's copy stays as it was
    bridge = distributed.sampler_bridge(mesh_spec(config.mesh))
    local = _arrays(distributed.sampling_copy(model, bridge))
    for name, array in local.items():
        assert array.sharding.device_set == {jax.local_devices()[0]}, name
        assert np.array_equal(np.asarray(array), np.asarray(arrays[name])), name
        assert arrays[name].sharding == expected[name], name
    # a job that only samples loads straight there
    for name, array in _arrays(distributed.load_policy(config, sampling=True)[0]).items():
        assert array.sharding == local[name].sharding, name

    # config.mesh.sampler over 2 local devices: the copy is split over them, as the sampler's pushes are
    config2 = _config(tmp_path, folder, mesh=True, fsdp=2)
    spread = _arrays(distributed.sampling_copy(model, distributed.sampler_bridge(mesh_spec(config2.mesh))))
    assert len(spread["['embed']"].sharding.device_set) == 2


def test_without_a_mesh_the_load_is_load_pretrained(folder, tmp_path):
    config = _config(tmp_path, folder, mesh=False)
    assert distributed.train_mesh(mesh_spec(config.mesh)) is None and distributed.sampler_bridge(mesh_spec(config.mesh)) is None
    model, _ = distributed.load_policy(config)
    assert distributed.sampling_copy(model, None) is model
    plain, _ = load_pretrained(folder, compute_dtype=config.model.compute_dtype)
    assert model.config == plain.config
    for name, array in _arrays(plain).items():
        ours = _arrays(model)[name]
        assert isinstance(ours.sharding, SingleDeviceSharding) and ours.sharding == array.sharding, name
        assert np.array_equal(np.asarray(ours), np.asarray(array)), name


def test_a_swirl_run_with_a_mesh_runs_and_collects_what_one_device_collects(folder, tmp_path):
    from steprl_jax.agents.records import RecordStore
    from steprl_jax.algorithms import swirl

    one = _config(tmp_path / "one", folder, mesh=False)
    one.stages = "collect"
    swirl.run(one)
    meshed = _config(tmp_path / "mesh", folder, mesh=True)
    meshed.stages = "collect,judge,filter,train,eval"  # rule judges, the rule reward model
    summary = swirl.run(meshed)
    assert summary["train"]["train_steps"] == 2
    assert {"base", "swirl"} <= set(summary["eval"])
    assert os.path.isfile(os.path.join(meshed.workdir, "policy", "swirl", "model.safetensors"))
    # the run's checkpoint folder as a source (base onto the mesh, then the checkpoint's parameters):
    # on the trainer's shardings, the exported policy's values
    mesh = distributed.train_mesh(mesh_spec(meshed.mesh))
    restored, _ = distributed.load_policy(meshed, os.path.join(meshed.workdir, "checkpoints", "swirl"))
    exported, _ = load_pretrained(os.path.join(meshed.workdir, "policy", "swirl"))
    expected = _leaves(state_shardings(nnx.state(restored, nnx.Param), mesh))
    for name, array in _arrays(exported).items():
        assert _arrays(restored)[name].sharding == expected[name], name
        np.testing.assert_array_equal(np.asarray(_arrays(restored)[name]), np.asarray(array), err_msg=name)
    # orbax reads each saved tensor straight onto the shards of the parameter it replaces
    from steprl_jax.models import orbax_policy

    base, _ = distributed.load_policy(meshed)
    direct = orbax_policy.restore_params(base, os.path.join(meshed.workdir, "checkpoints", "swirl"))
    for name, array in _arrays(direct).items():
        assert isinstance(array, jax.Array) and array.sharding == expected[name], name
    plain, _ = load_pretrained(os.path.join(meshed.workdir, "checkpoints", "swirl"))  # no mesh: one device
    for name, array in _arrays(exported).items():
        assert isinstance(_arrays(plain)[name].sharding, SingleDeviceSharding), name
        np.testing.assert_array_equal(np.asarray(_arrays(plain)[name]), np.asarray(array), err_msg=name)

    def steps(workdir):
        records = sorted(RecordStore(os.path.join(workdir, "trajectories.jsonl")).load(), key=lambda r: r.id)
        return [(r.id, [(s.action_ids, s.observation_ids) for s in r.steps]) for r in records]

    assert len(steps(one.workdir)) == 4 and steps(one.workdir) == steps(meshed.workdir)  # 2 questions x K=2


def test_an_rl_run_with_a_mesh_warm_starts_trains_lora_and_evaluates(folder, tmp_path):
    """The RL job from a checkpoint folder with a mesh: a two-update SFT warm start (trained on the
    mesh, a checkpoint after each update, exported, loaded back onto it), LoRA adapters with the
    base as KL reference, the sampler's first parameters through the bridge (first ratio 1: the
    sampler holds what the trainer holds), held-out evaluation through that sampler, and the export."""
    from resume_helpers import checkpoint_steps
    from rl_helpers import VerdictServer, tiny_rl_config
    from steprl_jax.algorithms import online

    server = VerdictServer()
    try:
        c = tiny_rl_config(tmp_path, "grpo", server.base_url, iterations=1)
        c.model.source = folder
        c.mesh.data, c.mesh.fsdp = 2, -1
        c.rl.warm_start.updates, c.rl.warm_start.batch_size, c.rl.warm_start.save_every = 2, 2, 1
        c.rl.eval.num_tasks = 2
        c.lora.rank = 4
        c.rl.grpo.kl_coef = 0.01
        summary = online.run(c)
    finally:
        server.close()
    from steprl_jax.training.metrics_log import read_metrics

    metrics = read_metrics(str(tmp_path))
    assert [x["step"] for x in metrics["sft"]] == [1, 2] and [x["step"] for x in metrics["rl"]] == [1]
    assert checkpoint_steps(str(tmp_path), "sft") == [1, 2]  # a warm start killed part way resumes
    first = metrics["rl"][0]
    assert abs(first["first_ratio"] - 1.0) < 1e-5 and first["kl"] == pytest.approx(0.0, abs=1e-6)
    for name in ("sft", "rl"):
        assert os.path.isfile(tmp_path / "policy" / name / "model.safetensors"), name
    assert summary["eval"]["accuracy"] is not None
    assert os.path.isfile(tmp_path / "eval" / "iter_00000.metrics.json")
