"""Output files and directories written atomically, the one rule by which pjax writes an output directory, and
signal handling around those writes. The lowest layer: no pjax import.

Every directory pjax writes (pjax-native targets, heads, benchmark outputs, the code-pair recipe's stages) goes
through `write_output_dir`, which applies `prepare_output`'s rule and carries the marker `pjax_output.json`
({"format": "pjax-output", "version": 1, "kind": ..., "written_at": ...}). A directory holding only a native
target's format file `pjax_target.json` (written before the marker existed) counts as a pjax output of kind
"target".
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import secrets
import shutil
import signal
import sys
import threading
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

__all__ = ["NATIVE_MARKER", "OUTPUT_MARKER", "OutputError", "output_kind", "prepare_output", "signals_deferred",
           "termination_raises", "write_atomic", "write_json", "write_output_dir"]

NATIVE_MARKER = "pjax_target.json"
OUTPUT_MARKER = "pjax_output.json"
OUTPUT_FORMAT = "pjax-output"
OUTPUT_VERSION = 1

_ACTIVE: set[Path] = set()  # temporaries this process is writing now (never stale)


class OutputError(ValueError):
    """An output directory may not be written or replaced there; the message names the path and the reason."""


def write_json(path: Path, obj) -> None:
    """Write `obj` as indented JSON to `path` atomically (temporary file beside it, then rename)."""
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n"))


def write_atomic(path: Path, write: Callable[[Path], object]) -> None:
    """`write(tmp)` into a temporary file beside `path`, then rename it to `path`."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def output_kind(path) -> Optional[str]:
    """The kind recorded by the pjax output directory `path` ("target", "drafter", "bench", ...), or None when
    `path` is not one (absent, a file, or a directory without a valid marker)."""
    path = Path(path)
    for name, want in ((OUTPUT_MARKER, OUTPUT_FORMAT), (NATIVE_MARKER, "pjax-target")):
        try:
            marker = json.loads((path / name).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(marker, dict) and marker.get("format") == want:
            kind = marker.get("kind", "target" if name == NATIVE_MARKER else None)
            if isinstance(kind, str):
                return kind
    return None


def _temp_pattern(out: Path) -> re.Pattern:
    """Names of `out`'s temporaries: `.NAME.tmp-PID-HEX8` / `.NAME.old-PID-HEX8`, and the `.NAME.tmp-HEX8` /
    `.NAME.old-HEX8` of copies written before the writer's pid was recorded."""
    return re.compile(rf"\.{re.escape(out.name)}\.(?:tmp|old)-(?:(\d+)-)?[0-9a-f]{{8}}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    except (OverflowError, ValueError):
        return False
    return True


def _remove_stale(out: Path) -> None:
    """Remove temporaries of `out` left by killed writers: those whose pid is not running (or is this process
    but not one of its writes in progress), and those without a pid. Other names are never touched."""
    pattern = _temp_pattern(out)
    try:
        entries = list(os.scandir(out.parent))
    except OSError:
        return
    for entry in entries:
        m = pattern.fullmatch(entry.name)
        if m is None:
            continue
        path = out.parent / entry.name
        if m.group(1) is not None:
            pid = int(m.group(1))
            if (pid == os.getpid() and path in _ACTIVE) or (pid != os.getpid() and _alive(pid)):
                continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)


def _cannot_create(out: Path) -> Optional[str]:
    """Why a directory cannot be created at `out` (None when it looks possible)."""
    p = out.parent
    while not os.path.lexists(p) and p != p.parent:
        p = p.parent
    if not p.is_dir():
        return f"{p} is not a directory"
    if not os.access(p, os.W_OK | os.X_OK):
        return f"no write permission on {p}"
    return None


def prepare_output(path, *, force: bool, kind: str, sources: Iterable = ()) -> Path:
    """Check that a new output of `kind` may be written at directory `path`; return its absolute path.

    The rule (the same for every pjax writer; nothing is touched when it refuses, OutputError names the path
    and the reason):
    - `path` absent: allowed (its parent directories are created).
    - `path` an empty directory, or a pjax output of the same `kind` (it carries `pjax_output.json`, or
      `pjax_target.json` for kind "target"): allowed only with `force`; it is replaced as a whole once the new
      output is complete.
    - anything else that exists: a file, a symbolic link, a non-empty directory without the marker (a Hugging
      Face model, a downloaded head, a user's folder), a pjax output of another kind: refused, also with
      `force`.
    - `path` equal to, inside, or containing one of `sources` (the paths the output is made from): refused.
    - a location where no directory can be created (a file on the way, no permission, read-only): refused.
    Temporaries of `path` left by killed writers (`.NAME.tmp-PID-*` whose process is gone) are removed.
    """
    out = Path(os.path.abspath(path))
    real = out.parent.resolve() / out.name
    for src in sources:
        s, shown = Path(src).resolve(), Path(os.path.abspath(src))
        if real == s:
            raise OutputError(f"{out}: is the source{'' if shown == out else f' {shown}'}; refusing to write over "
                              "what is being read (choose another output path)")
        if s in real.parents:
            raise OutputError(f"{out}: lies inside the source {shown}; refusing to write into what is being read "
                              "(choose an output path outside it)")
        if real in s.parents:
            raise OutputError(f"{out}: contains the source {shown}; refusing to replace what is being read "
                              "(choose another output path)")
    _remove_stale(out)
    if os.path.islink(out):
        raise OutputError(f"{out}: is a symbolic link; refusing to replace it (give the directory it points to, "
                          "or another path)")
    if out.exists():
        if not out.is_dir():
            raise OutputError(f"{out}: exists and is not a directory; refusing to replace it (choose another "
                              "output path)")
        found = output_kind(out)
        if found is None:
            try:
                empty = next(os.scandir(out), None) is None
            except OSError as e:
                raise OutputError(f"{out}: cannot read the existing directory ({e.strerror})") from None
            if empty and force:
                return out
            if empty:
                raise OutputError(f"{out}: already exists (an empty directory; pass --force / overwrite=True to "
                                  "write into its place)")
            raise OutputError(f"{out}: already exists and is not a pjax output (no {OUTPUT_MARKER}); refusing to "
                              f"replace it{', even with --force' if force else ''}: remove it yourself or choose "
                              "another output path")
        if found != kind:
            raise OutputError(f"{out}: is a pjax {found} output, not a {kind} one; refusing to replace it: remove "
                              "it yourself or choose another output path")
        if not force:
            raise OutputError(f"{out}: already exists (a pjax {kind} output; pass --force / overwrite=True to "
                              "replace it)")
        if not os.access(out.parent, os.W_OK | os.X_OK):
            raise OutputError(f"{out}: cannot replace it (no write permission on {out.parent})")
        return out
    reason = _cannot_create(out)
    if reason is None:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            reason = e.strerror or str(e)
    if reason is not None:
        raise OutputError(f"{out}: cannot create the output directory here ({reason})")
    return out


@contextlib.contextmanager
def signals_deferred(notice: Optional[str] = None) -> Iterator[None]:
    """SIGINT / SIGTERM / SIGHUP wait until the block is done, then they are delivered: a rename sequence, a
    cleanup, or a library's write with background threads (orbax) is never cut in half. `notice` is printed
    to stderr when a signal is held. Main thread only (elsewhere the block runs as is)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending, saved = [], {}

    def record(signum, frame):
        if notice and not pending:
            print(notice, file=sys.stderr, flush=True)
        pending.append(signum)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        saved[sig] = signal.signal(sig, record)
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        for sig in dict.fromkeys(pending):
            signal.raise_signal(sig)


def _exit_on_signal(signum, frame):
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def termination_raises() -> Iterator[None]:
    """While the block runs, SIGTERM / SIGHUP left at their default (kill) raise SystemExit(128 + signal) in the
    main thread instead, so `finally` / `except` cleanups run; Ctrl-C already raises KeyboardInterrupt."""
    saved = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) == signal.SIG_DFL:
                saved[sig] = signal.signal(sig, _exit_on_signal)
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _install(tmp: Path, out: Path, kind: str) -> None:
    """Move the finished `tmp` to `out`: one rename (also over an empty directory), or, replacing an older output,
    the old one renamed aside, the new one renamed in, the old one removed."""
    if output_kind(out) != kind:  # absent, or an empty directory (prepare_output allowed it) unless it changed since
        try:
            os.replace(tmp, out)
        except OSError as e:
            raise OutputError(f"{out}: changed while the output was written ({e.strerror}); the new output was "
                              "not installed") from None
        return
    old = out.parent / f".{out.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
    os.rename(out, old)
    os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def write_output_dir(path, *, force: bool, kind: str, sources: Iterable = (),
                     metadata: Optional[dict] = None) -> Iterator[Path]:
    """Write an output directory atomically under `prepare_output`'s rule; yields the directory to fill.

        with write_output_dir(out, force=args.force, kind="bench", sources=[model_dir]) as d:
            (d / "results.json").write_text(...)

    The block fills a fresh temporary directory beside `path` (`.NAME.tmp-PID-HEX8`); when it ends normally
    the marker `pjax_output.json` ({"format", "version", "kind", "written_at"} plus `metadata`) is added and
    the directory moved to `path` in one rename (an older output of the same kind, allowed by `force`, is
    renamed aside first, then deleted). If the block raises, is interrupted (Ctrl-C), or the process gets
    SIGTERM / SIGHUP (turned into SystemExit(128 + signal) while the block runs), the temporary is removed
    and `path` is as before. A SIGKILL leaves the temporary; the next writer of `path` removes it.
    Raises OutputError when `prepare_output` refuses.
    """
    out = prepare_output(path, force=force, kind=kind, sources=sources)
    marker = {"format": OUTPUT_FORMAT, "version": OUTPUT_VERSION, "kind": kind,
              "written_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    clash = sorted(set(marker) & set(metadata or {}))
    if clash:
        raise ValueError(f"write_output_dir: metadata may not set {clash}")
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        os.mkdir(tmp)
    except OSError as e:
        raise OutputError(f"{out}: cannot create the output directory here ({e.strerror})") from None
    _ACTIVE.add(tmp)
    try:
        with termination_raises():
            yield tmp
            write_json(tmp / OUTPUT_MARKER, {**marker, **(metadata or {})})
            with signals_deferred():
                _install(tmp, out, kind)
    except BaseException:
        with signals_deferred():
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        _ACTIVE.discard(tmp)
