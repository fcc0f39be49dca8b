"""The name map between PR #1855's GPT state dict and the kit's (model.gpt.GPT), both ways.

The record keeps each kind of block matrix of all L layers in one bank (its Muon steps them batched); the
kit keeps a CastedLinear per block. Every other tensor has the same name and shape, except the SmearGate's
linear. The map (i = layer 0..L-1):

    record                      kit
    qo_bank[i]                  blocks.i.attn.c_q.weight       [D, D]
    qo_bank[L + i]              blocks.i.attn.proj.weight      [D, D]
    kv_bank[i]                  blocks.i.attn.c_k.weight       [Hkv*Dh, D]
    kv_bank[L + i]              blocks.i.attn.c_v.weight       [Hkv*Dh, D]
    mlp_up_bank[i]              blocks.i.mlp.fc.weight         [F, D]
    mlp_down_bank[i]            blocks.i.mlp.proj.weight       [D, F]
    smear_gate.weight           smear_gate_w                   [1, GATE_WINDOW]
    anything else               the same name (tok_emb.weight, blocks.i.attn.q_gain, blocks.i.attn.attn_gate_w,
                                blocks.i.attn_scale, blocks.i.mlp_scale, blocks.i.resid_mix, skip_weights,
                                skip_gates, parallel_post_lambdas, parallel_resid_lambdas, smear_lambda)
"""

import torch

# bank name -> the kit's module of each of its L-row halves (one entry: the bank has L rows)
BANKS = {"qo_bank": ("attn.c_q", "attn.proj"), "kv_bank": ("attn.c_k", "attn.c_v"), "mlp_up_bank": ("mlp.fc",),
         "mlp_down_bank": ("mlp.proj",)}
RENAMES = {"smear_gate.weight": "smear_gate_w"}  # record -> kit


def record_to_kit(record_state: dict, num_layers: int) -> dict:
    """The kit's state dict {name: tensor} from the record's (tensors shared, not copied). Raises KeyError
    naming a bank whose row count is not what num_layers implies."""
    out = {}
    for name, t in record_state.items():
        if name in BANKS:
            parts = BANKS[name]
            if t.size(0) != len(parts) * num_layers:
                raise KeyError(f"{name}: {t.size(0)} rows, expected {len(parts) * num_layers} for {num_layers} layers")
            for half, module in enumerate(parts):
                for i in range(num_layers):
                    out[f"blocks.{i}.{module}.weight"] = t[half * num_layers + i]
        else:
            out[RENAMES.get(name, name)] = t
    return out


def kit_to_record(kit_state: dict, num_layers: int) -> dict:
    """The record's state dict from the kit's (banks stacked in the order record_to_kit reads them)."""
    back = {v: k for k, v in RENAMES.items()}
    banked = {f"blocks.{i}.{m}.weight" for parts in BANKS.values() for m in parts for i in range(num_layers)}
    out = {back.get(n, n): t for n, t in kit_state.items() if n not in banked}
    for name, parts in BANKS.items():
        out[name] = torch.stack([kit_state[f"blocks.{i}.{m}.weight"] for m in parts for i in range(num_layers)])
    return out


def load_kit_into_record(record_model: torch.nn.Module, kit_model: torch.nn.Module, num_layers: int) -> None:
    """Copy the kit model's weights into the record's model through the map; strict: every tensor of both
    is matched (a missing or extra name raises RuntimeError listing it)."""
    state = kit_to_record({k: v.detach() for k, v in kit_model.state_dict().items()}, num_layers)
    record_model.load_state_dict(state, strict=True)
