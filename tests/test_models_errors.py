"""Bad input gives one clear error naming the file and the tensor or field; tiny GGUF round trip."""
import json
import os

import gguf
import numpy as np
import pytest
from flax import nnx

from steprl_jax.models import CheckpointError, ConfigError, ModelConfig, Transformer, export_hf, load_pretrained
from steprl_jax.models.hf_weights import weight_rules
from steprl_jax.models.safetensors_io import SafetensorsFile, write_safetensors


@pytest.fixture(scope="module")
def tiny():
    return Transformer(ModelConfig.tiny("llama", tie_embeddings=False), rngs=nnx.Rngs(0))


@pytest.fixture
def hf_dir(tiny, tmp_path):
    return export_hf(tiny, None, str(tmp_path / "tiny"))


def _edit_config(directory, **changes):
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(changes)
    with open(path, "w") as f:
        json.dump(config, f)
    return path


def _edit_tensors(directory, edit):
    path = os.path.join(directory, "model.safetensors")
    f = SafetensorsFile(path)
    tensors = [(n, f.get(n)) for n in f.keys()]
    write_safetensors(path, edit(tensors))
    return path


def test_missing_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing.gguf"):
        load_pretrained(str(tmp_path / "nothing.gguf"))
    with pytest.raises(FileNotFoundError, match="neither a preset"):
        load_pretrained("no-such-model")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_pretrained(str(tmp_path))


def test_missing_weights_file(hf_dir):
    os.remove(os.path.join(hf_dir, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_pretrained(hf_dir)


def test_unknown_architecture(hf_dir):
    path = _edit_config(hf_dir, model_type="gpt_neox")
    with pytest.raises(ConfigError, match=f"{path}.*model_type 'gpt_neox'"):
        load_pretrained(hf_dir)


def test_unsupported_rope_type(hf_dir):
    path = _edit_config(hf_dir, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
    with pytest.raises(ConfigError, match=f"{path}.*rope scaling type 'yarn'"):
        load_pretrained(hf_dir)


def test_wrong_tensor_shape(hf_dir):
    name = "model.layers.1.mlp.up_proj.weight"
    path = _edit_tensors(hf_dir, lambda ts: [(n, t[:, :-1] if n == name else t) for n, t in ts])
    with pytest.raises(CheckpointError, match=f"{path}.*{name}"):
        load_pretrained(hf_dir)


def test_missing_tensor(hf_dir):
    name = "model.layers.0.self_attn.k_proj.weight"
    path = _edit_tensors(hf_dir, lambda ts: [(n, t) for n, t in ts if n != name])
    with pytest.raises(CheckpointError, match=f"{path}.*missing tensor '{name}'"):
        load_pretrained(hf_dir)


def test_unexpected_tensor(hf_dir):
    path = _edit_tensors(hf_dir, lambda ts: ts + [("model.layers.0.mlp.extra.weight", np.zeros(3, np.float32))])
    with pytest.raises(CheckpointError, match=f"{path}.*unexpected tensor 'model.layers.0.mlp.extra.weight'"):
        load_pretrained(hf_dir)


# ------------------------------------------------------------------ GGUF
def _permute_rows(w, heads):
    """llama.cpp's converter permutation (HF rotate-half rows -> interleaved pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(model, path, arch="llama", extra_fields=()):
    """A tiny float32 GGUF file written the way llama.cpp's converter lays out a llama model."""
    c = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_heads)
    writer.add_head_count_kv(c.num_kv_heads)
    writer.add_rope_freq_base(c.rope.theta)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    for key, value in extra_fields:
        writer.add_uint32(key, value)
    gguf_names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                  "lm_head.weight": "output.weight"}
    layer_names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                   "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
                   "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "post_attention_layernorm": "ffn_norm"}
    for rule in weight_rules(c):
        value = np.asarray(getattr(model, rule.ours) if "." not in rule.ours
                           else getattr(model.layers, rule.ours.split(".")[1]))
        for i in range(c.num_layers if rule.per_layer else 1):
            hf_name = rule.hf.format(i=i)
            w = rule.to_hf(value[i] if rule.per_layer else value)
            if rule.per_layer:
                inner = hf_name.split(".", 3)[3].rsplit(".", 1)[0]
                name = f"blk.{i}.{layer_names[inner]}.weight"
            else:
                name = gguf_names[hf_name]
            if name.endswith("attn_q.weight"):
                w = _permute_rows(w, c.num_heads)
            elif name.endswith("attn_k.weight"):
                w = _permute_rows(w, c.num_kv_heads)
            writer.add_tensor(name, np.ascontiguousarray(w, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_gguf_llama_round_trip(tiny, tmp_path):
    """Q/K rows permuted as llama.cpp does come back in HF order: same logits as the original."""
    path = _write_gguf(tiny, tmp_path / "tiny.gguf")
    with pytest.raises(CheckpointError, match="tiny.gguf.*no tokenizer"):
        load_pretrained(path)  # our tiny file carries no vocabulary
    from steprl_jax.models.gguf_io import GGUFCheckpoint
    from steprl_jax.models.loading import build_from_tensors

    checkpoint = GGUFCheckpoint(path)
    assert checkpoint.config.replace(eos_token_ids=(), pad_token_id=None, bos_token_id=None,
                                     rms_norm_eps=1e-6) == tiny.config  # GGUF stores eps as float32
    loaded = build_from_tensors(checkpoint.config, checkpoint.fetch, checkpoint.tensor_names, source=path)
    ids = np.arange(12)[None] % tiny.config.vocab_size
    np.testing.assert_allclose(np.asarray(loaded(ids)), np.asarray(tiny(ids)), atol=1e-5, rtol=0)


def test_gguf_unknown_architecture(tiny, tmp_path):
    path = _write_gguf(tiny, tmp_path / "falcon.gguf", arch="falcon")
    with pytest.raises(ConfigError, match="falcon.gguf.*architecture 'falcon'"):
        load_pretrained(path)


def test_gguf_unknown_field(tiny, tmp_path):
    path = _write_gguf(tiny, tmp_path / "odd.gguf", extra_fields=[("llama.expert_count", 8)])
    with pytest.raises(ConfigError, match="odd.gguf.*'llama.expert_count'"):
        load_pretrained(path)


def _reader_fields(path):
    """gguf.GGUFReader's view of a file's metadata, as plain Python values (the reference)."""
    fields = {}
    for name, field in gguf.GGUFReader(path).fields.items():
        value = field.contents()
        fields[name] = value.item() if isinstance(value, np.generic) else value
    return {k: v for k, v in fields.items() if k not in ("GGUF.tensor_count", "GGUF.kv_count")}


def _same_as_reader(path):
    from steprl_jax.models.gguf_file import read_gguf

    metadata, tensors = read_gguf(path)
    assert metadata == _reader_fields(path)
    reference = gguf.GGUFReader(path).tensors
    assert [t.name for t in tensors] == [t.name for t in reference]
    for ours, theirs in zip(tensors, reference):
        assert ours.tensor_type == theirs.tensor_type and ours.shape == tuple(int(d) for d in theirs.shape)
        assert ours.data.dtype == theirs.data.dtype and ours.data.shape == theirs.data.shape, ours.name
        np.testing.assert_array_equal(ours.data, theirs.data)
    return metadata, tensors


def test_gguf_container_reads_what_the_gguf_package_reads(tmp_path):
    """Every value type, arrays of numbers and strings, a non-default alignment, plain and
    block-quantized tensors: the same metadata and tensor views as gguf.GGUFReader."""
    path = str(tmp_path / "all.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint32("general.alignment", 64)
    for add, key, value in [(writer.add_uint8, "t.u8", 200), (writer.add_int8, "t.i8", -5),
                            (writer.add_uint16, "t.u16", 60_000), (writer.add_int16, "t.i16", -300),
                            (writer.add_int32, "t.i32", -70_000), (writer.add_float32, "t.f32", 0.1),
                            (writer.add_bool, "t.bool", True), (writer.add_uint64, "t.u64", 2 ** 40),
                            (writer.add_int64, "t.i64", -2 ** 40), (writer.add_float64, "t.f64", 0.1),
                            (writer.add_string, "t.str", "wörld <|im_end|>")]:
        add(key, value)
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, 1.5])
    writer.add_array("t.strings", ["a", "", "日本"])
    rng = np.random.default_rng(0)
    writer.add_tensor("plain", rng.normal(size=(3, 64)).astype(np.float32))
    writer.add_tensor("half", rng.normal(size=(2, 32)).astype(np.float16))
    q8 = gguf.quants.quantize(rng.normal(size=(4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    metadata, tensors = _same_as_reader(path)
    assert metadata["t.bool"] is True and metadata["t.strings"] == ["a", "", "日本"] and metadata["t.i64"] == -2 ** 40
    assert [t.data.shape for t in tensors] == [(3, 64), (2, 32), (4, 68)]  # Q8_0: 2 blocks of 34 bytes a row


def test_gguf_container_of_the_real_checkpoint():
    """SmolLM2's GGUF (Q4_1, Q8_0 and F32 tensors, a 49,152-token vocabulary and its merges)."""
    from steprl_jax.models.pretrained import resolve_source

    metadata, _ = _same_as_reader(resolve_source("smollm2-135m-instruct"))
    assert len(metadata["tokenizer.ggml.tokens"]) == 49152


def test_gguf_container_bad_files(tiny, tmp_path):
    from steprl_jax.models.gguf_file import read_gguf

    good = open(_write_gguf(tiny, tmp_path / "tiny.gguf"), "rb").read()
    cases = {"empty": (b"", "empty"), "magic": (b"GGML" + good[4:], "not a GGUF file"),
             "version": (good[:4] + (7).to_bytes(4, "little") + good[8:], "version 7 is not supported"),
             "big_endian": (good[:4] + (3).to_bytes(4, "big") + good[8:], "big-endian"),
             "header": (good[:200], "truncated GGUF file"),
             "utf8": (good.replace(b"llama", b"ll\xffma", 1), "not UTF-8"),
             "data": (good[:-16], "past the file's end")}
    for name, (data, message) in cases.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(data)
        with pytest.raises(CheckpointError, match=f"{name}.gguf.*{message}"):
            read_gguf(str(path))
