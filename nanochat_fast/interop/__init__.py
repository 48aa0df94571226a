"""
nanochat's own files (checkpoint folder, optimizer state, tokenizer.pkl), read and written for
scripts/import_nanochat.py and scripts/export_nanochat.py; no other module names them.
"""
