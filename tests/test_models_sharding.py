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
