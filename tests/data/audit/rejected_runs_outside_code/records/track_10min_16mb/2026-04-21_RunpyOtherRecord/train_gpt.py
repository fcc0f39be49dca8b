import runpy
from pathlib import Path

base_trainer = Path(__file__).resolve().parents[1] / "2026-04-09_SP8192_3LayerRecur_ParResid_QK525_LegalTTT" / "train_gpt.py"
runpy.run_path(str(base_trainer), run_name="__main__")
