"""Gather the wheels an offline GPU host needs, and split them into parts small enough to carry one at a time.

Run it where pip reaches a package index; `install_part.py` (beside this file) installs the parts on the host,
which needs nothing but Python 3.12 and pip.

1. Read a wheel list (``name==version`` lines; ``wheels-vllm-<version>.txt`` for ``--vllm``, which must name the
   same torch as ``--torch`` in its ``# torch:`` line, or any ``--list``).
2. ``pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_17..2_39_x86_64`` of
   exactly those pins into ``OUT/cache/`` (no resolution: the list is the whole closure, tested on the host).
3. Pack the wheels into ``OUT/part-01/``, ``part-02/``... of at most ``--part-mib`` each (first fit, largest first);
   a wheel larger than a part (vLLM's is 290 MiB) is cut into byte chunks ``<wheel>.chunk-KK-of-NN`` that
   `install_part.py` joins and checks against the whole wheel's sha256. Each part holds a ``MANIFEST.json``
   (file, size, sha256; for chunks also the wheel's name, size and sha256).

``--draft`` writes a starting list for another vLLM/torch pair instead: pip resolves ``vllm==V torch==T`` for that
platform, and the packages the host image already has (``h200-image-packages.txt``), torch's own family and the
kernels a text model with LoRA does not need are left out. Test a drafted list on the host before trusting it:
the traps in ``wheels-vllm-0.26.0.txt`` (a missing pycountry, a too-new xgrammar) were found only by running it.

    python benchmarks/gpu/gather_wheels.py --vllm 0.26.0 --torch 2.11 --out .whl-vllm
    python benchmarks/gpu/gather_wheels.py --list benchmarks/gpu/wheels-flow.txt --out .whl-flow
    python benchmarks/gpu/gather_wheels.py --vllm 0.27.1 --torch 2.12 --draft   # -> wheels-vllm-0.27.1.txt
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
MIB = 1 << 20
PYTHON_VERSION = "3.12"
# manylinux_2_17 (CentOS 7) .. 2_39 (Ubuntu 24.04, the H200 image's glibc): every tag that host accepts.
PLATFORMS = [f"manylinux_2_{m}_x86_64" for m in range(17, 40)] + [
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
# Never carried: the host image has torch's build; the rest is unused by a text model with LoRA (measured).
NOT_CARRIED = re.compile(r"^(torch|torchvision|torchaudio|triton|nvidia-cutlass-dsl.*|"
                         r"nvidia-cuda-(nvdisasm|cccl|nvcc|crt)|nvidia-nvvm|cuda-python|tilelang|quack-kernels|"
                         r"humming-kernels|tokenspeed-.*|"
                         r"fastsafetensors|torchcodec|pynvvideocodec|z3-solver|torch-c-dlpack-ext)$")
KNOWN_PINS = {"xgrammar": "0.2.7"}  # 0.2.9 needs a newer apache-tvm-ffi than vLLM 0.26 pins
KNOWN_EXTRAS = {"pycountry": "26.2.16"}  # imported by pydantic_extra_types.language_code, named by no Requires-Dist


def norm(name: str) -> str:
    """PEP 503 normalised project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_list(path: Path) -> tuple[list[tuple[str, str]], dict[str, str]]:
    """(pins, header fields) of a wheel list: ``name==version`` lines; ``# key: value`` comment lines as fields."""
    pins, fields = [], {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line.startswith("#"):
            m = re.match(r"#\s*(\w+):\s*(\S+)\s*$", line)
            if m:
                fields[m.group(1)] = m.group(2)
            continue
        if line:
            name, sep, version = line.partition("==")
            if not sep:
                raise SystemExit(f"{path}: {line!r} is not name==version")
            pins.append((name.strip(), version.strip()))
    return pins, fields


def pip_platform_args() -> list[str]:
    args = ["--only-binary=:all:", "--python-version", PYTHON_VERSION, "--implementation", "cp"]
    for p in PLATFORMS:
        args += ["--platform", p]
    return args


def download(pins: list[tuple[str, str]], cache: Path) -> dict[str, Path]:
    """pip download the exact pins into `cache`; {normalised name: wheel path} (SystemExit if one is missing)."""
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as req:
        req.write("\n".join(f"{n}=={v}" for n, v in pins) + "\n")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q", "-d",
           str(cache), *pip_platform_args(), "-r", req.name]
    print("+", " ".join(cmd[:8]), "... -r", req.name, flush=True)
    subprocess.run(cmd, check=True)
    os.unlink(req.name)
    found: dict[str, Path] = {}
    for whl in cache.glob("*.whl"):
        name, version = whl.name.split("-")[:2]
        found[f"{norm(name)}=={version}"] = whl
    wheels, missing = {}, []
    for name, version in pins:
        key = f"{norm(name)}=={version}"
        # wheel file names may spell a version differently (0.2.1.1.post7 stays, 1.0 vs 1.0.0 does not occur here)
        match = found.get(key)
        if match is None:
            missing.append(key)
        else:
            wheels[norm(name)] = match
    if missing:
        raise SystemExit(f"no wheel in {cache} for: {', '.join(missing)}")
    return wheels


def sha256(path: Path, start: int = 0, length: int | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        left = length if length is not None else os.path.getsize(path) - start
        while left > 0:
            block = f.read(min(left, 8 * MIB))
            if not block:
                break
            h.update(block)
            left -= len(block)
    return h.hexdigest()


def split_into_parts(wheels: list[Path], out: Path, part_bytes: int) -> list[dict]:
    """Write OUT/part-NN/ folders (wheels and chunks, MANIFEST.json each); returns the manifests."""
    items = []  # (size, kind, payload)
    for whl in wheels:
        size = whl.stat().st_size
        if size <= part_bytes:
            items.append((size, "wheel", {"path": whl}))
            continue
        count = -(-size // part_bytes)
        chunk = -(-size // count)  # equal chunks: each fills one part, the rest packs beside them
        digest = sha256(whl)
        for k in range(count):
            start = k * chunk
            length = min(chunk, size - start)
            items.append((length, "chunk", {"path": whl, "start": start, "length": length, "index": k + 1,
                                             "count": count, "wheel_sha256": digest, "wheel_size": size}))
    items.sort(key=lambda it: -it[0])
    bins: list[list] = []
    free: list[int] = []
    for item in items:
        for i, room in enumerate(free):
            if item[0] <= room:
                bins[i].append(item)
                free[i] -= item[0]
                break
        else:
            bins.append([item])
            free.append(part_bytes - item[0])
    for old in out.glob("part-*"):
        shutil.rmtree(old)
    manifests = []
    for i, content in enumerate(bins, 1):
        folder = out / f"part-{i:02d}"
        folder.mkdir(parents=True)
        manifest = {"part": i, "parts": len(bins), "wheels": [], "chunks": []}
        for size, kind, p in sorted(content, key=lambda it: it[2]["path"].name):
            if kind == "wheel":
                dest = folder / p["path"].name
                try:
                    os.link(p["path"], dest)
                except OSError:
                    shutil.copy2(p["path"], dest)
                manifest["wheels"].append({"file": dest.name, "size": size, "sha256": sha256(dest)})
            else:
                dest = folder / f"{p['path'].name}.chunk-{p['index']:02d}-of-{p['count']:02d}"
                with open(p["path"], "rb") as src, open(dest, "wb") as dst:
                    src.seek(p["start"])
                    dst.write(src.read(p["length"]))
                manifest["chunks"].append({"file": dest.name, "size": size, "sha256": sha256(dest),
                                           "wheel": p["path"].name, "index": p["index"], "count": p["count"],
                                           "wheel_size": p["wheel_size"], "wheel_sha256": p["wheel_sha256"]})
        (folder / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
        manifests.append(manifest)
    return manifests


def draft(vllm: str, torch: str, dest: Path) -> None:
    """Resolve vllm==V with torch==T for the host's platform and write a starting list (image packages left out)."""
    image = {norm(x) for x in (HERE / "h200-image-packages.txt").read_text().split() if not x.startswith("#")}
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed",
               "--disable-pip-version-check", "--report", str(report), "--target", str(Path(tmp) / "t"),
               *pip_platform_args(), f"vllm=={vllm}", f"torch=={torch}.*"]
        subprocess.run(cmd, check=True)
        resolved = {norm(i["metadata"]["name"]): i["metadata"]["version"]
                    for i in json.loads(report.read_text())["install"]}
    lines = [f"# vLLM {vllm} for torch {torch}: DRAFT from pip's resolution minus the H200 image's packages;",
             "# test it on the host (install_part.py, then `vllm serve`) before relying on it.", f"# torch: {torch}"]
    keep = {n: v for n, v in resolved.items() if n not in image and not NOT_CARRIED.match(n)}
    for name, version in KNOWN_PINS.items():
        if name in keep and keep[name] != version:
            lines.append(f"# {name}: pip chose {keep[name]}; {version} is the one known to work with vLLM 0.26")
    keep.update({n: v for n, v in KNOWN_EXTRAS.items() if n not in keep})
    lines += [f"{n}=={v}" for n, v in sorted(keep.items(), key=lambda kv: (kv[0] != "vllm", kv[0]))]
    dest.write_text("\n".join(lines) + "\n")
    print(f"wrote {dest} ({len(keep)} wheels)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm", help="vLLM version: reads wheels-vllm-<version>.txt beside this script")
    ap.add_argument("--torch", help="the host's torch (major.minor); must match the list's '# torch:' line")
    ap.add_argument("--list", action="append", default=[], type=Path, help="another wheel list (repeatable)")
    ap.add_argument("--out", type=Path, help="output folder (cache/ and part-NN/ inside; keep it git-ignored)")
    ap.add_argument("--part-mib", type=float, default=54.0, help=(
        "largest part; the device tool carries 64 MiB a call, the working tree (~5 MiB) included"))
    ap.add_argument("--draft", action="store_true", help="write wheels-vllm-<vllm>.txt from pip's resolution")
    args = ap.parse_args(argv)

    lists = list(args.list)
    if args.vllm:
        path = HERE / f"wheels-vllm-{args.vllm}.txt"
        if args.draft:
            if not args.torch:
                ap.error("--draft needs --torch")
            if path.exists():
                ap.error(f"{path.name} exists (a tested list); move it away to draft a new one")
            draft(args.vllm, args.torch, path)
            return 0
        if not path.exists():
            ap.error(f"no list {path.name}: make one with --draft (and test it on the host)")
        lists.insert(0, path)
    if not lists or not args.out:
        ap.error("give --vllm (with --torch) or --list, and --out")
    pins: list[tuple[str, str]] = []
    for path in lists:
        these, fields = read_list(path)
        if args.torch and "torch" in fields and fields["torch"] != args.torch:
            ap.error(f"{path.name} is for torch {fields['torch']}, not {args.torch}")
        pins += these
    wheels = download(pins, args.out / "cache")
    manifests = split_into_parts(sorted(wheels.values()), args.out, int(args.part_mib * MIB))
    total = sum(w.stat().st_size for w in wheels.values())
    print(f"{len(wheels)} wheels, {total / MIB:.1f} MiB, in {len(manifests)} parts under {args.out}/:")
    for m in manifests:
        size = sum(x["size"] for x in m["wheels"] + m["chunks"])
        print(f"  part-{m['part']:02d}: {size / MIB:5.1f} MiB, {len(m['wheels'])} wheels, {len(m['chunks'])} chunks")
    print("On the host, one part per call (any order): python3 benchmarks/gpu/install_part.py "
          f"{args.out}/part-NN --target /tmp/site")
    return 0


if __name__ == "__main__":
    sys.exit(main())
