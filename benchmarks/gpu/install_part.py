"""Install the wheels of one part made by `gather_wheels.py` into a target folder, offline; safe to run again.

Run on the GPU host (standard library and pip only), once per carried part, in any order:

    python3 benchmarks/gpu/install_part.py .whl-vllm/part-03 --target /tmp/site
    export PYTHONPATH=/tmp/site:$PWD        # then: python3 -c 'import vllm'

- Every file is checked against the part's MANIFEST.json (sha256) before use.
- A chunk of a wheel too large for one part is kept in ``TARGET/.offline-install/chunks/`` until all its chunks
  have arrived (from this part or earlier ones); then they are joined, the whole wheel is checked against its
  sha256, installed, and the chunks are deleted.
- Wheels are installed with ``pip install --no-index --no-deps --no-compile --target`` into a fresh staging folder
  and then moved into TARGET file by file. Installing straight into a shared ``--target`` would not do: pip then
  replaces (``--upgrade``) or skips (without it) whole top-level folders that several wheels share, such as
  ``bin/`` or the ``opentelemetry/`` and ``google/`` namespace packages, losing what earlier parts put there.
- A wheel installed once is stamped (``.offline-install/done/<sha256>``) and skipped on later runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

MIB = 1 << 20


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(8 * MIB), b""):
            h.update(block)
    return h.hexdigest()


def merge_into(staging: Path, target: Path) -> None:
    """Move every file of `staging` to the same relative path under `target` (folders merged, files replaced)."""
    for root, _dirs, files in os.walk(staging):
        rel = Path(root).relative_to(staging)
        (target / rel).mkdir(parents=True, exist_ok=True)
        for name in files:
            os.replace(Path(root) / name, target / rel / name)


def pip_install(wheels: list[Path], target: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="stage-", dir=target / ".offline-install") as stage:
        cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
               "--disable-pip-version-check", "--no-warn-script-location", "--no-warn-conflicts", "-q",
               "--root-user-action=ignore",
               "--target", stage, *map(str, wheels)]
        subprocess.run(cmd, check=True)
        merge_into(Path(stage), target)


def install_part(part: Path, target: Path) -> dict:
    """Install what `part` completes; returns counts of installed, skipped and still-waiting wheels."""
    manifest = json.loads((part / "MANIFEST.json").read_text())
    state = target / ".offline-install"
    done, chunks = state / "done", state / "chunks"
    done.mkdir(parents=True, exist_ok=True)
    chunks.mkdir(parents=True, exist_ok=True)
    ready, skipped, waiting = [], 0, {}
    for w in manifest["wheels"]:
        if (done / w["sha256"]).exists():
            skipped += 1
            continue
        path = part / w["file"]
        if sha256(path) != w["sha256"]:
            raise SystemExit(f"{path}: sha256 differs from the manifest (damaged in transit?)")
        ready.append((path, w["sha256"]))
    joined = []
    for c in manifest["chunks"]:
        if (done / c["wheel_sha256"]).exists():
            skipped += 1
            continue
        kept = chunks / c["file"]
        if not (kept.exists() and sha256(kept) == c["sha256"]):
            src = part / c["file"]
            if sha256(src) != c["sha256"]:
                raise SystemExit(f"{src}: sha256 differs from the manifest (damaged in transit?)")
            shutil.copyfile(src, kept)
        names = [chunks / f"{c['wheel']}.chunk-{k:02d}-of-{c['count']:02d}" for k in range(1, c["count"] + 1)]
        present = [p for p in names if p.exists()]
        if len(present) < c["count"]:
            waiting[c["wheel"]] = f"{len(present)} of {c['count']} chunks"
            continue
        whole = state / c["wheel"]
        with open(whole, "wb") as out:
            for p in names:
                with open(p, "rb") as f:
                    shutil.copyfileobj(f, out, 16 * MIB)
        if whole.stat().st_size != c["wheel_size"] or sha256(whole) != c["wheel_sha256"]:
            whole.unlink()
            raise SystemExit(f"{c['wheel']}: joined chunks do not match the wheel's size/sha256")
        print(f"joined {c['wheel']} from {c['count']} chunks, sha256 {c['wheel_sha256']} verified", flush=True)
        ready.append((whole, c["wheel_sha256"]))
        joined.append((whole, names))
    if ready:
        pip_install([p for p, _ in ready], target)
        for _, digest in ready:
            (done / digest).touch()
    for whole, names in joined:
        whole.unlink()
        for p in names:
            p.unlink()
    return {"part": manifest["part"], "parts": manifest["parts"], "installed": len(ready), "skipped": skipped,
            "waiting": waiting}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("parts", nargs="+", type=Path, help="part folders (each with MANIFEST.json)")
    ap.add_argument("--target", type=Path, required=True, help="folder to install into (put it on PYTHONPATH)")
    args = ap.parse_args(argv)
    args.target.mkdir(parents=True, exist_ok=True)
    for part in args.parts:
        print(json.dumps(install_part(part, args.target)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
