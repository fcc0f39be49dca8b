"""Muon's zero-cost switches of the 8xH100 records: Polar Express Newton-Schulz coefficients (MUON_NS_COEFFS) and
MuonEq-R row normalization (MUON_ROW_NORMALIZE). trainer/optim.py's Muon calls these only with a switch on, so a
record's train_gpt.py packed without them carries none of this.

Shapes: N matrices of one shape, R rows, C columns.
"""

import torch

# the packed train_gpt.py holds them only for runs with a switch on (kit/bundle_when.py)
PACKED_WHEN = "MUON_NS_COEFFS != 'jordan' or MUON_ROW_NORMALIZE"
# Newton-Schulz quintic coefficients (a, b, c) per iteration; past the end of the table the last triple repeats:
# Amsel et al. 2025 ("The Polar Express", arXiv 2505.16932), the 5-step minimax schedule with its safety margin
# baked in as modded-nanogpt and PR #1787 use it; later steps run the converged Newton-Schulz quintic (15/8, -10/8,
# 3/8)
POLAR_EXPRESS_COEFFS = ((8.156554524902461, -22.48329292557795, 15.878769915207462),
                        (4.042929935166739, -2.808917465908714, 0.5000178451051316),
                        (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
                        (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
                        (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
                        (1.875, -1.25, 0.375))


def normalize_rows(u: torch.Tensor, /) -> torch.Tensor:
    """MuonEq-R (PR #1285): each row of the momentum update u [N, R, C] divided by its L2 norm (float32, clamped
    at 1e-7), in u's dtype (bf16 in the records' form)."""
    return u / u.float().norm(dim=-1, keepdim=True).clamp_min(1e-7).to(u.dtype)
