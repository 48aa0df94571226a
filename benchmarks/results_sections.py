"""
RESULTS.md keeps one section per kind of CPU: `make bench` rewrites only the section of the CPU it ran on.

A kind is the CPU's name, family and model (a name like "AMD EPYC" covers several generations) and its
bf16 feature, the fact that decides the dtypes. Figures from two machines are never mixed in one section,
and a run on one machine never replaces another's: every other section, of a CPU or not, is kept as it
was, in its place. A CPU seen for the first time gets its section after the last CPU section.
"""

import os
import re
from pathlib import Path

CPU_PREFIX = "## CPU: "
TITLE = "# Benchmark results"
INTRO = (
    "One section per kind of CPU (name, family and model, bf16 feature): `make bench` rewrites the section of "
    "the CPU it runs on and leaves the others as they are (benchmarks/results_sections.py)."
)

# x86 family/model -> microarchitecture, where the pair is unambiguous; the family and model are shown anyway
AMD_ZEN = {
    23: [(0x00, 0x2F, "Zen"), (0x30, 0xFF, "Zen 2")],
    25: [(0x00, 0x0F, "Zen 3"), (0x10, 0x1F, "Zen 4"), (0x20, 0x5F, "Zen 3"), (0x60, 0xAF, "Zen 4")],
    26: [(0x00, 0xFF, "Zen 5")],
}
INTEL_FAMILY6 = {85: "Skylake/Cascade Lake", 106: "Ice Lake", 143: "Sapphire Rapids", 207: "Emerald Rapids"}


def microarchitecture(vendor: str, family: int, model: int) -> str | None:
    if vendor == "AuthenticAMD":
        return next((name for lo, hi, name in AMD_ZEN.get(family, []) if lo <= model <= hi), None)
    if vendor == "GenuineIntel" and family == 6:
        return INTEL_FAMILY6.get(model)
    return None


def short_name(model_name: str) -> str:
    """ "Intel(R) Xeon(R) Platinum 8480+ CPU @ 2.00GHz" -> "Intel Xeon Platinum 8480+" """
    name = re.sub(r"\((R|TM|tm)\)", "", model_name)
    name = re.sub(r"\bCPU @.*$|@.*$|\b\d+-Core Processor\b|\bProcessor\b", "", name)
    return " ".join(name.split()) or "unknown CPU"


def cpu_kind(info: dict, bf16: str | None, isa: str) -> str:
    """The section's name, from /proc/cpuinfo's first block (`info`), the bf16 feature that executes bf16
    here (None: emulated) and torch's ISA: "AMD EPYC Zen 4 (family 25, model 17; AVX512-BF16)"."""
    name = short_name(info.get("model name", "")) if info.get("model name") else "unknown CPU"
    where = []
    if "cpu family" in info and "model" in info:
        family, model = int(info["cpu family"]), int(info["model"])
        arch = microarchitecture(info.get("vendor_id", ""), family, model)
        name += f" {arch}" if arch and arch not in name else ""
        where.append(f"family {family}, model {model}")
    where.append(bf16 or f"{isa}, bf16 emulated")
    return f"{name} ({'; '.join(where)})"


def split_sections(text: str) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """(the lines before the first "## " heading, [(heading, the lines under it)])."""
    head, sections = [], []
    for line in text.splitlines():
        if line.startswith("## "):
            sections.append((line, []))
        elif sections:
            sections[-1][1].append(line)
        else:
            head.append(line)
    return head, sections


def demote(lines: list[str]) -> list[str]:
    """One heading level down: a run's own "## " tables become subsections of its CPU's section."""
    return ["#" + line if line.startswith("##") else line for line in lines]


def merge(text: str, kind: str, body: list[str], replace: dict[str, list[str]] | None = None) -> str:
    """RESULTS.md's `text` with the section of CPU `kind` set to `body` (in its place, else after the last
    CPU section). `replace`: other sections, by heading, regenerated from their own source (the compiled
    table); every other section is kept line for line."""
    _, sections = split_sections(text)
    heading, replace = CPU_PREFIX + kind, dict(replace or {})
    new = (heading, [""] + body)
    at = next((i for i, (h, _) in enumerate(sections) if h == heading), None)
    if at is not None:
        sections[at] = new
    else:
        cpus = [i for i, (h, _) in enumerate(sections) if h.startswith(CPU_PREFIX)]
        sections.insert(cpus[-1] + 1 if cpus else 0, new)
    for h, lines in replace.items():
        found = next((i for i, (old, _) in enumerate(sections) if old == h), None)
        if found is None:
            sections.append((h, lines))
        else:
            sections[found] = (h, lines)
    return render(sections)


def render(sections: list[tuple[str, list[str]]]) -> str:
    out = [TITLE, "", INTRO, ""]
    for h, b in sections:
        while b and not b[-1].strip():
            b = b[:-1]
        out += [h, *b, ""]
    return "\n".join(out)


def put_section(results_md: Path, lines: list[str]):
    """RESULTS.md with the section headed lines[0] set to `lines`, in its place (else at the end), every
    other section kept: for the sections a script regenerates from its own JSON (compiled, preparation)."""
    _, sections = split_sections(results_md.read_text() if results_md.exists() else "")
    found = next((i for i, (h, _) in enumerate(sections) if h == lines[0]), None)
    if found is None:
        sections.append((lines[0], lines[1:]))
    else:
        sections[found] = (lines[0], lines[1:])
    tmp = results_md.with_name(f".{results_md.name}.tmp")
    tmp.write_text(render(sections))
    os.replace(tmp, results_md)
