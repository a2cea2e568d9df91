"""Hugging Face hub repo ids -> a local snapshot directory, offline from the cache when possible.

Glossary
    repo id        "org/name" on the hub (e.g. "state-spaces/mamba-130m-hf")
    hub cache      $HF_HUB_CACHE (default ~/.cache/huggingface/hub), laid out as
                   models--org--name/refs/<branch> (a commit hash) and
                   models--org--name/snapshots/<commit>/<files>
    snapshot       one commit's files in the cache; `resolve_repo` returns its directory
    offline        $HF_HUB_OFFLINE=1: the cache is the only source

The cache is tried first (`local_files_only=True`), so a cached model loads with no network at all;
only on a miss, and when not offline, are the files downloaded. Only what the loader reads is
fetched: config, safetensors weights (and their index), tokenizer files; pickled `*.bin` weights
only when the caller opted in with `allow_pickle=True`. The environment is read at call time (not
at import time as huggingface_hub's constants are), so tests can point it at a cache they build.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

CONFIG_PATTERNS = ["config.json", "generation_config.json"]
WEIGHT_PATTERNS = ["*.safetensors", "*.safetensors.index.json"]
PICKLE_PATTERNS = ["*.bin", "*.bin.index.json", "*.pt", "*.pth"]
TOKENIZER_PATTERNS = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                      "vocab.json", "vocab.txt", "merges.txt", "added_tokens.json", "chat_template.jinja"]
_REPO_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")
_TRUE = {"1", "on", "yes", "true"}


def looks_like_repo_id(name: str) -> bool:
    """Whether `name` is shaped like a hub repo id ("org/name" or "name"), not a file path."""
    return bool(_REPO_ID.match(name)) and not name.startswith((".", "/")) and ".." not in name


def hub_cache_dir() -> Path:
    """The hub cache in force now: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def resolve_repo(repo_id: str, revision: str | None = None, allow_pickle: bool = False) -> Path:
    """The local snapshot directory of `repo_id` at `revision` (branch, tag or commit; default main).

    Raises:
        FileNotFoundError: not in the cache and offline (or the download failed), with the cache
            path that was searched.
    """
    from huggingface_hub import snapshot_download

    patterns = CONFIG_PATTERNS + WEIGHT_PATTERNS + TOKENIZER_PATTERNS + (PICKLE_PATTERNS if allow_pickle else [])
    cache = hub_cache_dir()
    kwargs = dict(repo_id=repo_id, revision=revision, cache_dir=str(cache), allow_patterns=patterns)
    try:
        return _checked(Path(snapshot_download(local_files_only=True, **kwargs)), repo_id)
    except _SnapshotMissing:
        raise
    except Exception as cached_miss:  # huggingface_hub's LocalEntryNotFoundError and kin
        if hub_offline():
            raise FileNotFoundError(
                f"{repo_id!r} (revision {revision or 'main'}) is not in the hub cache {cache} and HF_HUB_OFFLINE is "
                f"set; download it once with network access, or pass a local directory"
            ) from cached_miss
    try:
        snapshot = Path(snapshot_download(**kwargs))
    except Exception as e:
        raise FileNotFoundError(
            f"could not resolve {repo_id!r} (revision {revision or 'main'}): not in the hub cache {cache} and the "
            f"download failed ({type(e).__name__}: {e})"
        ) from e
    return _checked(snapshot, repo_id)


class _SnapshotMissing(FileNotFoundError):
    """A snapshot was found but lacks config.json."""


def _checked(snapshot: Path, repo_id: str) -> Path:
    if not (snapshot / "config.json").is_file():
        raise _SnapshotMissing(f"{repo_id!r}: the snapshot {snapshot} has no config.json")
    return snapshot
