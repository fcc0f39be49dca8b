"""Extract for the audit tests: PR #1945's train_gpt.py is not copied here."""
import os

print(os.environ.get("SEED"))
