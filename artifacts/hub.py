"""GGUF models from a Hugging Face hub, fetched with ``huggingface_hub`` (its endpoint ``HF_ENDPOINT``, its token
``HF_TOKEN``, its downloads: a connection cut mid-file is resumed from where it stopped) and checked against the
hub's sha256 of each file.

A repository often holds one model in several quants, and a large quant split in shards
(``name-00001-of-00003.gguf``): :func:`gguf_models` groups its files into models, :func:`choose` picks the one a
``REPO:FILE`` names, and :func:`fetch` downloads every shard of it into ``models_dir/OWNER/NAME``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TypeVar

from pydantic import Field

from artifacts.errors import FluxError
from artifacts.records.base import Record

log = logging.getLogger(__name__)

SHARD = re.compile(r"^(?P<stem>.+)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$")
VERIFIED = Path(".cache") / "flux" / "verified.json"  # under a repo's folder: files whose hash was checked
CHUNK = 8 << 20
T = TypeVar("T")


class HubFile(Record):
    """A file of a repository at one commit, as the hub lists it."""

    name: str
    size: int | None = None
    sha256: str | None = Field(None, description="the LFS object's sha256 (large files)")
    git_sha1: str | None = Field(None, description="the git blob id (files stored in git itself)")


class GgufModel(Record):
    """One model of a repository: a single .gguf or every shard of a split one, in order."""

    name: str = Field(description="the file to name in REPO:FILE (a split model's first shard)")
    files: list[HubFile]

    @property
    def size(self) -> int:
        """Bytes of all its files."""
        return sum(f.size or 0 for f in self.files)


class Fetched(Record):
    """What :func:`fetch` left in ``models_dir``."""

    repo: str
    commit: str
    path: Path = Field(description="the file `flux plan` takes (a split model's first shard)")
    files: list[Path]
    size: int
    hashed: int = Field(description="files whose hash was computed now (the others were checked before)")


class HubError(FluxError):
    """A fetch that cannot go on: the message names the repository, revision or file and what to do."""

    def __init__(self, repo: str, problem: str) -> None:
        self.repo = repo
        self.problem = problem
        super().__init__(f"flux fetch {repo}: {problem}")


class SeveralModels(HubError):
    """A repository with several GGUF models and no FILE to pick one."""

    def __init__(self, repo: str, models: list[GgufModel]) -> None:
        self.models = models
        names = ", ".join(m.name for m in models)
        super().__init__(repo, f"{len(models)} GGUF models here; name one as `flux fetch {repo}:FILE`: {names}")


class ChecksumMismatch(HubError):
    """A downloaded file whose sha256 is not the one the hub lists (it was removed)."""

    def __init__(self, repo: str, name: str, expected: str, found: str) -> None:
        self.name, self.expected, self.found = name, expected, found
        super().__init__(repo, f"{name} has sha256 {found[:16]}..., the hub lists {expected[:16]}...: the download "
                               "was corrupted or the file changed on the hub; it was removed, run the fetch again")


def parse_spec(spec: str) -> tuple[str, str | None]:
    """``OWNER/NAME[:FILE]`` -> (repo id, file or None)."""
    repo, _, file = spec.partition(":")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise HubError(spec, "expected OWNER/NAME or OWNER/NAME:FILE.gguf, e.g. Qwen/Qwen3-0.6B-GGUF")
    return repo, file or None


def gguf_models(files: list[HubFile]) -> list[GgufModel]:
    """The repository's GGUF models: single files, and split ones grouped (shards 1..N all present)."""
    single: list[GgufModel] = []
    shards: dict[tuple[str, int], dict[int, HubFile]] = {}
    for f in files:
        if not f.name.endswith(".gguf"):
            continue
        m = SHARD.match(f.name)
        if m is None:
            single.append(GgufModel(name=f.name, files=[f]))
        else:
            shards.setdefault((m["stem"], int(m["n"])), {})[int(m["i"])] = f
    for (_, n), parts in shards.items():
        if set(parts) == set(range(1, n + 1)):  # an incomplete split is no model
            single.append(GgufModel(name=parts[1].name, files=[parts[i] for i in range(1, n + 1)]))
    return sorted(single, key=lambda m: m.name)


def _is_projector(model: GgufModel) -> bool:
    """A vision projector beside the language model (llama.cpp's mmproj files): never chosen unnamed."""
    return Path(model.name).name.lower().startswith("mmproj")


def choose(repo: str, models: list[GgufModel], file: str | None) -> GgufModel:
    """The model ``file`` names (any of its shards, with or without its folder), else the only one there."""
    if file is not None:
        for m in models:
            if any(file in (f.name, Path(f.name).name) for f in m.files):
                return m
        have = ", ".join(m.name for m in models) or "none"
        raise HubError(repo, f"no file {file} at this revision; its GGUF models: {have}")
    language = [m for m in models if not _is_projector(m)]
    if not language:
        raise HubError(repo, "no .gguf file at this revision: a checkpoint repository? download it and run "
                             "`flux convert DIR -o model.gguf`")
    if len(language) > 1:
        raise SeveralModels(repo, language)
    return language[0]


def list_files(repo: str, revision: str | None) -> tuple[str, list[HubFile]]:
    """(commit, files) of ``repo`` at ``revision`` (default: the main branch), with sizes and hashes."""
    from huggingface_hub import HfApi

    info = _hub_call(repo, revision, lambda: HfApi().model_info(repo, revision=revision, files_metadata=True))
    files = [HubFile(name=s.rfilename, size=(s.lfs.size if s.lfs else s.size), sha256=s.lfs.sha256 if s.lfs else None,
                     git_sha1=s.blob_id) for s in info.siblings or []]
    if not info.sha:
        raise HubError(repo, f"the hub gave no commit for revision {revision or 'main'}")
    return info.sha, files


def fetch(repo: str, file: str | None, revision: str | None, models_dir: Path) -> Fetched:
    """Download the model ``file`` names (or the repository's only one) into ``models_dir/OWNER/NAME``, every
    shard of a split model, each checked against the hub's sha256 (its git blob id for a file kept in git).

    Raises:
        HubError: no such repository, revision or file; several models and none named; a failed download; a
            checksum that does not match (the file is removed).
    """
    from huggingface_hub import hf_hub_download

    commit, files = list_files(repo, revision)
    model = choose(repo, gguf_models(files), file)
    local_dir = models_dir / repo
    paths, hashed = [], 0
    for f in model.files:
        log.info("fetch: %s (%s bytes) from %s@%s", f.name, f"{f.size:,}" if f.size else "?", repo, commit[:12])
        path = Path(_hub_call(repo, revision, partial(hf_hub_download, repo, f.name, revision=commit,
                                                      local_dir=local_dir)))
        hashed += _verify(repo, local_dir, f, path)
        paths.append(path)
    return Fetched(repo=repo, commit=commit, path=paths[0], files=paths, size=model.size, hashed=hashed)


def _verify(repo: str, local_dir: Path, f: HubFile, path: Path) -> int:
    """Check ``path`` against the hub's hash of ``f`` (1 when hashed now, 0 when checked before at this size and
    mtime); a mismatch removes the file and raises."""
    if f.sha256 is None and f.git_sha1 is None:
        raise HubError(repo, f"the hub lists no hash for {f.name}: it cannot be checked")
    st = path.stat()
    expected = f.sha256 or f.git_sha1 or ""
    record_path = local_dir / VERIFIED
    records = _read_records(record_path)
    if records.get(f.name) == [expected, st.st_size, st.st_mtime_ns]:
        return 0
    found = file_sha256(path) if f.sha256 else git_blob_sha1(path)
    if found != expected:
        path.unlink(missing_ok=True)
        (local_dir / ".cache" / "huggingface" / "download" / f"{f.name}.metadata").unlink(missing_ok=True)
        raise ChecksumMismatch(repo, f.name, expected, found)
    records[f.name] = [expected, st.st_size, st.st_mtime_ns]
    record_path.parent.mkdir(parents=True, exist_ok=True)
    record_path.write_text(json.dumps(records, indent=1, sort_keys=True))
    return 1


def _read_records(path: Path) -> dict[str, list[str | int]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes (the hub's LFS object id)."""
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def git_blob_sha1(path: Path) -> str:
    """The git blob id of a file's bytes (the hub's id of a file kept in git, not LFS)."""
    h = hashlib.sha1(f"blob {path.stat().st_size}\0".encode(), usedforsecurity=False)
    with path.open("rb") as fh:
        while chunk := fh.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _hub_call(repo: str, revision: str | None, call: Callable[[], T]) -> T:
    """Run a huggingface_hub call; what it raises becomes one line naming the repository, revision or file."""
    import httpx2
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = constants.ENDPOINT
    try:
        return call()
    except GatedRepoError as exc:
        raise HubError(repo, f"a gated repository on {where}: accept its terms there and set HF_TOKEN") from exc
    except RepositoryNotFoundError as exc:
        raise HubError(repo, f"no such repository on {where} (a private one needs HF_TOKEN)") from exc
    except RevisionNotFoundError as exc:
        raise HubError(repo, f"revision {revision!r} does not resolve: give a branch, tag or commit of the "
                             "repository") from exc
    except RemoteEntryNotFoundError as exc:
        raise HubError(repo, f"a file the hub listed is missing at revision {revision or 'main'}: "
                             f"{_url_tail(exc)}") from exc
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "no response"
        raise HubError(repo, f"the hub answered {status} ({_url_tail(exc)}); run the fetch again") from exc
    except OfflineModeIsEnabled as exc:
        raise HubError(repo, "HF_HUB_OFFLINE is set: unset it to download") from exc
    except (httpx2.TransportError, ConnectionError, TimeoutError) as exc:
        raise HubError(repo, f"cannot reach {where} ({type(exc).__name__}: {exc}); check HF_ENDPOINT and the "
                             "network, then run the fetch again (a download resumes)") from exc
    except OSError as exc:
        raise HubError(repo, f"cannot write the download: {exc}") from exc


def _url_tail(exc: Exception) -> str:
    """The failing request's path, or the exception's first line."""
    response = getattr(exc, "response", None)
    url = str(response.url) if response is not None else ""
    return url.split("/resolve/", 1)[-1] if url else str(exc).splitlines()[0]
