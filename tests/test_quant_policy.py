"""quant/policy.py: formats by parameter name, env overrides, serialization."""

import dataclasses
import json
import warnings

import pytest

from quant.offline import quant_env_names, quant_policy_from_dict
from quant.policy import QuantPolicy

D, V, H = 512, 1024, 8
CONTRACT_SHAPES = {
    "tok_emb.weight": (V, D), "lm_head.weight": (V, D), "skip_weights": (4, D),
    "blocks.0.attn.c_q.weight": (D, D), "blocks.0.attn.c_k.weight": (256, D), "blocks.0.attn.c_v.weight": (256, D),
    "blocks.0.attn.proj.weight": (D, D), "blocks.0.attn.q_gain": (H,), "blocks.0.mlp.fc.weight": (3 * D, D),
    "blocks.0.mlp.proj.weight": (D, 3 * D), "blocks.0.attn_scale": (D,), "blocks.0.mlp_scale": (D,),
    "blocks.0.resid_mix": (2, D),
}


def test_default_formats_of_contract_names():
    p = QuantPolicy()
    bits = {name: p.bits_for(name, shape) for name, shape in CONTRACT_SHAPES.items()}
    assert bits == {  # unset groups start at int8 (the fit steps them down only when over budget)
        "tok_emb.weight": 8, "lm_head.weight": 8, "skip_weights": None,
        "blocks.0.attn.c_q.weight": 8, "blocks.0.attn.c_k.weight": 8, "blocks.0.attn.c_v.weight": 8,
        "blocks.0.attn.proj.weight": 8, "blocks.0.attn.q_gain": None, "blocks.0.mlp.fc.weight": 8,
        "blocks.0.mlp.proj.weight": 8, "blocks.0.attn_scale": None, "blocks.0.mlp_scale": None,
        "blocks.0.resid_mix": None,
    }
    assert all(p.fittable(n, s) == (b is not None) for (n, s), b in zip(CONTRACT_SHAPES.items(), bits.values()))
    # named matrices are quantized at any size; unnamed ones only above the passthrough size
    assert p.bits_for("blocks.0.attn.c_q.weight", (8, 8)) == 8
    assert p.bits_for("bigram.weight", (256, 256)) is None
    assert p.bits_for("bigram.weight", (512, 256)) == 8
    assert p.bits_for("blocks.0.attn.gate.weight", (8, 512)) is None  # control pattern wins
    groups = {name: p.group_of(name, shape) for name, shape in CONTRACT_SHAPES.items()}
    assert groups["blocks.0.mlp.fc.weight"] == "mlp"
    assert groups["tok_emb.weight"] == groups["lm_head.weight"] == "embed" and groups["skip_weights"] == "control"
    assert groups["blocks.0.attn.c_q.weight"] == "attn" and p.group_of("bigram.weight", (512, 256)) == "other"


def test_fitted_bits_explicit_groups_and_overrides():
    p = QuantPolicy(mlp_bits=6, overrides=(("blocks.1.", 7),)).with_bits("blocks.0.attn.c_q.weight", 5)
    p = p.with_bits("blocks.0.attn.c_q.weight", 4).with_bits("tok_emb.weight", 7)
    assert p.fitted == (("blocks.0.attn.c_q.weight", 4), ("tok_emb.weight", 7))
    shape = (64, 64)
    assert p.bits_for("blocks.0.attn.c_q.weight", shape) == 4 and p.bits_for("blocks.0.attn.c_k.weight", shape) == 8
    assert p.bits_for("blocks.0.mlp.fc.weight", shape) == 6 and p.bits_for("blocks.1.attn.c_q.weight", shape) == 7
    # the fit may change unset groups only: never an explicit group, an override or a control tensor
    assert p.fittable("blocks.0.attn.c_k.weight", shape) and p.fittable("tok_emb.weight", shape)
    assert not p.fittable("blocks.0.mlp.fc.weight", shape) and not p.fittable("blocks.1.attn.c_q.weight", shape)
    assert not p.fittable("blocks.0.attn_scale", (64,)) and not dataclasses.replace(p, fit=False).fittable(
        "blocks.0.attn.c_k.weight", shape)
    q = QuantPolicy.from_env({"QUANT_FITTED": "blocks.0.attn.c_q.weight:4,tok_emb.weight:7", "QUANT_MLP_BITS": "6",
                              "QUANT_OVERRIDES": "blocks.1.:7"})
    assert q == p
    with pytest.raises(ValueError, match="QUANT_FITTED"):
        QuantPolicy.from_env({"QUANT_FITTED": "tok_emb.weight:0"})  # the fit never chooses float


def test_from_env_overrides_and_validation():
    env = {"QUANT_MLP_BITS": "5", "QUANT_EMBED_BITS": "7", "QUANT_FLOAT_DTYPE": "float32",
           "QUANT_OVERRIDES": "blocks.0.:8, tok_emb:0", "QUANT_GPTQ_LITE": "0", "QUANT_PRUNE_FRACTION": "0.03",
           "QUANT_COMPRESSOR": "lzma", "QUANT_PACKING": "bits", "QUANT_FIT": "0"}
    p = QuantPolicy.from_env(env)
    assert (p.mlp_bits, p.embed_bits, p.float_dtype, p.gptq_lite, p.prune_fraction) == (5, 7, "float32", False, 0.03)
    assert (p.compressor, p.packing, p.fit) == ("lzma", "bits", False)
    assert p.bits_for("blocks.0.mlp.fc.weight", (1536, 512)) == 8  # first override wins
    assert p.bits_for("blocks.1.mlp.fc.weight", (1536, 512)) == 5
    assert p.bits_for("tok_emb.weight", (V, D)) is None  # 0 = float passthrough
    p = QuantPolicy.from_env({"QUANT_MATRIX_BITS": "5", "QUANT_ATTN_BITS": "7"})
    assert (p.attn_bits, p.mlp_bits) == (7, 5)
    assert QuantPolicy.from_env({}) == QuantPolicy()
    for var, value, match in [
        ("QUANT_MLP_BITS", "six", "QUANT_MLP_BITS='six'"), ("QUANT_ATTN_BITS", "9", "QUANT_ATTN_BITS"),
        ("QUANT_COMPRESSOR", "bzip2", "QUANT_COMPRESSOR"), ("QUANT_SHUFFLE", "1", "QUANT_SHUFFLE"),
        ("QUANT_GPTQ_LITE", "yes", "QUANT_GPTQ_LITE"),
        ("QUANT_OVERRIDES", "blocks.0", "QUANT_OVERRIDES"), ("QUANT_PRUNE_FRACTION", "1.0", "QUANT_PRUNE_FRACTION"),
        ("QUANT_FLOAT_DTYPE", "float8", "QUANT_FLOAT_DTYPE"), ("QUANT_MATRIX_BITS", "1", "QUANT_MATRIX_BITS"),
    ]:
        with pytest.raises(ValueError, match=match):
            QuantPolicy.from_env({var: value})


def test_unknown_quant_variable_warns():
    lines = []
    QuantPolicy.from_env({"QUANT_MLP_BTIS": "5"}, log=lines.append)  # the trainer's settings report the same way
    assert lines == ["WARNING: unknown setting QUANT_MLP_BTIS='5' is ignored (did you mean QUANT_MLP_BITS?)"]
    QuantPolicy.from_env({name: "1" for name in ("QUANT_FIT", "QUANT_GPTQ_LITE")}, log=lines.append)
    assert len(lines) == 1
    names = quant_env_names()
    assert "QUANT_MATRIX_BITS" in names and "QUANT_ATTN_BITS" in names and "QUANT_CONTROL_PATTERNS" in names
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        QuantPolicy.from_env({name: "6" for name in names if name.endswith("_BITS")} | {"QUANT_FIT": "1", "OTHER": "x"})


def test_dict_roundtrip_through_json():
    p = QuantPolicy(mlp_bits=5, overrides=(("blocks.0.", 8),), fitted=(("tok_emb.weight", 7),), control_patterns=("q_gain",))
    assert quant_policy_from_dict(json.loads(json.dumps(p.to_dict()))) == p
    with pytest.raises(ValueError, match="fields"):
        quant_policy_from_dict({"mlp_bits": 5, "typo": 1})
    with pytest.raises(ValueError, match="mlp_bits=9"):
        quant_policy_from_dict({"mlp_bits": 9})


def test_policy_covers_the_real_model():
    import model.gpt as trainer_model
    from tests.test_quant_artifact import tiny_model_config

    config = dict(tiny_model_config(), tie_embeddings=False)
    model = trainer_model.GPT(**config)
    p = QuantPolicy(attn_bits=6, mlp_bits=6)
    for name, t in model.state_dict().items():
        bits = p.bits_for(name, tuple(t.shape))
        if t.ndim == 2 and name.startswith("blocks.") and not name.endswith("resid_mix"):
            assert bits == 6, name
        elif name in ("tok_emb.weight", "lm_head.weight"):
            assert bits == 8, name
        else:
            assert bits is None, name
