"""Files that are either whole or absent, and folders that can prove they are what was written.

Atomic writes: every file hf_cgpu writes outside a checkpoint goes through ``atomic_output`` (or its shorthands
``atomic_write_text`` / ``atomic_write_bytes`` / ``atomic_dir``): the content is written to a hidden temporary name
beside the target, flushed and fsynced, then ``os.replace``d onto the target. A kill at any moment leaves the old
file or the new one, never a 0-byte or half-written one (what a kill during a plain write, e.g. a tokenizer save,
leaves behind); the hidden temporary a kill leaves is removed by the next atomic write into that folder
(``remove_stale_temporaries``).

Manifests: a checkpoint, the best-weights folder and a finished model folder each carry ``manifest.json``: every
file's size and SHA-256, the folder's kind and step. ``verify_folder`` re-reads every file and refuses, in one line
naming the file, anything missing, truncated or changed by as little as one byte. Sealing a checkpoint and
verifying it at resume each read its bytes once on one core; hashlib releases the GIL, so a background thread hashes
while training goes on.

File modes: safetensors (0.8) writes its files 0600, private, while every other file is 0644 under the usual umask.
Writing a manifest sets every file it lists to the mode of an ordinary new file (``0o666`` less the umask), so the
weights of a checkpoint, the best weights and the model folder can be read by whoever can read the rest.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import IntegrityError

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 2
"""2: size and sha256 per file (format 1, sizes only, is refused)."""
_CHUNK = 8 << 20


# ---------------------------------------------------------------------------------------------------- atomic writes


def _tmp_name(path: Path) -> Path:
    """A hidden sibling that keeps the suffix (PIL and friends pick the format by it)."""
    return path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")


_TMP_PATTERN = re.compile(r"\..+\.tmp-([1-9][0-9]*)(\.[^.]+)?")
"""The names of ``_tmp_name`` (``.NAME.tmp-PID.SUFFIX``) and of ``atomic_dir``'s folders (``.NAME.tmp-PID``)."""


def remove_stale_temporaries(folder: str | os.PathLike) -> list[str]:
    """Remove the hidden temporaries that ``atomic_output`` and ``atomic_dir`` left in ``folder`` when their process
    was killed (its PID runs no more on this machine); returns their names. Every atomic write tidies its folder this
    way, so a killed export or run leaves nothing behind for longer than the next write there. Only names of that
    pattern are touched, never a link, never a temporary of a running process."""
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        m = _TMP_PATTERN.fullmatch(entry.name)
        if m is None or entry.is_symlink() or _running(int(m.group(1))):
            continue
        try:
            shutil.rmtree(entry.path) if entry.is_dir() else os.unlink(entry.path)
        except OSError:  # removed meanwhile, or not ours to remove
            continue
        removed.append(entry.name)
    return removed


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's process; a number no PID can be: leave the file
        return True
    return True


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


@contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[Path]:
    """``with atomic_output(p) as tmp: write(tmp)``: on success ``tmp`` is fsynced and renamed onto ``p``; on any
    error (or a kill) ``p`` is untouched and ``tmp`` removed (or left hidden, for a kill)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path.parent)
    tmp = _tmp_name(path)
    try:
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_output(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any, indent: int | None = 2) -> None:
    atomic_write_text(path, json.dumps(obj, indent=indent, ensure_ascii=False))


def replace_dir(tmp: Path, final: Path) -> None:
    """Put directory ``tmp`` in place of ``final``: at every instant one complete copy exists on disk."""
    old = final.with_name(f".{final.name}-old")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """``with atomic_dir(d) as tmp: save_pretrained(tmp)``: the folder appears (or replaces the old one) whole."""
    path = Path(path)
    remove_stale_temporaries(path.parent)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        for p in tmp.rglob("*"):
            if p.is_file() and not p.is_symlink():
                fsync_file(p)
        replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ---------------------------------------------------------------------------------------------------- disk errors

DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG}
"""Errors of the disk itself (full, over quota, read-only, failing): the run stops in one line, resumable."""


def as_disk_error(err: BaseException) -> OSError | None:
    """``err`` as the disk error it is (None when it is none): an ``OSError`` with a disk errno, safetensors'
    "I/O error: ... (os error 28)", or torch's "file write failed" (the zip writer does not keep the errno)."""
    if isinstance(err, OSError):
        return err if err.errno in DISK_ERRNOS else None
    text = str(err)
    m = re.search(r"os error (\d+)", text)
    if m and int(m.group(1)) in DISK_ERRNOS:
        code = int(m.group(1))
        return OSError(code, os.strerror(code))
    if "file write failed" in text or "unexpected pos" in text:
        return OSError(errno.EIO, "a file write failed (is the disk full?)")
    return None


# ---------------------------------------------------------------------------------------------------- checksums


def sha256_file(path: str | os.PathLike) -> str:
    """SHA-256 of a file, read in 8 MiB chunks (constant memory; the GIL is released while hashing)."""
    digest = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            digest.update(view[:n])
    return digest.hexdigest()


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str


@dataclass
class Manifest:
    """What ``manifest.json`` holds."""

    kind: str
    """checkpoint, best or model."""
    files: dict[str, FileEntry]
    """Relative path (posix) -> size and SHA-256."""
    meta: dict[str, Any] = field(default_factory=dict)
    """step, and whatever the writer records."""
    format: int = MANIFEST_FORMAT

    def to_json(self) -> str:
        return json.dumps({"format": self.format, "kind": self.kind, **self.meta,
                           "files": {k: asdict(v) for k, v in sorted(self.files.items())}}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        data = json.loads(text)
        if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
            raise ValueError("no 'files' table")
        fmt = data.pop("format", 1)
        kind, files = data.pop("kind", "checkpoint"), data.pop("files")
        if fmt < MANIFEST_FORMAT or not all(isinstance(v, dict) and "sha256" in v for v in files.values()):
            raise ValueError("no checksums (written before hf_cgpu recorded them)")
        for rel in files:
            if not plain_relative(rel):
                raise ValueError(f"it lists {rel!r}, a path outside the folder (absolute, or through '..')")
        return cls(kind, {k: FileEntry(int(v["size"]), str(v["sha256"])) for k, v in files.items()}, data, fmt)

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.files.values())


def plain_relative(rel: str) -> bool:
    """``rel`` names a place inside a folder: relative, posix, without ``..`` or an empty part (what
    ``regular_files`` gives; a manifest that lists anything else was not written by hf_cgpu)."""
    return not rel.startswith("/") and "\0" not in rel and not any(part in ("", ".", "..") for part in rel.split("/"))


def check_inside(folder: Path, names) -> None:
    """Every one of ``names`` lies inside ``folder`` once its parent folders are resolved (a linked folder may point
    anywhere); a file that is itself a link is left to the caller, which treats it as missing or unlinks only it."""
    root = folder.resolve()
    for rel in names:
        if not plain_relative(rel) or not (folder / rel).parent.resolve().is_relative_to(root):
            raise IntegrityError(f"{folder}: {MANIFEST} lists {rel}, a path outside the folder (through a linked "
                                 "folder, '..' or an absolute path); hf_cgpu did not write it so: save the folder "
                                 "again (resume or retrain the run that wrote it)")


def regular_files(folder: Path, exclude: tuple[str, ...] = ()) -> list[str]:
    """Relative posix paths of the regular files under ``folder`` (symlinks and what they point at left out, as are
    hidden temporaries and the top-level names in ``exclude``)."""
    out = []
    for root, dirs, files in os.walk(folder, followlinks=False):
        rel_root = Path(root).relative_to(folder)
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and not (rel_root == Path(".") and d in exclude))
        for name in sorted(files):
            p = Path(root) / name
            rel = (rel_root / name).as_posix()
            if name.startswith(".") or p.is_symlink() or not p.is_file():
                continue
            if rel == MANIFEST or (rel_root == Path(".") and name in exclude):
                continue
            out.append(rel)
    return out


def build_manifest(folder: str | os.PathLike, kind: str, files: list[str] | None = None,
                   exclude: tuple[str, ...] = (), **meta: Any) -> Manifest:
    """Hash ``files`` (default: every regular file under ``folder`` but ``exclude``)."""
    folder = Path(folder)
    names = regular_files(folder, exclude) if files is None else sorted(files)
    entries = {}
    for rel in names:
        p = folder / rel
        entries[rel] = FileEntry(p.stat().st_size, sha256_file(p))
    return Manifest(kind, entries, dict(meta))


def write_manifest(folder: str | os.PathLike, manifest: Manifest) -> None:
    """Write ``manifest`` into ``folder``, after giving the files it lists an ordinary file's mode (``usual_modes``)."""
    usual_modes(folder, list(manifest.files))
    atomic_write_text(Path(folder) / MANIFEST, manifest.to_json())


@functools.cache
def file_mode() -> int:
    """The mode of an ordinary new file: ``0o666`` less the process's umask (read from /proc where the kernel has
    it: ``os.umask`` can only be read by setting it, which races with threads creating files)."""
    try:
        status = Path("/proc/self/status").read_text()
        umask = int(re.search(r"^Umask:\s*([0-7]+)", status, re.M).group(1), 8)  # type: ignore[union-attr]
    except (OSError, AttributeError):
        umask = os.umask(0o022)
        os.umask(umask)
    return 0o666 & ~umask


def usual_modes(folder: str | os.PathLike, names: list[str] | None = None) -> None:
    """Give ``names`` (default: every regular file under ``folder``) the mode of an ordinary new file."""
    folder = Path(folder)
    for rel in regular_files(folder) if names is None else names:
        path = folder / rel
        if path.stat().st_mode & 0o777 != file_mode():
            path.chmod(file_mode())


def read_manifest(folder: str | os.PathLike) -> Manifest:
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        raise IntegrityError(f"{folder}: no {MANIFEST} (the write was cut off, or the folder predates manifests)")
    try:
        manifest = Manifest.from_json(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, TypeError, KeyError) as err:
        raise IntegrityError(f"{folder}: unreadable {MANIFEST} ({err}); hf_cgpu did not write it so: save the folder "
                             "again (resume or retrain the run that wrote it)") from None
    check_inside(folder, manifest.files)
    return manifest


def verify_folder(folder: str | os.PathLike, check_hashes: bool = True, hash_limit: int | None = None) -> Manifest:
    """Every file the manifest lists is present, a regular file, of its size and (``check_hashes``, and the files
    total at most ``hash_limit`` bytes where one is given) its SHA-256; raise ``IntegrityError`` naming the first that
    is not. Files the manifest does not list are ignored."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    check_hashes = check_hashes and (hash_limit is None or manifest.total_bytes <= hash_limit)
    for rel, entry in manifest.files.items():
        p = folder / rel
        if p.is_symlink() or not p.is_file():
            raise IntegrityError(f"{folder}: missing {rel}")
        size = p.stat().st_size
        if size != entry.size:
            raise IntegrityError(f"{folder}: {rel} is {size} bytes, expected {entry.size} (truncated?)")
    if check_hashes:
        for rel, entry in manifest.files.items():
            if sha256_file(folder / rel) != entry.sha256:
                raise IntegrityError(f"{folder}: {rel} does not match its checksum (corrupted on disk or edited)")
    return manifest


def update_manifest(folder: str | os.PathLike, names: list[str]) -> None:
    """Re-hash ``names`` (written after the folder was sealed, e.g. results with the samples) into its manifest."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    for rel in names:
        p = folder / rel
        manifest.files[rel] = FileEntry(p.stat().st_size, sha256_file(p))
    write_manifest(folder, manifest)


__all__ = [
    "DISK_ERRNOS",
    "MANIFEST",
    "FileEntry",
    "as_disk_error",
    "Manifest",
    "atomic_dir",
    "atomic_output",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "build_manifest",
    "check_inside",
    "fsync_dir",
    "plain_relative",
    "read_manifest",
    "regular_files",
    "remove_stale_temporaries",
    "replace_dir",
    "sha256_file",
    "update_manifest",
    "usual_modes",
    "verify_folder",
    "write_manifest",
]
