"""A Hugging Face checkpoint to GGUF with the pinned llama.cpp's own ``convert_hf_to_gguf.py``.

The converter comes from the llama-cpp-python sdist that ``third_party/backend.pin`` names and
``scripts/build-backend.sh`` downloads and checks (its sha256), so it writes what the engine it feeds reads: the
same commit's tensor names, fields and tokenizer handling. Its ``conversion/`` package and its own ``gguf-py`` come
along (the converter puts that ``gguf`` first on its path). Its Python needs (PyTorch, transformers, sentencepiece)
are Flux's optional extra ``convert``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

from artifacts.errors import FluxError
from engine_bridge.backend import read_pin

CONVERTER = "convert_hf_to_gguf.py"
PARTS = (CONVERTER, "conversion/", "gguf-py/")  # what the converter imports, under vendor/llama.cpp/
EXTRA = ("torch", "transformers", "sentencepiece", "safetensors")  # the `convert` extra's modules
OUTTYPES = ("q8_0", "f16", "bf16", "f32")
REGISTER = re.compile(r"register\(([^)]*)\)", re.S)


class ConvertError(FluxError):
    """A conversion that cannot run or failed; the message names the checkpoint or what is missing."""

    def __init__(self, what: str, problem: str) -> None:
        self.what = what
        self.problem = problem
        super().__init__(f"flux convert {what}: {problem}")


def sdist_path(cache_dir: Path) -> Path:
    """The pinned llama-cpp-python sdist the backend build downloaded and checked: in this cache, else beside the
    backend build this cache uses (a link to another cache's)."""
    name = f"llama_cpp_python-{read_pin()['LLAMA_CPP_PYTHON_VERSION']}.tar.gz"
    for cache in (cache_dir, (cache_dir / "backend").resolve().parent):
        if (cache / "sdist" / name).is_file():
            return cache / "sdist" / name
    raise ConvertError("", f"the pinned llama.cpp source ({name}) is not in {cache_dir / 'sdist'}: run "
                           "scripts/build-backend.sh (it downloads and checks it)")


def converter_dir(cache_dir: Path) -> Path:
    """The pinned converter, unpacked once from the checked sdist into ``cache_dir/convert/<sdist sha256>``."""
    pin = read_pin()
    sdist = sdist_path(cache_dir)
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if digest != pin["LLAMA_CPP_PYTHON_SHA256"]:
        raise ConvertError("", f"{sdist} has sha256 {digest[:16]}..., backend.pin says "
                               f"{pin['LLAMA_CPP_PYTHON_SHA256'][:16]}...: delete it and run scripts/build-backend.sh")
    out = cache_dir / "convert" / digest[:16]
    if (out / CONVERTER).is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            _, _, inner = m.name.partition("/vendor/llama.cpp/")
            if inner and (inner == CONVERTER or inner.startswith(PARTS[1:])) and (m.isfile() or m.isdir()):
                m.name = inner
                members.append(m)
        tar.extractall(tmp, members=members, filter="data")
    tmp.replace(out)
    return out


def known_architectures(conv: Path) -> set[str]:
    """The Hugging Face architectures (config.json ``architectures``) the converter registers a class for."""
    names: set[str] = set()
    for py in [conv / CONVERTER, *sorted((conv / "conversion").glob("*.py"))]:
        for args in REGISTER.findall(py.read_text(errors="replace")):
            names.update(re.findall(r"""["']([A-Za-z0-9_]+)["']""", args))
    return names


def checkpoint_architecture(checkpoint: Path) -> str:
    """The architecture a checkpoint's config.json names; one line when the directory is no checkpoint."""
    if not checkpoint.is_dir():
        raise ConvertError(str(checkpoint), "not a directory; give a Hugging Face checkpoint's folder "
                                            "(config.json and *.safetensors)")
    config = checkpoint / "config.json"
    try:
        data = json.loads(config.read_text())
    except FileNotFoundError as exc:
        raise ConvertError(str(checkpoint), "no config.json: not a Hugging Face checkpoint") from exc
    except ValueError as exc:
        raise ConvertError(str(checkpoint), f"config.json is not JSON ({exc})") from exc
    if not any(checkpoint.glob("*.safetensors")) and not any(checkpoint.glob("pytorch_model*.bin")):
        raise ConvertError(str(checkpoint), "no weights (*.safetensors or pytorch_model*.bin) beside config.json")
    archs = data.get("architectures") if isinstance(data, dict) else None
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise ConvertError(str(checkpoint), "config.json names no architectures")
    return archs[0]


def missing_extra() -> list[str]:
    """The ``convert`` extra's modules that are not installed."""
    return [m for m in EXTRA if importlib.util.find_spec(m) is None]


def convert(checkpoint: Path, output: Path, outtype: str, cache_dir: Path, log_path: Path) -> Path:
    """Convert ``checkpoint`` to ``output`` with the pinned converter (its output in ``log_path``).

    Raises:
        ConvertError: no checkpoint, an architecture the converter does not know, the extra missing, or the
            converter failed (its last lines in the message's log).
    """
    arch = checkpoint_architecture(checkpoint)
    conv = converter_dir(cache_dir)
    commit = read_pin()["LLAMA_CPP_COMMIT"]
    if arch not in known_architectures(conv):
        raise ConvertError(str(checkpoint), f"architecture {arch} is not known to the pinned llama.cpp's converter "
                                            f"(commit {commit}); a newer backend.pin may add it")
    if missing := missing_extra():
        raise ConvertError(str(checkpoint), f"the converter needs {', '.join(missing)}: pip install -e '.[convert]'")
    output.parent.mkdir(parents=True, exist_ok=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(conv / CONVERTER), str(checkpoint), "--outtype", outtype, "--outfile", str(output)]
    with log_path.open("w") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=conv, check=False)
    if done.returncode != 0 or not output.is_file():
        tail = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()][-1:]
        raise ConvertError(str(checkpoint), f"the converter failed (exit {done.returncode}): "
                                            f"{tail[0] if tail else 'no output'}; see {log_path}")
    return output
