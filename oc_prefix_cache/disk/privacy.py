"""Private by default: what ocpc keeps on disk is for the user who runs it, and nobody else.

A parked conversation's token ids decode to the whole prompt (system text, code, tool
results) with the model's tokenizer; a head holds a harness's system prompt and tools; the
logs and the event log hold session ids and paths. So ocpc's folders are 0700 and its files
0600 (files.py makes them so, whatever the umask), and every llama-server ocpc starts runs
under umask 077, so the slot files it writes are 0600 too. For a server ocpc did not start,
the 0700 slot folder is what keeps its files from other users (and each file ocpc saves is
made 0600 when ocpc owns it).

``tighten`` brings what an earlier ocpc left (folders 0755, files 0644: made under the
umask) to those modes when a front door starts (``ocpc launch``, ``daemon``, ``proxy``) and on
``ocpc doctor --fix``. It changes only ocpc's own: its folders (the home, and ``slots/``,
``logs/``, ``plugin/``, ``backups/`` in it) and files named like ours in them; never a symlink
(not followed, not changed), never what another user owns. Left as they are, and reported:
a slot folder the user configured outside ocpc's home, a folder that looks shared on purpose
(another group, a setgid bit, an ACL: an account such as a llama-server service may need
it), and a home that holds files not named like ocpc's (OC_PREFIX_CACHE_HOME pointed at a
folder of the user's). ``scan`` reports the same without changing anything (``ocpc doctor``).
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from oc_prefix_cache.disk.gc import name_kind
from oc_prefix_cache.files import chmod_private
from oc_prefix_cache.settings import Settings

log = logging.getLogger("ocpc.privacy")

OPEN_TO_OTHERS = 0o077  # any group or other bit: read, write or search

#: ocpc's files directly in its home: the index and its lock, the install records, the self-tests,
#: the file digests (disk/content_digest.py), a launch's lock and runtime file, the slot locks,
#: the deployment's token and the previous one (doors/token.py), this box's name in a shared store
#: (disk/shared_store.py), and write_atomic's temp names (``.NAME.XXXX.tmp``).
_HOME_FILE = re.compile(
    r"index\.json|index\.lock|install\.json|capabilities\.json|digests\.json|launch-\d+\.lock|server-\d+\.json"
    r"|slot-[0-9a-f]+\.lock|token|token\.previous|box-id|\..+\.tmp"
)
#: logging's rotations (.1, .2), the event log and its old generation, the plugin's log.
_LOG_FILE = re.compile(
    r"(?:daemon|proxy|gateway)\.log(?:\.\d+)?|llama-server-\d+\.log|smg-\d+\.log|events\.jsonl(?:\.1)?"
    r"|plugin\.jsonl|\..+\.tmp"
)
_PLUGIN_FILE = re.compile(r"ocpc-plugin\.js(?:on)?|\..+\.tmp")
_BACKUP_FILE = re.compile(r".+\.\d{8}-\d{6}\..+")  # records._backup: CONFIG.YYYYmmdd-HHMMSS.XXXX
_HOME_FOLDERS = ("slots", "logs", "plugin", "backups")


@dataclass(frozen=True)
class Finding:
    """A folder or file of ocpc's that group or others can reach."""

    path: Path
    mode: int  # permission bits as found
    folder: bool
    fixed: bool = False  # made 0700 / 0600 by this run
    left: str = ""  # why ocpc leaves it as it is (empty: ocpc tightens it; ``fixed`` says whether it did)

    def __str__(self) -> str:
        return f"{self.path} ({self.mode:04o})"


@dataclass(frozen=True)
class _Area:
    folder: Path
    ours: Callable[[str], bool]  # which names in it are ocpc's files
    given: bool = False  # a folder the user configured (a slot folder outside the home)
    only_ours: bool = False  # change the folder only while all it holds is ocpc's (the home)
    in_home: bool = True  # left as it is when the home holds files not ocpc's (then maybe not ocpc's home)


def _areas(settings: Settings) -> list[_Area]:
    """ocpc's folders, and which names in each are its files."""
    home = settings.home

    def home_name(name: str) -> bool:
        return _HOME_FILE.fullmatch(name) is not None or name_kind(name) is not None

    found = [
        _Area(home, home_name, only_ours=True, in_home=False),
        _Area(settings.log_dir, lambda n: _LOG_FILE.fullmatch(n) is not None),
        _Area(home / "plugin", lambda n: _PLUGIN_FILE.fullmatch(n) is not None),
        _Area(home / "backups", lambda n: _BACKUP_FILE.fullmatch(n) is not None),
    ]
    if _norm(settings.slot_dir) != _norm(home):
        inside = _inside(settings.slot_dir, home)
        found.append(_Area(settings.slot_dir, lambda n: name_kind(n) is not None, given=not inside, in_home=inside))
    return found


def tighten(settings: Settings, *, apply: bool = True) -> list[Finding]:
    """Make ocpc's folders 0700 and its files 0600 where that is ocpc's to do (the module
    docstring); every folder or file still open to group or others is in the answer, with
    ``left`` saying why. ``apply=False``: change nothing, only report (``scan``)."""
    found: list[Finding] = []
    foreign_home = False
    for area in _areas(settings):
        try:
            more, left = _tighten_area(area, apply=apply, settings=settings, foreign_home=foreign_home)
            found += more
            foreign_home = foreign_home or (not area.in_home and left == _FOREIGN)
        except OSError as exc:  # an unreadable folder: say so, go on with the others
            found.append(Finding(area.folder, 0, True, left=f"cannot be read ({exc.strerror or exc})"))
    return found


def scan(settings: Settings) -> list[Finding]:
    """What ``tighten`` would find, changing nothing."""
    return tighten(settings, apply=False)


def tighten_at_start(settings: Settings) -> list[Finding]:
    """``tighten``, logged: one line for what was tightened, a warning for what was left.
    Never raises: a front door starts whatever this finds."""
    try:
        found = tighten(settings)
    except Exception as exc:  # privacy upkeep never stops a start
        log.warning("could not check the modes of ocpc's files: %s", exc)
        return []
    fixed = [f for f in found if f.fixed]
    if fixed:
        folders = sum(1 for f in fixed if f.folder)
        log.info(
            "made %d of ocpc's folders 0700 and %d of its files 0600 (left open to other users by an earlier ocpc): %s",
            folders,
            len(fixed) - folders,
            ", ".join(str(f) for f in fixed[:5]) + (f" and {len(fixed) - 5} more" if len(fixed) > 5 else ""),
        )
    for line in describe_left([f for f in found if not f.fixed]):
        log.warning("%s", line)
    return found


def describe_left(found: list[Finding]) -> list[str]:
    """One line per reason for what stays open to other users: every folder, and a few files."""
    by_why: dict[str, list[Finding]] = {}
    for f in found:
        by_why.setdefault(f.left or "ocpc tightens it at its next start (or `ocpc doctor --fix`)", []).append(f)
    lines = []
    for why, items in by_why.items():
        files = [f for f in items if not f.folder]
        shown = [str(f) for f in items if f.folder] + [str(f) for f in files[:3]]
        more = f" and {len(files) - 3} more file(s)" if len(files) > 3 else ""
        lines.append(f"open to other users: {', '.join(shown)}{more}: {why}")
    return lines


def fix_command(found: list[Finding]) -> str:
    """The shell commands that make these paths private (each folder 0700, each file 0600)."""
    folders = [shlex.quote(str(f.path)) for f in found if f.folder]
    files = [shlex.quote(str(f.path)) for f in found if not f.folder]
    parts = []
    if folders:
        parts.append("chmod 700 " + " ".join(folders))
    if files:
        parts.append("chmod 600 " + " ".join(files))
    return "; ".join(parts)


# -- one folder ----------------------------------------------------------------------------------


def _tighten_area(area: _Area, *, apply: bool, settings: Settings, foreign_home: bool) -> tuple[list[Finding], str]:
    """What is open in one folder (tightened unless ``apply`` is False), and why the folder is
    not ocpc's to change ("" when it is)."""
    try:
        st = os.lstat(area.folder)
    except FileNotFoundError:
        return [], ""
    if stat.S_ISLNK(st.st_mode):
        why = f"a symlink to {os.path.realpath(area.folder)}: ocpc changes no symlink, nor what it points to"
        try:
            target = os.stat(area.folder)
        except OSError:
            return [], why
        if not stat.S_ISDIR(target.st_mode) or not target.st_mode & OPEN_TO_OTHERS:
            return [], why
        return [Finding(area.folder, stat.S_IMODE(target.st_mode), True, left=why)], why
    if not stat.S_ISDIR(st.st_mode):
        return [], ""
    found: list[Finding] = []
    names = sorted(os.listdir(area.folder))
    left = _why_leave_folder(area, st, names, settings)
    if not left and foreign_home and area.in_home:
        left = "in a home that holds files that are not ocpc's: ocpc changes only folders of its own"
    open_folder = bool(st.st_mode & OPEN_TO_OTHERS)
    if open_folder:
        found.append(_fix(area.folder, st, folder=True, left=left, apply=apply))
    # A folder left open for another account may be open for its files too: they stay as they
    # are. In a private folder (or a home left only for holding the user's files) nobody else
    # reads them, so making them 0600 takes nothing from anyone.
    files_left = f"in a folder ocpc leaves as it is ({left})" if open_folder and left and left != _FOREIGN else ""
    for name in names:
        if not area.ours(name):
            continue
        path = area.folder / name
        try:
            file_st = os.lstat(path)
        except FileNotFoundError:
            continue  # gone meanwhile (a gc, a rename)
        if not stat.S_ISREG(file_st.st_mode) or not file_st.st_mode & OPEN_TO_OTHERS:
            continue  # a symlink is never followed; a private file is fine
        why = files_left or ("owned by another user" if file_st.st_uid != os.geteuid() else "")
        found.append(_fix(path, file_st, folder=False, left=why, apply=apply))
    return found, left


_FOREIGN = "it holds files that are not ocpc's: ocpc changes only a folder of its own"


def _why_leave_folder(area: _Area, st: os.stat_result, names: list[str], settings: Settings) -> str:
    """Why this folder is not ocpc's to change ("" when it is)."""
    if st.st_uid != os.geteuid():
        return "owned by another user"
    if area.given:
        return "a slot folder you configured (OC_PREFIX_CACHE_SLOT_DIR): another account may need it"
    if st.st_gid != os.getegid() or st.st_mode & stat.S_ISGID or _has_acl(area.folder):
        return "shared on purpose (its group, a setgid bit or an ACL): another account may need it"
    if area.only_ours:
        slot_name = settings.slot_dir.name if _norm(settings.slot_dir.parent) == _norm(area.folder) else None
        for name in names:
            if not (area.ours(name) or name in _HOME_FOLDERS or name == slot_name):
                return _FOREIGN
    return ""


def _fix(path: Path, st: os.stat_result, *, folder: bool, left: str, apply: bool) -> Finding:
    mode = stat.S_IMODE(st.st_mode)
    if left or not apply:
        return Finding(path, mode, folder, left=left)
    try:
        chmod_private(path, folder=folder)
    except OSError as exc:
        return Finding(path, mode, folder, left=f"could not be changed ({exc.strerror or exc})")
    return Finding(path, mode, folder, fixed=True)


def _has_acl(path: Path) -> bool:
    try:
        os.getxattr(path, "system.posix_acl_access", follow_symlinks=False)
    except OSError:
        return False  # none (ENODATA), or no ACLs on this file system
    return True


def _norm(path: Path) -> str:
    return os.path.normpath(os.path.abspath(path))


def _inside(path: Path, folder: Path) -> bool:
    return os.path.commonpath([_norm(path), _norm(folder)]) == _norm(folder)
