"""Note [Compiles shared across cache folders]

Background
    Ranks that see one Inductor cache folder share compiles through its files (Note
    [Sharing compiles between ranks]). Ranks on other machines, or with folders of their
    own, see none of those files: without more, every node compiles every piece again,
    and a node that replaces a failed one starts cold while the others start warm.

Algorithm
    The job's own store carries the compiled pieces between folders. The ranks of all
    folders split the distinct pieces between them; each folder's leader publishes its
    folder's share once and fetches the other folders' (Note [Compiles shared by folder],
    ``share_plan.py``). A leader gathers what its process holds in PyTorch's compile caches: the AOTAutograd and
    Inductor entries ``torch.compiler.save_cache_artifacts`` serializes (Triton kernels
    bundled in on GPU) and, on CPU, the C++ kernel libraries those entries load (files in
    Inductor's cache folder, named by a hash of their source and compile command). It
    publishes them in the store, in chunks, under a content hash and a fingerprint of
    what they were built with (``compat.build_fingerprint``). A rank of another folder
    that needs one of those pieces fetches them once, checks both, writes the libraries
    it lacks into its folder and loads the entries into its caches
    (``load_cache_artifacts``); compiling the piece then hits the cache.

Notes
    Nothing here is pickled by distcompile: the container is a JSON header followed by
    PyTorch's own bytes and the libraries' bytes. A fingerprint or hash that does not
    match, a malformed container, or a library path outside the cache folder means the
    piece is compiled here, with a log line saying why. What a process publishes is what
    it compiled or loaded since its last publication (PyTorch's record of them is cleared
    after each), and a publication is deleted from the store once every leader that needed
    it has installed it.
    A graph compiled as one piece is shared too (one rank compiles it whole, the others
    load it), unlike with one folder, where every rank compiles it and Inductor's files
    are shared anyway. Pieces compiled in place because Inductor may change their output
    layout (convolutions: ``segments._may_change_layout``) are not shared: AOTAutograd
    does not cache a compile that returns fake outputs, so each rank compiles those.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from .. import _torch_compat as compat
from .._store import CountedStore

__all__ = [
    "CHUNK_BYTES",
    "Unusable",
    "collect",
    "delete",
    "fetch",
    "install",
    "pack",
    "publish",
    "read_libraries",
    "seal",
    "unpack",
    "unseal",
]

log = logging.getLogger(__name__)

#: Largest value put in the store at once.
CHUNK_BYTES = 4 * 1024 * 1024
_FORMAT = "distcompile-artifacts/1"
_MARK = ".so" + compat.LOADED


@dataclass(frozen=True, slots=True)
class Unusable:
    """Why published or saved pieces cannot be used here; ``str()`` is the sentence for the log.

    Attributes:
        reason: ``"missing"`` (nothing published), ``"setup"`` (built with another torch,
            compiler or CPU: the fingerprint differs), ``"damaged"`` (the bytes do not match
            their hash) or ``"format"`` (not a distcompile file).
        detail: What was found.

    Example:
        >>> str(Unusable("missing", "nothing was published"))
        'nothing was published'
    """

    reason: Literal["missing", "setup", "damaged", "format"]
    detail: str

    def __str__(self) -> str:
        return self.detail


def pack(entries: bytes, libs: Mapping[str, bytes]) -> bytes:
    """A container of PyTorch's serialized cache entries and kernel libraries (path -> bytes).

    Example:
        >>> unpack(pack(b"abc", {"ab/k.so": b"\\x7fELF"}))
        (b'abc', {'ab/k.so': b'\\x7fELF'})
    """
    header = {
        "format": _FORMAT,
        "entries": len(entries),
        "libs": [[rel, len(data), hashlib.sha256(data).hexdigest()] for rel, data in libs.items()],
    }
    head = json.dumps(header).encode()
    return len(head).to_bytes(8, "big") + head + entries + b"".join(libs.values())


def unpack(blob: bytes) -> tuple[bytes, dict[str, bytes]]:
    """The entries and libraries of a :func:`pack` container; ``ValueError`` if malformed.

    Example:
        >>> unpack(b"junk")
        Traceback (most recent call last):
        ...
        ValueError: not a distcompile artifact container (4 bytes)
    """
    try:
        size = int.from_bytes(blob[:8], "big")
        header = json.loads(blob[8 : 8 + size])
        at = 8 + size
        entries, at = blob[at : at + header["entries"]], at + header["entries"]
        listed = [(str(rel), int(n), str(digest)) for rel, n, digest in header["libs"]]
        ok = header["format"] == _FORMAT
    except (ValueError, TypeError, KeyError, AttributeError):
        ok = False
    if not ok:
        raise ValueError(f"not a distcompile artifact container ({len(blob)} bytes)")
    libs = {}
    for rel, n, digest in listed:
        data, at = blob[at : at + n], at + n
        if hashlib.sha256(data).hexdigest() != digest:
            raise ValueError(f"kernel library {rel} does not match its hash")
        libs[rel] = data
    if at != len(blob):
        raise ValueError(f"artifact container holds {len(blob) - at} bytes more than its header says")
    return entries, libs


def read_libraries(paths: list[str]) -> dict[str, bytes]:
    """The bytes of each library (paths relative to Inductor's cache folder) still there."""
    root = compat.inductor_cache_dir()
    libs = {}
    for rel in paths:
        try:
            with open(os.path.join(root, rel), "rb") as f:
                libs[rel] = f.read()
        except OSError:  # removed meanwhile: the receiver compiles that kernel
            continue
    return libs


def collect() -> bytes:
    """What this process can give: its compile-cache entries and the C++ kernel libraries
    it loaded, packed (``b""`` when it has none)."""
    entries = compat.save_artifacts()
    libs = read_libraries(compat.kernel_libraries())
    return pack(entries, libs) if entries or libs else b""


def publish(store: CountedStore, key: str, payload: bytes, fingerprint: Mapping[str, str]) -> None:
    """Put ``payload`` in the store under ``key``, chunked, its metadata (hash, fingerprint) last."""
    chunks = [payload[i : i + CHUNK_BYTES] for i in range(0, len(payload), CHUNK_BYTES)]
    for i, chunk in enumerate(chunks):
        store.set(f"{key}/{i}", chunk)
    store.set(f"{key}/meta", _meta(payload, fingerprint, len(chunks)))


def _other_setup(meta: Mapping, fingerprint: Mapping[str, str]) -> Unusable | None:
    theirs = meta.get("fingerprint", {})
    differ = sorted(k for k in {**theirs, **fingerprint} if theirs.get(k) != fingerprint.get(k))
    if differ:
        what = ", ".join(f"{k} {theirs.get(k)!r} there, {fingerprint.get(k)!r} here" for k in differ)
        return Unusable("setup", f"built with another setup ({what})")
    return None


def _unusable(meta: Mapping, payload: bytes, fingerprint: Mapping[str, str]) -> Unusable | None:
    """Why ``payload`` with its metadata ``meta`` cannot be used here (``None`` when it can)."""
    if (other := _other_setup(meta, fingerprint)) is not None:
        return other
    if hashlib.sha256(payload).hexdigest() != meta.get("sha256"):
        return Unusable("damaged", f"its {len(payload)} bytes do not match the hash published with them")
    return None


def _meta(payload: bytes, fingerprint: Mapping[str, str], chunks: int) -> str:
    return json.dumps(
        {
            "chunks": chunks,
            "bytes": len(payload),
            "sha256": hashlib.sha256(payload).hexdigest(),
            "fingerprint": dict(fingerprint),
        }
    )


def seal(payload: bytes, fingerprint: Mapping[str, str]) -> bytes:
    """``payload`` with its hash and fingerprint in front, for a file (``unseal`` reads it).

    Example:
        >>> unseal(seal(b"abc", {"torch": "2.13"}), {"torch": "2.13"})
        (b'abc', None)
    """
    return _meta(payload, fingerprint, 1).encode() + b"\n" + payload


def unseal(blob: bytes, fingerprint: Mapping[str, str]) -> tuple[bytes | None, Unusable | None]:
    """The payload :func:`seal` wrote and ``None``, or ``None`` and why it cannot be used here.

    Example:
        >>> unseal(seal(b"abc", {"torch": "2.13"}), {"torch": "2.15"})[1]
        Unusable(reason='setup', detail="built with another setup (torch '2.13' there, '2.15' here)")
    """
    head, _, payload = blob.partition(b"\n")
    try:
        meta = json.loads(head)
    except ValueError:
        return None, Unusable("format", "not a distcompile compile-artifacts file")
    why = _unusable(meta, payload, fingerprint)
    return (None, why) if why else (payload, None)


def delete(store: CountedStore, key: str) -> None:
    """Remove a publication (its chunks, metadata and ready mark) once nobody needs it; never raises.

    Example:
        >>> # delete(store, "distcompile/wrap0/compiles/call1/art/0")
    """
    try:
        chunks = json.loads(store.get(f"{key}/meta"))["chunks"] if store.check([f"{key}/meta"]) else 0
        for i in range(chunks):
            store.delete_key(f"{key}/{i}")
        for suffix in ("meta", "ready"):
            store.delete_key(f"{key}/{suffix}")
    except Exception as exc:  # noqa: BLE001 - a publication left behind costs memory, not correctness
        log.debug("could not delete %s: %s", key, exc)


def fetch(
    store: CountedStore, key: str, fingerprint: Mapping[str, str]
) -> tuple[bytes | None, Unusable | None]:
    """The payload published under ``key`` and ``None``, or ``None`` and why it cannot be used here.

    Example:
        >>> # payload, why = fetch(store, "distcompile/wrap0/compiles/call1/art/0", compat.build_fingerprint())
    """
    if not store.check([f"{key}/meta"]):
        return None, Unusable("missing", "nothing was published (its compile or its packing failed)")
    meta = json.loads(store.get(f"{key}/meta"))
    if (other := _other_setup(meta, fingerprint)) is not None:  # before fetching the bytes
        return None, other
    payload = b"".join(store.get(f"{key}/{i}") for i in range(meta["chunks"]))
    why = _unusable(meta, payload, fingerprint)
    return (None, why) if why else (payload, None)


def install(payload: bytes) -> int:
    """Write the container's kernel libraries (and the load marks of the CPU checks' libraries:
    ``compat.kernel_libraries``) this folder lacks, libraries first, and load its entries into
    the compile caches; the number of entries loaded. ``ValueError`` if malformed."""
    entries, libs = unpack(payload)
    root = os.path.realpath(compat.inductor_cache_dir())
    for rel, data in sorted(libs.items(), key=lambda item: item[0].endswith(_MARK)):
        path = os.path.realpath(os.path.join(root, rel))
        if os.path.commonpath([root, path]) != root or not path.endswith((".so", _MARK)):
            raise ValueError(f"kernel library path {rel!r} leads outside the cache folder")
        if path.endswith(_MARK) and data:
            raise ValueError(f"load mark {rel!r} is not empty")
        if os.path.exists(path):
            continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o755)
        os.replace(tmp, path)  # atomic: a peer loading it sees all of it or nothing
    return compat.load_artifacts(entries)
