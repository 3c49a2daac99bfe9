"""A model or adapter given as a Hugging Face id (`org/name`): its snapshot directory in the
local Hugging Face cache, downloaded (with a progress bar) when missing and the network allows.
Needs the optional huggingface_hub (`pip install "radixlora[hf]"`); local directories never
do."""

from __future__ import annotations

import re
from pathlib import Path

HF_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# what serving reads: configs, weights, tokenizer and chat template (never *.bin or *.pt)
PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.model", "*.txt"]


def resolve(value: str | Path, what: str) -> str | Path:
    """`value` if it exists on disk, else the directory of the Hugging Face id it names."""
    if Path(value).exists():
        return value
    text = str(value)
    if not HF_ID.fullmatch(text) or text.startswith((".", "/")):
        raise SystemExit(f"{what} {text}: no such file or directory")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        raise SystemExit(f"{what} {text}: no such directory; to read it as a Hugging Face id, "
                         'install huggingface_hub (pip install "radixlora[hf]")') from None
    try:
        return snapshot_download(text, allow_patterns=PATTERNS, local_files_only=True)
    except LocalEntryNotFoundError:
        pass
    except Exception as e:  # noqa: BLE001 - the hub's errors vary by version; report the cause
        raise SystemExit(f"{what} {text}: cannot read it from the Hugging Face cache: {e}") from e
    try:
        return snapshot_download(text, allow_patterns=PATTERNS)
    except Exception as e:  # noqa: BLE001 - offline, unknown repository, gated, ...
        cause = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SystemExit(f"{what} {text}: no such directory, not in the Hugging Face cache, and "
                         f"downloading it failed: {cause}") from e
