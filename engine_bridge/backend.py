"""The installed native backend: which build it is, where its llama-server is.

The backend build id is a hash of the pin, the patches and the built libraries: a plan measured on one
build is refused by another (a silent speed regression between builds is exactly what a plan guards
against). A patch counts from its first ``diff --git`` line, as scripts/build-backend.sh's key does: its header
(what, why, tests, switches; git apply skips it) changes neither. Nothing here imports llama_cpp, so asking for
the build id costs no library load.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from artifacts.errors import FluxError
from artifacts.filehash import file_hash
from artifacts.ids import content_id

REPO_ROOT = Path(__file__).resolve().parents[1]
PIN_FILE = REPO_ROOT / "third_party" / "backend.pin"
PATCH_DIR = REPO_ROOT / "patches" / "llama.cpp"
DIFF_START = b"diff --git "


class BackendMissing(FluxError):
    """llama-cpp-python is not installed (or not the Flux build)."""

    def __init__(self) -> None:
        super().__init__("the native backend is not installed: run scripts/build-backend.sh")


class BackendInfo(BaseModel):
    """What `flux version` prints and every plan records."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    build_id: str
    pin: dict[str, str]
    patches: list[str]
    libraries: dict[str, str]
    build_key: str | None
    llama_server: str | None


def read_pin(path: Path = PIN_FILE) -> dict[str, str]:
    """Parse third_party/backend.pin (KEY=value lines)."""
    out: dict[str, str] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip()
    return out


def patch_body(path: Path) -> bytes:
    """A patch's bytes from its first ``diff --git`` line on (what git apply reads), without the header above it."""
    data = path.read_bytes()
    if data.startswith(DIFF_START):
        return data
    at = data.find(b"\n" + DIFF_START)
    return data[at + 1:] if at >= 0 else b""


def patch_hashes(patch_dir: Path = PATCH_DIR) -> dict[str, str]:
    """Each patch's name and the blake2b-256 of its body (:func:`patch_body`): a header edit keeps it."""
    return {p.name: hashlib.blake2b(patch_body(p), digest_size=32).hexdigest()
            for p in sorted(patch_dir.glob("*.patch"))}


def library_dir() -> Path:
    """Directory of the installed llama_cpp package's shared libraries."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        raise BackendMissing()
    return Path(spec.origin).parent / "lib"


def installed_build_key() -> str | None:
    """The build-backend.sh cache key baked into the installed wheel, if it is a Flux build."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        return None
    marker = Path(spec.origin).parent / "FLUX_BACKEND_KEY"
    return marker.read_text().strip() if marker.exists() else None


def llama_server_path(cache_dir: Path) -> Path | None:
    """The llama-server built from the same patched source as the installed wheel, if built."""
    key = installed_build_key()
    for base in ([cache_dir / "backend" / key] if key else []) + [cache_dir / "backend" / "current"]:
        exe = base / "bin" / "llama-server"
        if exe.is_file():
            return exe
    return None


def backend_info(cache_dir: Path) -> BackendInfo:
    """Describe the installed backend and compute its build id.

    Raises:
        BackendMissing: llama-cpp-python is not installed.
    """
    libs = sorted(p for p in library_dir().glob("lib*.so") if p.is_file())
    if not libs:
        raise BackendMissing()
    lib_hashes = {p.name: file_hash(p, cache_dir) for p in libs}
    patches = patch_hashes()
    pin = read_pin()
    build_id = content_id({"pin": pin, "patches": patches, "libraries": lib_hashes})[:16]
    server = llama_server_path(cache_dir)
    return BackendInfo(build_id=build_id, pin=pin, patches=list(patches), libraries=lib_hashes,
                       build_key=installed_build_key(), llama_server=str(server) if server else None)
