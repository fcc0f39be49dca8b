"""tools/bench_quant.py: the official baseline reproduction and an end-to-end table on a tiny model."""

import json
from types import SimpleNamespace

import pytest
import torch

from tools.bench.bench_quant import METHODS, TECHNIQUES, main, official_int8_zlib, run_bench


def test_official_baseline_semantics():
    g = torch.Generator().manual_seed(0)
    sd = {"big.weight": torch.randn(300, 300, generator=g) * 0.05, "blocks.0.attn_scale": torch.rand(300, generator=g),
          "small.weight": torch.randn(10, 10, generator=g)}
    nbytes, out = official_int8_zlib(sd)
    assert nbytes > 0
    assert torch.equal(out["blocks.0.attn_scale"], sd["blocks.0.attn_scale"])  # control tensors stay fp32
    assert torch.equal(out["small.weight"], sd["small.weight"].half().float())
    # scale is clamped to >= 1/127: weights of magnitude ~0.05 land on a 1/127 grid
    grid = out["big.weight"] / torch.tensor(1 / 127).half().float()
    assert torch.allclose(grid, grid.round(), atol=1e-4)


@pytest.mark.slow
def test_bench_runs_end_to_end(tmp_path, tiny_dataset, sp1024_model):
    import model.gpt as trainer_model
    from safetensors.torch import save_file

    from tests.test_quant_artifact import tiny_model_config

    config = tiny_model_config(vocab_size=1024)
    torch.manual_seed(0)
    model = trainer_model.GPT(**config)
    if hasattr(model, "init_weights"):
        model.init_weights(0.02)
    ckpt = tmp_path / "prequant.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(ckpt),
              metadata={"model_config": json.dumps(config)})
    args = SimpleNamespace(checkpoint=str(ckpt), data_path=str(tiny_dataset), tokenizer=str(sp1024_model),
                           val_tokens=2048, seq_len=128, calib_batches=2, calib_tokens=1024, bits=[6, 5], compressor="zlib")
    table = run_bench(args)
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    frontier = [r for r in rows if r.split("|")[1].strip() in ("6", "5")]
    assert [r.split("|")[2].strip() for r in frontier] == list(METHODS) * 2
    assert all("+zlib" in r for r in frontier) and "GPTQ calibration: 2 train batches x 1024 tokens, 13 Hessians" in table
    assert "int5 check: full GPTQ d val_bpb" in table
    comp = [r for r in rows if r.split("|")[2].strip() in ("on", "off")]
    assert len(comp) == 16 and sum("(auto)" in r for r in comp) >= 1
    assert any(r.startswith("| official torch.save int8") for r in rows)
    with pytest.raises(SystemExit) as exit_info:
        main([str(ckpt), "--data-path", str(tiny_dataset), "--tokenizer", str(sp1024_model), "--bits", "9"])
    assert exit_info.value.code == 2


def test_technique_table(tmp_path, tiny_dataset, sp1024_model):
    import model.gpt as trainer_model
    from safetensors.torch import save_file

    from tests.test_quant_artifact import tiny_model_config

    config = tiny_model_config(vocab_size=1024)
    torch.manual_seed(0)
    model = trainer_model.GPT(**config)
    ckpt = tmp_path / "prequant.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(ckpt),
              metadata={"model_config": json.dumps(config)})
    args = SimpleNamespace(checkpoint=str(ckpt), data_path=str(tiny_dataset), tokenizer=str(sp1024_model),
                           val_tokens=1024, seq_len=128, compressor="zlib", techniques="5/6")
    table = run_bench(args)
    rows = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| blocks int5, embed int6")]
    assert [r[1].strip() for r in rows] == list(TECHNIQUES)
    assert rows[0][5].strip() == "+0" and rows[0][6].strip() == "+0.00000"
    by = {r[1].strip(): r for r in rows}
    assert by["SDClip"][2] != by["GPTQ-lite (today)"][2]  # a different quantizer, different bytes
    assert all("+zlib" in r[7] or "+grouped" in r[7] for r in rows)
    assert all("+grouped" not in r[7] for name, r in by.items() if "grouped" not in name)
    with pytest.raises(SystemExit) as exit_info:
        main([str(ckpt), "--data-path", str(tiny_dataset), "--tokenizer", str(sp1024_model), "--techniques", "5/9"])
    assert exit_info.value.code == 2


def test_gptq_technique_and_equal_bytes_tables(tmp_path, tiny_dataset, sp1024_model):
    """--gptq: the technique table on full GPTQ (with the tied embedding's GPTQ rows); --budget: every
    technique set fitted to the same bytes/param, under it, its fitted bits listed."""
    import model.gpt as trainer_model
    from safetensors.torch import save_file

    from tests.test_quant_artifact import tiny_model_config
    from tools.bench.bench_quant import FIT_TECHNIQUES, GPTQ_TECHNIQUES

    config = tiny_model_config(vocab_size=1024)
    torch.manual_seed(0)
    model = trainer_model.GPT(**config)
    model.init_weights(0.02)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    ckpt = tmp_path / "prequant.safetensors"
    save_file(state, str(ckpt), metadata={"model_config": json.dumps(config)})
    num_params = sum(t.numel() for t in state.values())
    args = SimpleNamespace(checkpoint=str(ckpt), data_path=str(tiny_dataset), tokenizer=str(sp1024_model),
                           val_tokens=1024, seq_len=128, compressor="zlib", techniques="6/8", gptq=True, budget=[0.8],
                           calib_batches=2, calib_tokens=1024)
    table = run_bench(args)
    assert "13 Hessians" in table and "full GPTQ on" in table
    rows = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| blocks int6, embed int8")]
    by = {r[1].strip(): r for r in rows}
    assert list(by) == list(GPTQ_TECHNIQUES)
    assert by["+ GPTQ embed (default)"][2] != by["full GPTQ, embedding by clip search"][2]  # another embedding
    fitted = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| 0.8 |")]
    assert [r[1].strip() for r in fitted] == list(FIT_TECHNIQUES)
    for r in fitted:
        assert int(r[2].replace(",", "")) <= int(0.8 * num_params) and r[6].strip()
