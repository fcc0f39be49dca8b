"""FlashAttention-3's `flash_attn_interface` where only FA2 is installed, for timing a record script that imports FA3
(tools/gpu_report.py --record): FA2's `flash_attn_func` and `flash_attn_varlen_func` under FA3's module name. PR
#1855 calls them as FA2 takes them (q, k, v, causal; cu_seqlens_q/k, max_seqlen_q/k) and uses the output alone, which
FA2 returns. A timing through this module is FA2's kernels, not the record's FA3 (no PyPI wheel provides FA3).
Importing fails with FA2's own ImportError where FA2 is missing too: the row then reports no time.
"""

from flash_attn import flash_attn_func, flash_attn_varlen_func  # noqa: F401
