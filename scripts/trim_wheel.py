"""Trim a binary wheel to the shared libraries one import needs, and repack it as a valid wheel.

``scripts/gpu_wheels.sh`` carries the CUDA builds of Mooncake and NIXL to a GPU machine that
has no network, inside a 64 MiB budget, and both wheels ship far more than pdxfer loads (a
process-group library, EP kernels for three torch versions, benchmark binaries, a master,
headers, object-store plugins). What a wheel keeps here:

* every Python file and the ``.dist-info`` (less ``RECORD``, rewritten, and the console
  scripts, whose programs are gone);
* the ELF files named by ``--root`` (the extension modules pdxfer imports and what the
  library ``dlopen``s: NIXL's UCX plugin, UCX's transport modules) and, transitively, every
  ``NEEDED`` library found inside the wheel through the file's ``RPATH``/``RUNPATH``;
* nothing matched by ``--drop``, even when a Python file would import it.

A ``NEEDED`` library that the wheel does not hold is the system's (glibc, ``libcuda``); the
script lists them so a missing one shows here, not on the GPU machine.

    python scripts/trim_wheel.py IN.whl OUT_DIR --root 'mooncake/engine\\.so' [--drop RE]
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import posixpath
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

_DYN = re.compile(r"\((NEEDED|RPATH|RUNPATH)\)\s+\S+ \S+: \[(.*)\]")


def _dynamic(path: Path) -> tuple[list[str], list[str]]:
    """(NEEDED names, RPATH+RUNPATH entries) of an ELF file, read by ``readelf -d``."""
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True).stdout
    needed, rpath = [], []
    for kind, val in _DYN.findall(out):
        if kind == "NEEDED":
            needed.append(val)
        else:
            rpath += val.split(":")
    return needed, rpath


def _is_elf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"\x7fELF"


def closure(root: Path, names: list[str], roots: list[str]) -> tuple[set[str], set[str]]:
    """Archive names reachable from ``roots`` through NEEDED, and the NEEDED names found
    nowhere in the wheel (the system's)."""
    have = set(names)
    keep: set[str] = set()
    system: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in keep:
            continue
        keep.add(name)
        needed, rpath = _dynamic(root / name)
        here = posixpath.dirname(name)
        dirs = [
            posixpath.normpath(d.replace("$ORIGIN", here).replace("${ORIGIN}", here))
            for d in rpath
            if "$ORIGIN" in d or "${ORIGIN}" in d
        ] + [here]
        for lib in needed:
            hit = next(
                (posixpath.join(d, lib) for d in dirs if posixpath.join(d, lib) in have), None
            )
            if hit is None:
                system.add(lib)
            else:
                todo.append(hit)
    return keep, system


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def trim(wheel: Path, out_dir: Path, roots: list[str], drop: list[str]) -> Path:
    dropped = [re.compile(d) for d in drop]
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(wheel) as z:
        t = Path(tmp)
        z.extractall(t)
        names = [i.filename for i in z.infolist() if not i.is_dir()]
        info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
        root_names = [
            n
            for n in names
            if any(re.fullmatch(r, n) for r in roots)
            and _is_elf(t / n)
            and not any(d.search(n) for d in dropped)
        ]
        if not root_names:
            raise SystemExit(f"{wheel.name}: no file matches the roots {roots}")
        libs, system = closure(t, names, root_names)
        keep = []
        for n in names:
            top = n.split("/")[0]
            if any(d.search(n) for d in dropped):
                continue
            if top == info:
                if posixpath.basename(n) in ("RECORD", "entry_points.txt") or "/sboms/" in n:
                    continue
                keep.append(n)
            elif n in libs or (n.endswith((".py", ".pyi", "py.typed")) and ".data/" not in n):
                keep.append(n)
        out_dir.mkdir(parents=True, exist_ok=True)
        out = out_dir / wheel.name
        record = f"{info}/RECORD"
        lines = []
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as w:
            for n in sorted(keep, key=lambda n: (n.startswith(info), n)):
                data = (t / n).read_bytes()
                zi = zipfile.ZipInfo(n, date_time=(2020, 1, 1, 0, 0, 0))
                zi.compress_type = zipfile.ZIP_DEFLATED
                zi.external_attr = ((t / n).stat().st_mode & 0xFFFF) << 16
                w.writestr(zi, data, compresslevel=9)
                lines.append(_record_line(n, data))
            lines.append(f"{record},,")
            w.writestr(
                zipfile.ZipInfo(record, date_time=(2020, 1, 1, 0, 0, 0)),
                "\n".join(lines) + "\n",
                compress_type=zipfile.ZIP_DEFLATED,
            )
    mib = out.stat().st_size / 2**20
    print(
        f"{wheel.name}: {len(names)} files, {wheel.stat().st_size / 2**20:.1f} MiB -> "
        f"{len(keep)} files, {mib:.1f} MiB; system libraries it needs: "
        f"{' '.join(sorted(system))}",
        file=sys.stderr,
    )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("wheel", type=Path)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument(
        "--root",
        action="append",
        default=[],
        required=True,
        help="regular expression (whole archive name) of an ELF file to keep",
    )
    ap.add_argument(
        "--drop",
        action="append",
        default=[],
        help="regular expression (searched) of archive names to leave out",
    )
    a = ap.parse_args(argv)
    trim(a.wheel, a.out_dir, a.root, a.drop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
