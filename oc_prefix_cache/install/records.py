"""What every harness install shares: the edit itself, the backup, the record, and the way back.

An install reads the harness's config as text in its format (JSON with comments, TOML or
YAML: ``json_format``, ``toml_format``, ``yaml_format``), plans the entries ocpc needs (a pure
function per harness), has the format insert or replace exactly those, and writes the file
atomically behind any symlink, keeping its mode. Before that it backs the original up and
records each change in ``$OC_PREFIX_CACHE_HOME/install.json``, keyed by the config's path.
Uninstall then restores the backup byte for byte when nobody changed the file since, or
undoes exactly ocpc's changes: an entry ocpc added is taken out while it still holds ocpc's
value, a value ocpc replaced goes back to the user's while it is still ocpc's. Whatever the
user changed since is kept, and said. ``--dry-run`` plans and checks all of it, and writes
nothing.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from oc_prefix_cache.errors import FormatError, InstallError
from oc_prefix_cache.files import private_dir, write_atomic, write_private
from oc_prefix_cache.install.edits import ConfigFormat, Edit, EditKind
from oc_prefix_cache.install.json_format import JSON
from oc_prefix_cache.settings import Settings

__all__ = ["ConfigFormat", "Edit", "EditKind", "FormatError", "InstallError", "InstallRecord", "Said"]


class Said(list[str]):
    """What an install did (or, in a dry run, would do), one line per change, as a list; and,
    for ``--json`` and ``--dry-run``, the config it edits, the unified diff of its text, and
    whether anything was written."""

    def __init__(
        self, lines: list[str] | None = None, *, config: str = "", diff: str = "", dry_run: bool = False
    ) -> None:
        super().__init__(lines or [])
        self.config = config
        self.diff = diff
        self.dry_run = dry_run


@dataclass
class InstallRecord:
    config: str
    existed: bool
    backup: str | None
    written_sha256: str
    # One dict per change, in the order made: ``offset``/``snippet`` (what was inserted where),
    # and, since harness installs, ``kind``, ``path``, ``key``, ``value``, ``old`` (a replaced
    # value's JSON text) and ``container``. Records from before carry only the first two.
    insertions: list[dict[str, Any]] = field(default_factory=list)
    # The backup is the whole truth only after a single install: a second install on top
    # may follow edits of the user's, which restoring the first backup would lose.
    restorable: bool = True
    # What the @opencode-ai/plugin pre-install created in the config's folder (asdict of
    # NpmEntry), and package-lock.json's digest right after: a later npm run changes it.
    npm_folder: str | None = None
    npm_created: list[dict[str, Any]] = field(default_factory=list)
    npm_lock_sha256: str | None = None
    harness: str = "opencode"
    proxy_url: str | None = None  # where a proxy harness was sent (doctor compares)
    format: str = "json"  # how the config is read and un-edited (records from before: JSON)


def normalise_base_url(url: str) -> str:
    """``http://localhost:8080/v1/`` and ``http://127.0.0.1:8080`` are the same server."""
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    scheme, _, rest = url.partition("://")
    host, slash, path = rest.partition("/")
    name, colon, port = host.lower().partition(":")
    host = ("127.0.0.1" if name == "localhost" else name) + colon + port
    return f"{scheme.lower()}://{host}{slash}{path}".rstrip("/")


def absolute(config_path: Path) -> Path:
    """Records are keyed by the config's path, so it is made absolute (not resolved: a
    symlinked config stays the link); a relative ``--config`` from one folder must not find
    another folder's record, nor leave its own unfindable."""
    return Path(os.path.abspath(config_path))


def config_target(config_path: Path) -> Path:
    """The file to read and write: behind a symlink (dotfile managers use them), the link's
    target, so the link survives; a link to a missing folder is refused rather than followed."""
    if not config_path.is_symlink():
        return config_path
    target = Path(os.path.realpath(config_path))
    if not target.parent.is_dir():
        raise InstallError(f"{config_path} links to {target}, whose folder is missing; fix or remove the link")
    return target


def read_config(config_path: Path, fmt: ConfigFormat = JSON) -> tuple[Path, bool, bytes, str, dict[str, Any]]:
    """The file behind ``config_path``, whether it exists, its bytes, text and parsed object.
    A file that does not parse stops the install here, untouched, saying what is wrong."""
    target = config_target(config_path)
    existed = target.exists()
    original = target.read_bytes() if existed else b""
    try:
        text = original.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InstallError(f"{config_path} is not UTF-8 text; not touching it") from exc
    try:
        config = fmt.parse(text)
    except FormatError as exc:
        raise InstallError(
            f"{config_path} {exc}; fix it (or move it away), then run install again. ocpc did not touch it"
        ) from exc
    return target, existed, original, text, config


def edit_config(
    settings: Settings,
    *,
    config_path: Path,
    harness: str,
    plan: Callable[[dict[str, Any]], list[Edit]],
    proxy_url: str | None = None,
    fmt: ConfigFormat = JSON,
    dry_run: bool = False,
) -> Said:
    """Apply ``plan``'s edits to the config, backed up and recorded; one line per change.

    Every harness goes through here, so each gets the same care: nothing is written that
    does not read back as planned, a damaged record file stops us before the config is
    touched, and a symlinked config is written behind its link with its mode kept. With
    ``dry_run`` everything is planned and checked, and nothing is written.
    """
    config_path = absolute(config_path)
    target, existed, original, text, config = read_config(config_path, fmt)
    records = load_records(settings)
    previous = records.get(str(config_path))
    if previous is not None and previous.get("harness", "opencode") != harness:
        raise InstallError(
            f"ocpc installed {previous.get('harness', 'opencode')} into {config_path}, not {harness}; "
            f"pick this harness's own config (--config)"
        )
    edits = plan(config)
    if not edits:
        return Said(config=str(target), dry_run=dry_run)
    try:
        new_text, changes = fmt.apply(text, edits)
    except FormatError as exc:
        raise InstallError(
            f"{config_path} {exc}; ocpc did not touch it. Make these changes by hand instead: "
            + "; ".join(e.says for e in edits if e.says)
        ) from exc
    diff = "".join(
        difflib.unified_diff(
            text.splitlines(keepends=True),
            new_text.splitlines(keepends=True),
            str(target) if existed else "/dev/null",
            str(target),
        )
    )
    behind = f" (behind the link {config_path})" if target != config_path else ""
    if dry_run:
        return Said(
            [e.says for e in edits if e.says] + [f"dry run: would write {target}{behind}; wrote nothing"],
            config=str(target),
            diff=diff,
            dry_run=True,
        )
    backup = _backup(settings, config_path, original) if existed else None
    write_keeping_mode(target, new_text.encode())
    save_record(
        settings,
        InstallRecord(
            str(config_path),
            existed,
            str(backup) if backup else None,
            hashlib.sha256(new_text.encode()).hexdigest(),
            changes,
            harness=harness,
            proxy_url=proxy_url,
            format=fmt.name,
        ),
    )
    return Said(
        [e.says for e in edits if e.says] + [f"wrote {target}{behind}" + (f" (backup: {backup})" if backup else "")],
        config=str(target),
        diff=diff,
    )


def write_keeping_mode(path: Path, data: bytes) -> None:
    """Write atomically, keeping an existing file's mode and (when allowed) its owner:
    a 0644 config stays 0644, and root editing a user's config leaves it the user's."""
    try:
        before: os.stat_result | None = path.stat()
    except FileNotFoundError:
        before = None
    write_atomic(path, data, like=before)


def restore_config(record: InstallRecord, config_path: Path) -> list[str]:
    """Put the config back: the backup, or no file, or the current text minus our changes."""
    target = config_target(config_path)
    if not target.exists():  # deleted since: there is nothing of ours left to take out
        if not record.existed:
            return [f"{config_path} is gone already (ocpc had created it); nothing to restore"]
        return [
            f"{config_path} is gone (deleted since install); wrote nothing"
            + (f"; the original is still in {record.backup}" if record.backup else "")
        ]
    current = target.read_bytes()
    if record.restorable and hashlib.sha256(current).hexdigest() == record.written_sha256:
        if record.existed and record.backup:
            write_keeping_mode(target, Path(record.backup).read_bytes())
            return [f"restored {target} from {record.backup}"]
        if record.existed:  # only the npm files were ours: the config is the user's as it is
            return []
        target.unlink()
        return [f"removed {target} (ocpc had created it)"]
    if not record.insertions:
        return []
    text, kept = _without_changes(current, record, config_path)
    if text.encode() == current:
        return [f"ocpc's entries are no longer in {target}; left it as it is"] + kept
    if not record.existed and not kept and format_of(record).parse(text) == {}:
        target.unlink()  # ocpc created it, and all that is left are ocpc's entries' remains
        return [f"removed {target} (ocpc had created it; the agent had rewritten it since, with nothing of yours)"]
    write_keeping_mode(target, text.encode())
    return [f"removed ocpc's entries from {target}; your later edits are kept"] + kept


def withdraw(
    settings: Settings, *, config_path: Path, harness: str, picks: Callable[[dict[str, Any]], bool]
) -> tuple[bool, list[str]]:
    """Take out the recorded changes of an earlier install that ``picks`` chooses (the user
    chose otherwise since: ``ocpc install --keep-title`` after an install that turned titles
    off); the record keeps the others, so uninstall still puts the config back byte for byte.

    A change the user edited since stays (it is theirs now: off the record too), and is said;
    nothing else in the file moves. Returns whether the file changed, and what to say.
    """
    config_path = absolute(config_path)
    raw = load_records(settings).get(str(config_path))
    if raw is None:
        return False, []
    record = parse_record(settings, raw)
    chosen = [change for change in record.insertions if picks(change)]
    if record.harness != harness or not chosen:
        return False, []
    fmt = format_of(record)
    target, _, current, text, _ = read_config(config_path, fmt)
    by_hand = f"{config_path} changed where ocpc wrote; take it out by hand"
    kept: list[str] = []
    try:
        text = fmt.undo(text, chosen, kept)
        fmt.parse(text)
    except FormatError as exc:
        raise InstallError(f"taking ocpc's entry out would leave {config_path} unreadable ({exc}); {by_hand}") from exc
    untouched = hashlib.sha256(current).hexdigest() == record.written_sha256
    changed = text.encode() != current
    if changed:
        write_keeping_mode(target, text.encode())
    # the backup stays the whole truth only while nobody else has written the file since
    record.restorable = record.restorable and untouched
    record.written_sha256 = hashlib.sha256(text.encode()).hexdigest()
    record.insertions = [change for change in record.insertions if not picks(change)]
    records = load_records(settings)
    records[str(config_path)] = asdict(record)
    write_records(settings, records)
    return changed, kept + ([f"wrote {target}"] if changed else [])


def _without_changes(current: bytes, record: InstallRecord, config_path: Path) -> tuple[str, list[str]]:
    """The config minus exactly ocpc's changes, checked to still read in its format, and one
    line for each of ocpc's entries the user changed since (those stay)."""
    by_hand = "restore it by hand" + (f" (the original is in {record.backup})" if record.backup else "")
    try:
        text = current.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InstallError(f"{config_path} is no longer UTF-8 text; {by_hand}") from exc
    kept: list[str] = []
    try:
        return format_of(record).undo(text, record.insertions, kept), kept
    except FormatError as exc:
        raise InstallError(f"{config_path} {exc}; {by_hand}") from exc


def format_of(record: InstallRecord) -> ConfigFormat:
    """The format the record's config was edited in (records from before formats: JSON)."""
    from oc_prefix_cache.install.toml_format import TOML
    from oc_prefix_cache.install.yaml_format import YamlFormat

    formats: dict[str, ConfigFormat] = {"json": JSON, "toml": TOML, "yaml": YamlFormat(record.harness)}
    if record.format not in formats:
        raise InstallError(
            f"ocpc installed {record.config} as {record.format!r}, which this ocpc cannot undo; upgrade ocpc"
        )
    return formats[record.format]


def _backup(settings: Settings, config_path: Path, original: bytes) -> Path:
    folder = private_dir(settings.home / "backups")  # 0700; mkstemp makes each copy 0600
    fd, name = tempfile.mkstemp(prefix=f"{config_path.name}.{time.strftime('%Y%m%d-%H%M%S')}.", dir=folder)
    with os.fdopen(fd, "wb") as out:
        out.write(original)
    return Path(name)


def records_path(settings: Settings) -> Path:
    return settings.home / "install.json"


def load_records(settings: Settings) -> dict[str, dict[str, Any]]:
    path = records_path(settings)
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise InstallError(f"{path} is damaged ({exc}); fix or remove it") from exc
    return data if isinstance(data, dict) else {}


def write_records(settings: Settings, records: dict[str, dict[str, Any]]) -> None:
    write_private(records_path(settings), json.dumps(records, indent=1).encode())


def parse_record(settings: Settings, raw: dict[str, Any]) -> InstallRecord:
    try:
        return InstallRecord(**raw)
    except TypeError as exc:
        raise InstallError(f"{records_path(settings)} is damaged ({exc}); fix or remove it") from exc


def installed(settings: Settings, harness: str) -> list[InstallRecord]:
    """The configs ocpc installed ``harness`` into, as recorded."""
    return [
        record for raw in load_records(settings).values() if (record := parse_record(settings, raw)).harness == harness
    ]


def save_record(settings: Settings, record: InstallRecord) -> None:
    records = load_records(settings)
    previous = records.get(record.config)
    if previous is not None:
        record.npm_folder = previous.get("npm_folder")
        record.npm_created = previous.get("npm_created") or []
        record.npm_lock_sha256 = previous.get("npm_lock_sha256")
    if previous is not None and previous.get("insertions"):
        # a second install on top: keep the first backup and changes
        record.backup = previous["backup"]
        record.existed = previous["existed"]
        record.insertions = previous["insertions"] + record.insertions
        record.restorable = False
    records[record.config] = asdict(record)
    write_records(settings, records)
