"""Where graft keeps what it builds, converts or downloads once and reuses: warm-up base models,
converted GGUF models, packaged models' files, the benches' TRL virtualenv."""

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """`$GRAFT_CACHE`, else ~/.cache/graft."""
    return Path(os.environ.get("GRAFT_CACHE", Path.home() / ".cache" / "graft"))
