"""WikiText-2 (raw, test split): the perplexity text of ``flux bench quality`` when it can be had.

``flux bench quality`` scores its perplexity windows on WikiText-2 when it is cached or reachable, and on
the bundled held-out corpus otherwise (its result says which).

Fetched once into the cache directory (``<cache>/corpora/wikitext-2/test.txt``) and read from there
afterwards; without network it is ``None`` after one log line, never an error.
"""

from __future__ import annotations

import logging
import os
import threading
import urllib.request
import uuid
from pathlib import Path

logger = logging.getLogger(__name__)

# WikiText-2 (raw) test split, as published in the Hugging Face dataset repository. It is a Parquet
# file with one "text" column holding the lines of wiki.test.raw; it is cached as that plain text.
WIKITEXT2_URL = (
    "https://huggingface.co/datasets/Salesforce/wikitext/resolve/main/"
    "wikitext-2-raw-v1/test-00000-of-00001.parquet"
)
WIKITEXT2_MAX_BYTES = 64 * 1024 * 1024  # the real file is < 1 MB; anything huge is not it


def _download(url: str, timeout_s: float) -> bytes | str:
    """The body at url, or a one-line reason it could not be fetched within timeout_s overall."""
    result: dict[str, bytes | str] = {}

    def fetch() -> None:
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 (fixed https URL)
                result["body"] = resp.read(WIKITEXT2_MAX_BYTES + 1)
        except Exception as exc:  # any failure (DNS, TLS, HTTP, proxy) just means "not available"
            result["error"] = f"{type(exc).__name__}: {exc}"

    # A thread with a deadline bounds the whole fetch: urlopen's timeout covers each socket operation
    # but not name resolution, which can hang far longer than timeout_s on a machine without network.
    worker = threading.Thread(target=fetch, name="flux-wikitext2-download", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        return f"no answer within {timeout_s:g} s"
    body = result.get("body")
    if isinstance(body, bytes):
        return body if len(body) <= WIKITEXT2_MAX_BYTES else "response larger than expected"
    return str(result.get("error", "no response"))


def _wikitext_lines(body: bytes) -> str:
    """wiki.test.raw text from the downloaded file (Parquet with a "text" column, or plain text)."""
    if not body.startswith(b"PAR1"):
        return body.decode("utf-8")
    import pyarrow as pa
    import pyarrow.parquet as pq

    lines = pq.read_table(pa.BufferReader(body), columns=["text"]).column("text").to_pylist()
    return "\n".join(str(line or "").rstrip("\n") for line in lines) + "\n"


def _paragraphs(text: str) -> list[str]:
    """Non-empty, non-heading lines joined into paragraphs; headings (`` = Title = ``) and blanks split."""
    paragraphs: list[str] = []
    current: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or (stripped.startswith("=") and stripped.endswith("=")):
            if current:
                paragraphs.append(" ".join(current))
                current = []
            continue
        current.append(stripped)
    if current:
        paragraphs.append(" ".join(current))
    return paragraphs


def wikitext2(cache_dir: Path, timeout_s: float = 5.0) -> list[str] | None:
    """Paragraphs of the WikiText-2 (raw) test split, downloaded once into the cache, if reachable.

    Reads ``cache_dir/corpora/wikitext-2/test.txt`` when present; otherwise downloads the test split
    once (bounded by ``timeout_s`` in total) and caches it there atomically. Without network this
    returns None after one info log line; the caller then uses the bundled corpus.

    Args:
        cache_dir: Flux's cache directory.
        timeout_s: Overall limit for the download.

    Returns:
        The paragraphs, or None when the file is not cached and cannot be downloaded.
    """
    path = cache_dir / "corpora" / "wikitext-2" / "test.txt"
    if path.is_file():
        return _paragraphs(path.read_text(encoding="utf-8"))
    fetched = _download(WIKITEXT2_URL, timeout_s)
    if isinstance(fetched, str):
        logger.info("WikiText-2 not available (%s); using the bundled corpus only", fetched)
        return None
    try:
        text = _wikitext_lines(fetched)
    except Exception as exc:  # pyarrow and the decoder raise many types; all mean "not usable"
        logger.info("WikiText-2 download could not be read (%s); using the bundled corpus only", exc)
        return None
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)  # readers see the old state or the whole file, never a partial one
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        logger.warning("could not cache WikiText-2 at %s: %s", path, exc)
    return _paragraphs(text)
