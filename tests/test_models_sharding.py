"""Parameters sharded by the rules table over 8 virtual CPU devices give the unsharded forward."""
import jax
import numpy as np
import pytest
from flax import nnx

from steprl_jax.models import ModelConfig, Transformer
from steprl_jax.models.sharding import batch_sharding, make_mesh, shard_model


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_sharded_forward_equals_unsharded(family):
    assert len(jax.devices()) == 8
    config = ModelConfig.tiny(family)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (4, 10))
    mask = np.ones((4, 10), np.int32)
    mask[1, :3] = 0  # one left-padded row

    forward = nnx.jit(lambda m, ids, mask: m(ids, attention_mask_bt=mask))
    model = Transformer(config, rngs=nnx.Rngs(0))
    expected = np.asarray(forward(model, ids, mask))

    mesh = make_mesh(data=1, fsdp=2, tensor=4)
    sharded = shard_model(Transformer(config, rngs=nnx.Rngs(0)), mesh)
    q = sharded.layers.q.get_value()
    assert len(q.sharding.device_set) == 8 and q.addressable_shards[0].data.shape != q.shape
    ids_s = jax.device_put(ids, batch_sharding(mesh))
    mask_s = jax.device_put(mask, batch_sharding(mesh))
    np.testing.assert_allclose(np.asarray(forward(sharded, ids_s, mask_s)), expected, atol=1e-5, rtol=1e-5)


def test_loading_with_a_mesh_puts_each_tensor_straight_on_its_shards(tmp_path):
    """An exported checkpoint loaded with a mesh: every parameter arrives sharded (no device holds
    a whole sharded tensor) and the forward equals the one-device load."""
    from steprl_jax.models import export_hf, load_pretrained
    from swirl_helpers import smol_tokenizer, tiny_model

    tokenizer = smol_tokenizer()
    folder = export_hf(tiny_model(tokenizer, seed=2, hidden_size=64, num_heads=4, num_kv_heads=2), tokenizer,
                       str(tmp_path / "m"))
    plain, _ = load_pretrained(folder)
    mesh = make_mesh(data=1, fsdp=4, tensor=2)
    sharded, _ = load_pretrained(folder, mesh=mesh)
    for name in ("embed", "layers.q", "layers.gate", "layers.down"):
        value = sharded
        for part in name.split("."):
            value = getattr(value, part)
        array = value.get_value()
        assert len(array.sharding.device_set) == 8, name
        assert array.addressable_shards[0].data.size < array.size, name  # a share, not the whole
    ids = np.random.default_rng(1).integers(0, 1000, (2, 9))
    forward = nnx.jit(lambda m, ids: m(ids))
    np.testing.assert_allclose(np.asarray(forward(sharded, ids)), np.asarray(forward(plain, ids)), atol=1e-5, rtol=1e-5)
