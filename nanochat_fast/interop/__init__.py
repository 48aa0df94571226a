"""
Other projects' files, read and written: nanochat's (checkpoint folder, optimizer state, tokenizer.pkl)
for scripts/import_nanochat.py and export_nanochat.py, and a Hugging Face transformers model folder for
scripts/import_hf.py and export_hf.py; no other module names nanochat's files.
"""

from ..core.errors import UserError


def hf_folder_module(script: str):
    """hf_folder.py, which needs the hf extra (safetensors, and transformers' tokenizers): one line without it."""
    try:
        from . import hf_folder
    except ImportError as e:
        raise UserError(f"{script} needs {e.name}, which is not installed: pip install 'nanochat_fast[hf]'") from None
    return hf_folder
