"""RunStore: the files of one run on a local folder or S3, with steps that exist only once committed.

A step's files are written first (each atomically), then :meth:`RunStore.commit` lists them,
records their sha256 and size in ``manifest.json`` and writes that manifest last, atomically. A
crash anywhere before the manifest lands leaves the step uncommitted and every earlier step
untouched. Once committed, a file recorded in the manifest cannot be overwritten with other bytes
or deleted except by :meth:`RunStore.apply_retention`; new files may still be added (they are not
in the manifest). See :mod:`storage.layout` for the layout.

Hashes at commit: a file this RunStore instance wrote is hashed as it is written, and trusted when
its stored size is unchanged; any other file is read back and hashed.

A corrupt manifest (truncated, overwritten, forged) commits nothing, for every reader alike: the first
reader that finds it moves it aside to ``manifest.json.corrupt-<UTC stamp>`` and logs why, so listings,
reads, downloads and the next commit all see an uncommitted step, which a resumed run redoes. The move
is checked afterwards: had a commit replaced the manifest in between, the moved bytes are not the ones
found corrupt and are put back.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from storage.errors import AlreadyExistsError, CorruptManifestError, HashMismatchError, NotFoundError, StorageError
from storage.fs import Location, normalize_root, sha256_bytes, sha256_local
from storage.layout import (
    ADAPTER_DIR,
    RUN_CONFIG,
    RUN_LEASE,
    STEPS_DIR,
    TRAINER_STATE_DIR,
    check_step,
    file_rel,
    is_store_managed,
    manifest_rel,
    parse_step_dir,
    quarantined_manifest_rel,
    step_dir,
)
from storage.manifest import (
    FileEntry,
    StepManifest,
    check_extra,
    check_metrics,
    now_iso,
    parse_manifest,
    trajflow_version,
)
from storage.names import InvalidNameError, safe_prefix, safe_relpath, validate_name
from storage.retention import steps_to_keep

if TYPE_CHECKING:
    from agents.trajectory import TrajectoryGroup

log = logging.getLogger("trajflow.storage")


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "model_dump"):
        return obj.model_dump(mode="json")
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON-serialisable")


class RunStore:
    """The storage of one run: ``<root>/<project>/<run>``."""

    def __init__(self, root: str, project: str, run: str, storage_options: dict | None = None):
        self.project = validate_name("project", project)
        self.run = validate_name("run", run)
        self.root = normalize_root(root)
        self.storage_options = storage_options
        self._loc = Location(f"{self.root.rstrip('/')}/{project}/{run}", storage_options)
        self.url = self._loc.url
        self._written: dict[str, tuple[str, int]] = {}  # run-relative path -> (sha256, size) written here

    def __repr__(self) -> str:
        return f"RunStore({self.url!r})"

    # ---- run config --------------------------------------------------------------------------
    def write_run_config(self, config: dict) -> None:
        """Write ``run.json`` (atomically; replaces an earlier one)."""
        if not isinstance(config, dict):
            raise TypeError(f"run config must be a dict, got {type(config).__name__}")
        self._loc.write_bytes(RUN_CONFIG, self._json_bytes(config, RUN_CONFIG))

    def read_run_config(self) -> dict | None:
        """The run's config, or None when ``run.json`` does not exist."""
        try:
            data = self._loc.read_bytes(RUN_CONFIG, small=True)
        except NotFoundError:
            return None
        return self._parse_json(data, RUN_CONFIG)

    # ---- steps ---------------------------------------------------------------------------------
    def step_url(self, step: int) -> str:
        return self._loc.url_of(step_dir(step))

    def manifests(self) -> dict[int, StepManifest]:
        """Every valid manifest by step. Corrupt ones are moved aside and left out (those steps are not committed)."""
        steps = [s for s in (parse_step_dir(n) for n in self._loc.list_dirs(STEPS_DIR)) if s is not None]
        got = self._loc.read_many([manifest_rel(s) for s in steps])
        out: dict[int, StepManifest] = {}
        for step in steps:
            value = got[manifest_rel(step)]
            if isinstance(value, NotFoundError):
                continue
            if isinstance(value, StorageError):
                raise value
            try:
                out[step] = self._parse_manifest(step, value)
            except CorruptManifestError:
                continue
        return dict(sorted(out.items()))

    def committed_steps(self) -> list[int]:
        """Sorted step numbers whose ``manifest.json`` exists and is valid."""
        return list(self.manifests())

    def latest_step(self) -> int | None:
        steps = self.committed_steps()
        return steps[-1] if steps else None

    def read_manifest(self, step: int) -> StepManifest:
        """The manifest of a committed step; NotFoundError if uncommitted, CorruptManifestError (a NotFoundError)
        if it was invalid and has been moved aside."""
        rel = manifest_rel(step)
        try:
            data = self._loc.read_bytes(rel, small=True)
        except NotFoundError:
            raise NotFoundError(f"step {step} is not committed: {self._loc.url_of(rel)} does not exist") from None
        return self._parse_manifest(step, data)

    def _parse_manifest(self, step: int, data: bytes) -> StepManifest:
        """The manifest in ``data``; if it is corrupt, move it aside, log why and raise CorruptManifestError."""
        try:
            return parse_manifest(data, self._loc.url_of(manifest_rel(step)), step)
        except CorruptManifestError as exc:
            removed, where = self._quarantine(step, data)
            log.warning("step %d is not committed, it will be redone: %s; %s", step, exc, where)
            raise CorruptManifestError(f"step {step} is not committed: {exc}; {where}", removed=removed) from None

    def _quarantine(self, step: int, data: bytes) -> tuple[bool, str]:
        """Move a corrupt manifest (``data``) aside: (whether it is gone from its place, what happened)."""
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
        rel, aside = manifest_rel(step), quarantined_manifest_rel(step, stamp)
        try:
            self._loc.move(rel, aside)
        except NotFoundError:
            return True, "another reader moved it aside first"
        except StorageError as exc:  # e.g. read-only credentials: the step still counts as not committed
            return False, f"it stays in place, it could not be moved aside ({exc})"
        try:
            moved = self._loc.read_bytes(aside, small=True)
            if moved != data:  # a commit replaced it between our read and the move: put that one back
                self._loc.write_bytes(rel, moved, exclusive=True)
                self._loc.delete([aside])
                return False, "a commit replaced it meanwhile; that manifest was left in place"
        except AlreadyExistsError:
            pass
        except StorageError as exc:
            log.warning("step %d: cannot check the manifest moved to %s: %s", step, self._loc.url_of(aside), exc)
        return True, f"moved aside to {self._loc.url_of(aside)}"

    def is_committed(self, step: int) -> bool:
        return self._manifest_or_none(step) is not None

    def _manifest_or_none(self, step: int) -> StepManifest | None:
        """The valid manifest, or None when absent or corrupt (a corrupt manifest commits nothing)."""
        try:
            return self.read_manifest(step)
        except NotFoundError:
            return None

    # ---- files ---------------------------------------------------------------------------------
    def _guard_recorded(self, step: int | None, relpath: str, action: str, sha: str | None = None) -> bool:
        """Refuse to change a file recorded in a committed manifest. True when ``sha`` equals the recorded one."""
        if step is None:
            return False
        try:
            manifest = self._manifest_or_none(step)
        except StorageError as exc:
            verb = "delete" if action == "delete" else "write"
            raise StorageError(f"cannot {verb} {self._loc.url_of(file_rel(step, relpath))}: {exc}") from None
        if manifest is None or relpath not in manifest.files:
            return False
        if sha is not None and manifest.files[relpath].sha256 == sha:
            return True
        raise StorageError(
            f"cannot {action} {self._loc.url_of(file_rel(step, relpath))}: step {step} is committed and its manifest "
            f"records this file (only apply_retention removes committed files)"
        )

    def put_bytes(self, step: int | None, relpath: str, data: bytes) -> str:
        """Write a file atomically; return its sha256 hex."""
        rel = file_rel(step, relpath)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"put_bytes needs bytes for {self._loc.url_of(rel)}, got {type(data).__name__}")
        data = bytes(data)
        sha = sha256_bytes(data)
        if self._guard_recorded(step, relpath, "overwrite", sha):
            return sha
        self._loc.write_bytes(rel, data)
        self._written[rel] = (sha, len(data))
        return sha

    def put_file(self, step: int | None, relpath: str, local_path: str | os.PathLike) -> str:
        """Upload one local file atomically (streamed); return its sha256 hex."""
        rel = file_rel(step, relpath)
        sha, size = sha256_local(os.fspath(local_path))
        if self._guard_recorded(step, relpath, "overwrite", sha):
            return sha
        self._loc.write_file(rel, os.fspath(local_path))
        self._written[rel] = (sha, size)
        return sha

    def get_bytes(self, step: int | None, relpath: str, verify: bool = False) -> bytes:
        """Read a file. With ``verify`` and a committed step, check it against the manifest's sha256."""
        rel = file_rel(step, relpath)
        data = self._loc.read_bytes(rel)
        if verify and step is not None:
            manifest = self._manifest_or_none(step)
            entry = manifest.files.get(relpath) if manifest else None
            if entry is not None and sha256_bytes(data) != entry.sha256:
                raise HashMismatchError(
                    f"hash mismatch for {self._loc.url_of(rel)}: manifest sha256 {entry.sha256}, "
                    f"stored file sha256 {sha256_bytes(data)}"
                )
        return data

    def put_json(self, step: int | None, relpath: str, obj: Any) -> str:
        return self.put_bytes(step, relpath, self._json_bytes(obj, file_rel(step, relpath)))

    def get_json(self, step: int | None, relpath: str) -> Any:
        return self._parse_json(self.get_bytes(step, relpath), file_rel(step, relpath))

    def _json_bytes(self, obj: Any, rel: str) -> bytes:
        try:
            return json.dumps(obj, default=_json_default, ensure_ascii=False).encode()
        except (TypeError, ValueError) as exc:
            raise TypeError(f"cannot write {self._loc.url_of(rel)}: value is not JSON-serialisable: {exc}") from None

    def _parse_json(self, data: bytes, rel: str) -> Any:
        try:
            return json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise StorageError(f"cannot read {self._loc.url_of(rel)}: not valid JSON ({exc})") from None

    def exists(self, step: int | None, relpath: str) -> bool:
        return self._loc.exists(file_rel(step, relpath))

    def list_files(self, step: int | None, prefix: str = "") -> list[str]:
        """Sorted relative paths of the files of a step (or of the run-level area) starting with ``prefix``.

        The store's own files (``manifest.json`` and its quarantined copies; at run level ``run.json``,
        ``lease.json`` and ``steps/``) are not listed.
        """
        safe_prefix(prefix)
        base = step_dir(step) if step is not None else ""
        sub = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        if step is None and (sub == STEPS_DIR or sub.startswith(STEPS_DIR + "/")):
            return []
        found = self._loc.find(f"{base}/{sub}".strip("/") if sub else base)
        rels = [f"{sub}/{r}" if sub else r for r in found]
        if step is None:
            rels = [r for r in rels if r not in (RUN_CONFIG, RUN_LEASE) and not r.startswith(STEPS_DIR + "/")]
        else:
            rels = [r for r in rels if not is_store_managed(r)]
        return sorted(r for r in rels if r.startswith(prefix))

    def delete(self, step: int | None, relpath: str) -> None:
        """Delete a file (no error if absent). Files recorded in a committed manifest are refused."""
        rel = file_rel(step, relpath)
        self._guard_recorded(step, relpath, "delete")
        self._loc.delete([rel])
        self._written.pop(rel, None)

    # ---- trajectories --------------------------------------------------------------------------
    def write_groups(self, step: int | None, relpath: str, groups: list[TrajectoryGroup]) -> str:
        """Store trajectory groups as Parquet (layout: :mod:`storage.trajectories`); return the sha256."""
        from storage.trajectories import groups_to_parquet

        return self.put_bytes(step, relpath, groups_to_parquet(list(groups)))

    def read_groups(self, step: int | None, relpath: str, verify: bool = False) -> list[TrajectoryGroup]:
        from storage.trajectories import groups_from_parquet

        data = self.get_bytes(step, relpath, verify=verify)
        try:
            return groups_from_parquet(data)
        except Exception as exc:  # noqa: BLE001 - a damaged or foreign file
            url = self._loc.url_of(file_rel(step, relpath))
            raise StorageError(f"cannot read trajectories from {url}: {type(exc).__name__}: {exc}") from None

    # ---- folders -------------------------------------------------------------------------------
    def upload_folder(self, step: int | None, relpath: str, local_dir: str | os.PathLike) -> dict[str, str]:
        """Upload every file under ``local_dir`` to ``relpath/``; return {path relative to local_dir: sha256}."""
        safe_relpath(relpath)
        local = Path(local_dir)
        if not local.is_dir():
            raise StorageError(f"cannot upload {local}: it is not a folder")
        files = sorted(p for p in local.rglob("*") if p.is_file())
        hashes: dict[str, str] = {}
        for path in files:
            rel = path.relative_to(local).as_posix()
            hashes[rel] = self.put_file(step, f"{relpath}/{rel}", path)
        return hashes

    def download_folder(
        self, step: int | None, relpath: str, local_dir: str | os.PathLike, verify: bool = True
    ) -> Path:
        """Download every file under ``relpath/`` into ``local_dir``; return ``local_dir`` as a Path.

        For a committed step (and ``verify``), the files are those the manifest records, each checked
        against its sha256 and size before it is moved into place (HashMismatchError names the file).
        """
        safe_relpath(relpath)
        prefix = relpath + "/"
        manifest: StepManifest | None = None
        if step is not None and verify:
            try:
                manifest = self.read_manifest(step)
            except NotFoundError:
                manifest = None
        if manifest is not None:
            entries: dict[str, FileEntry | None] = {
                k[len(prefix):]: v for k, v in manifest.files.items() if k.startswith(prefix)
            }
            if not entries:
                why = " (pruned by retention)" if any(prefix.startswith(p) for p in manifest.pruned_prefixes) else ""
                raise NotFoundError(
                    f"cannot download {self._loc.url_of(file_rel(step, relpath))}: the manifest of step {step} "
                    f"records no files under it{why}"
                )
        else:
            entries = {k[len(prefix):]: None for k in self.list_files(step, prefix)}
            if not entries:
                raise NotFoundError(f"cannot download {self._loc.url_of(file_rel(step, relpath))}: no files under it")
        out = Path(local_dir)
        for name in sorted(entries):
            try:
                safe_relpath(name)
            except InvalidNameError as exc:
                raise StorageError(f"refusing to download {self._loc.url_of(file_rel(step, prefix + name))}: {exc}") from None
            self._download_one(step, prefix + name, out / name, entries[name])
        return out

    def _download_one(self, step: int | None, relpath: str, target: Path, entry: FileEntry | None) -> None:
        rel = file_rel(step, relpath)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
        os.close(fd)
        try:
            self._loc.download(rel, tmp)
            if entry is not None:
                sha, size = sha256_local(tmp)
                if sha != entry.sha256 or size != entry.size:
                    raise HashMismatchError(
                        f"hash mismatch for {self._loc.url_of(rel)}: manifest records sha256 {entry.sha256} "
                        f"({entry.size} bytes), the stored file has sha256 {sha} ({size} bytes)"
                    )
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    # ---- commit --------------------------------------------------------------------------------
    def _hash_files(self, step: int) -> dict[str, FileEntry]:
        base = step_dir(step)
        files: dict[str, FileEntry] = {}
        for rel, size in sorted(self._loc.find(base).items()):
            if is_store_managed(rel):
                continue
            try:
                safe_relpath(rel)
            except InvalidNameError as exc:
                raise StorageError(f"cannot commit step {step}: stored file {self._loc.url_of(f'{base}/{rel}')} has an unsafe name: {exc}") from None
            known = self._written.get(f"{base}/{rel}")
            if known and known[1] == size:
                sha = known[0]
            else:
                sha, size = self._loc.hash_remote(f"{base}/{rel}")
            files[rel] = FileEntry(sha256=sha, size=size)
        return files

    def commit(self, step: int, metrics: dict[str, float] | None = None, extra: dict | None = None) -> StepManifest:
        """Record every file of the step with its hash, then write ``manifest.json`` last, atomically.

        Committing a committed step again returns its manifest when files, metrics and extra are
        identical, and raises StorageError otherwise.
        """
        check_step(step)
        manifest = StepManifest(
            step=step,
            created_at=now_iso(),
            trajflow_version=trajflow_version(),
            files=self._hash_files(step),
            metrics=check_metrics(metrics),
            extra=check_extra(extra),
        )
        try:
            existing, absent = self.read_manifest(step), False
        except CorruptManifestError as exc:
            existing, absent = None, exc.removed  # one that could not be moved aside is replaced in place
        except NotFoundError:
            existing, absent = None, True
        if existing is None:
            try:
                # exclusive when absent: of two writers committing the same step, one wins
                self._loc.write_bytes(manifest_rel(step), manifest.to_bytes(), exclusive=absent)
                return manifest
            except AlreadyExistsError:
                existing = self.read_manifest(step)
        if existing.content_key() == manifest.content_key():
            return existing
        raise StorageError(
            f"cannot commit step {step}: {self._loc.url_of(manifest_rel(step))} already commits it with "
            f"different content ({self._difference(existing, manifest)})"
        )

    def amend_metrics(self, step: int, metrics: dict[str, float]) -> StepManifest:
        """Merge metrics into a committed step's manifest (e.g. validation metrics logged after the
        update); rewritten atomically, files untouched. NotFoundError if the step is not committed."""
        new_metrics = check_metrics(metrics)
        manifest = self.read_manifest(step)
        updated = manifest.model_copy(update={"metrics": {**manifest.metrics, **new_metrics}})
        self._loc.write_bytes(manifest_rel(step), updated.to_bytes())
        return updated

    @staticmethod
    def _difference(old: StepManifest, new: StepManifest) -> str:
        parts = []
        changed = sorted(set(old.files) ^ set(new.files) | {k for k in set(old.files) & set(new.files) if old.files[k] != new.files[k]})
        if changed:
            parts.append(f"files differ: {', '.join(changed[:5])}{' ...' if len(changed) > 5 else ''}")
        if old.content_key()[1] != new.content_key()[1]:
            parts.append("metrics differ")
        if old.content_key()[2] != new.content_key()[2]:
            parts.append("extra differs")
        return "; ".join(parts)

    # ---- retention -----------------------------------------------------------------------------
    def apply_retention(
        self,
        keep_last: int,
        best_metric: str | None = None,
        mode: str = "max",
        prune: tuple[str, ...] = (f"{ADAPTER_DIR}/", f"{TRAINER_STATE_DIR}/"),
    ) -> list[int]:
        """Prune heavy files of old committed steps (policy: :mod:`storage.retention`); return pruned steps.

        Per pruned step the manifest is rewritten first (atomically, without the pruned files and with
        ``pruned: true``), then the files are deleted: a crash in between leaves only unlisted files,
        which the next call deletes.
        """
        if isinstance(prune, str):
            prune = (prune,)
        for p in prune:
            safe_prefix(p)
        manifests = self.manifests()
        keep = steps_to_keep(manifests, keep_last, best_metric, mode)
        pruned = []
        for step, manifest in manifests.items():
            if step in keep:
                continue
            stored = [r for r in self._loc.find(step_dir(step))
                      if not is_store_managed(r) and r.startswith(tuple(prune))]
            listed = [r for r in manifest.files if r.startswith(tuple(prune))]
            if not stored and not listed:
                continue
            if listed or not manifest.pruned:
                new = manifest.model_copy(
                    update={
                        "files": {k: v for k, v in manifest.files.items() if k not in listed},
                        "pruned": True,
                        "pruned_prefixes": sorted(set(manifest.pruned_prefixes) | set(prune)),
                    }
                )
                self._loc.write_bytes(manifest_rel(step), new.to_bytes())
            self._loc.delete([f"{step_dir(step)}/{r}" for r in sorted(set(stored) | set(listed))])
            pruned.append(step)
        return pruned
