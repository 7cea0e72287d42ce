#!/usr/bin/env python3
"""Counts the cache lines and pages one select touches, from a memory trace.

The select_cold bench's `--footprint N [BLOCKS]` mode runs N selects, each
between two stores to a marker word whose address it prints to stderr. Run
it under valgrind's lackey with its trace and the bench's stderr in one
file, then give this script that file and the bench binary:

    cargo bench --bench select_cold --no-run
    B=target/release/deps/select_cold-<hash>
    valgrind --tool=lackey --trace-mem=yes $B --footprint 5 1 2> trace.log
    python3 benches/footprint.py trace.log $B

It prints, for the last select of the trace: instructions executed, the
distinct 64-byte lines and 4 KiB pages of code and of data, the data split
into stack, heap and the binary's own (static) pages, and the code lines by
function (from the binary's symbol table). Only the order of magnitude and
the differences between two builds mean anything: the allocator's and the
linker's placement move a few lines from build to build.
"""

import bisect
import collections
import subprocess
import sys


def symbols(binary):
    """(start, size, name) of the binary's functions, sorted by start."""
    out = subprocess.run(
        ["nm", "-n", "-C", "-S", binary], capture_output=True, text=True, check=True
    ).stdout
    syms = []
    for line in out.splitlines():
        parts = line.split(" ", 3)
        if len(parts) == 4 and parts[2] in ("t", "T", "w", "W") and parts[1]:
            syms.append((int(parts[0], 16), int(parts[1], 16), parts[3]))
    return syms


def image_size(binary):
    """The end of the binary's highest loaded segment (its .bss), from 0."""
    out = subprocess.run(
        ["readelf", "-lW", binary], capture_output=True, text=True, check=True
    ).stdout
    ends = [
        int(p[2], 16) + int(p[5], 16)
        for p in (l.split() for l in out.splitlines())
        if p and p[0] == "LOAD"
    ]
    return max(ends)


def marker_offset(binary):
    out = subprocess.run(["nm", binary], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        if "select_cold4MARK" in line:
            return int(line.split()[0], 16)
    sys.exit("no select_cold::MARK symbol in " + binary)


def last_select(trace, marker):
    """Code and data accesses between the last pair of marker stores."""
    inside, code, data, done = False, [], [], None
    with open(trace) as f:
        for line in f:
            if len(line) < 4 or line[0] == "=":
                continue
            kind = line[:2].strip()
            try:
                addr, size = line[2:].strip().split(",")
                addr, size = int(addr, 16), int(size)
            except ValueError:
                continue
            if kind in ("S", "M") and addr == marker:
                if inside:
                    done = (code, data)
                inside, code, data = not inside, [], []
            elif inside:
                (code if kind == "I" else data).append((addr, size))
    if done is None:
        sys.exit("no marked select in " + trace)
    return done


def lines(accesses):
    return {a >> 6 for a, s in accesses} | {(a + s - 1) >> 6 for a, s in accesses}


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    trace, binary = sys.argv[1], sys.argv[2]
    with open(trace) as f:
        marker = next(int(l.split()[1], 16) for l in f if l.startswith("marker "))
    # The address the binary was loaded at, from where the marker landed.
    base = marker - marker_offset(binary)
    code, data = last_select(trace, marker)
    code_lines, data_lines = lines(code), lines(data)
    print(f"instructions {len(code)}")
    print(f"code: {len(code_lines)} lines, {len({l >> 6 for l in code_lines})} pages")
    print(f"data: {len(data_lines)} lines, {len({l >> 6 for l in data_lines})} pages")
    image_end = base + image_size(binary)
    for region, keep in [
        ("stack", lambda a: a >= 0x1000000000),
        ("binary", lambda a: base <= a < image_end),
        ("heap and other mappings", lambda a: not (a >= 0x1000000000 or base <= a < image_end)),
    ]:
        mine = {l for l in data_lines if keep(l << 6)}
        print(f"  {region}: {len(mine)} lines, {len({l >> 6 for l in mine})} pages")
    syms = symbols(binary)
    starts = [s for s, _, _ in syms]
    by_fn = collections.defaultdict(set)
    for addr, _ in code:
        offset = addr - base
        i = bisect.bisect_right(starts, offset) - 1
        inside = i >= 0 and offset < syms[i][0] + max(syms[i][1], 1)
        by_fn[syms[i][2] if inside else "(shared libraries)"].add(addr >> 6)
    print("code lines by function:")
    for name, ls in sorted(by_fn.items(), key=lambda x: -len(x[1])):
        print(f"  {len(ls):4} {name[:120]}")


if __name__ == "__main__":
    main()
