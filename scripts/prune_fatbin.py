"""Zero the GPU code of every architecture but one in FBGEMM's shared libraries, so the CUDA stack travels small.

fbgemm-gpu's CUDA wheel carries each kernel as a cubin for sm_80, sm_90 and sm_100 (465 MB zipped, 2.5 GB unpacked).
A GPU loads only the cubin of its own architecture, so the others' payloads can be zeroed in place: every fatbin
header, offset and size stays as it was (the ELF files keep their layout), and the zeros compress to nothing. The
pruned stack then crosses to a device machine in two 42 MiB parts instead of nine 56 MiB ones (scripts/gpu_pack.sh).

Fatbin layout (`.nv_fatbin` section): a run of containers, each a 16-byte header (magic 0xBA55ED50, version, header
size, payload size) followed by entries, each a header (kind, version, header size, payload size, ..., SM arch at
byte 28) and its payload.

    python scripts/prune_fatbin.py 90 site/fbgemm_gpu/*.so     # keep sm_90 (H100 / H200)
"""

from __future__ import annotations

import struct
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator

FATBIN_MAGIC = 0xBA55ED50


def fatbin_section(path: str) -> tuple[int, int] | None:
    """(file offset, size) of the ELF section `.nv_fatbin`, or None when the library has no GPU code."""
    out = subprocess.check_output(["readelf", "-S", "-W", path], text=True)
    for line in out.splitlines():
        if " .nv_fatbin " in line:
            fields = line.split(".nv_fatbin")[1].split()
            return int(fields[2], 16), int(fields[3], 16)
    return None


def entries(buf: bytes, off: int, size: int) -> Iterator[tuple[int, int, int, int]]:
    """(payload offset, payload size, kind, SM arch) of every entry of every fatbin container in the section."""
    pos, end = off, off + size
    while pos + 16 <= end:
        magic, _ver, hsz, fsz = struct.unpack_from("<IHHQ", buf, pos)
        if magic != FATBIN_MAGIC:  # alignment padding between containers
            pos += 8
            continue
        p, stop = pos + hsz, pos + hsz + fsz
        while p < stop:
            kind, _ev, ehsz, psz = struct.unpack_from("<HHIQ", buf, p)
            arch = struct.unpack_from("<I", buf, p + 28)[0]
            yield p + ehsz, psz, kind, arch
            p += ehsz + psz
        pos = stop


def prune(path: str, keep_arch: int) -> Counter:
    """Zero the payloads of entries whose arch is not `keep_arch`; bytes kept / zeroed. Refuses to leave a library
    without any code for `keep_arch`."""
    sec = fatbin_section(path)
    sizes: Counter = Counter()
    if sec is None:
        return sizes
    buf = bytearray(open(path, "rb").read())
    for start, psz, _kind, arch in list(entries(bytes(buf), *sec)):
        keep = arch == keep_arch
        sizes["kept" if keep else "zeroed"] += psz
        if not keep:
            buf[start : start + psz] = bytes(psz)
    if sizes["kept"] == 0:
        raise SystemExit(f"{path}: no code for sm_{keep_arch}; refusing to prune it")
    with open(path, "wb") as f:
        f.write(buf)
    return sizes


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    arch = int(sys.argv[1])
    for lib in sys.argv[2:]:
        s = prune(lib, arch)
        if s:
            print(f"{lib}: kept {s['kept'] / 2**20:.1f} MiB, zeroed {s['zeroed'] / 2**20:.1f} MiB")
