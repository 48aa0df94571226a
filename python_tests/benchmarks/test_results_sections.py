"""benchmarks/results_sections.py: RESULTS.md keeps a section per kind of CPU, and a run rewrites only its own
CPU's section (the others, and the compiled table's, are kept line for line)."""

import sys

from support.repo_paths import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from results_sections import CPU_PREFIX, cpu_kind, demote, merge, split_sections  # noqa: E402

ZEN4 = {"vendor_id": "AuthenticAMD", "model name": "AMD EPYC", "cpu family": "25", "model": "17"}
ZEN3 = {"vendor_id": "AuthenticAMD", "model name": "AMD EPYC 7B13 64-Core Processor", "cpu family": "25", "model": "1"}
SPR = {
    "vendor_id": "GenuineIntel",
    "model name": "Intel(R) Xeon(R) Platinum 8480+ CPU @ 2.00GHz",
    "cpu family": "6",
    "model": "143",
}
UNKNOWN_XEON = {
    "vendor_id": "GenuineIntel",
    "model name": "Intel(R) Xeon(R) Processor",
    "cpu family": "6",
    "model": "167",
}


def test_each_kind_of_cpu_is_named_by_family_model_and_bf16_feature():
    assert cpu_kind(ZEN4, "AVX512-BF16", "AVX512") == "AMD EPYC Zen 4 (family 25, model 17; AVX512-BF16)"
    assert cpu_kind(ZEN3, None, "AVX2") == "AMD EPYC 7B13 Zen 3 (family 25, model 1; AVX2, bf16 emulated)"
    assert cpu_kind(SPR, "AMX", "AVX512") == "Intel Xeon Platinum 8480+ Sapphire Rapids (family 6, model 143; AMX)"
    assert cpu_kind(UNKNOWN_XEON, "AMX", "AVX512") == "Intel Xeon (family 6, model 167; AMX)"
    assert cpu_kind({}, None, "DEFAULT") == "unknown CPU (DEFAULT, bf16 emulated)"


def section(kind: str, figure: str) -> list[str]:
    return [f"Machine: {kind}", "", *demote(["## Muon step", "", f"| depth 8 | {figure} |"])]


def results(*parts: tuple[str, list[str]]) -> str:
    return merge_all("", parts)


def merge_all(text, parts):
    for kind, body in parts:
        text = merge(text, kind, body)
    return text


def sections_of(text: str) -> dict:
    """heading -> its lines, without the blank lines that end it"""
    return {h: "\n".join(body).rstrip("\n").split("\n") for h, body in split_sections(text)[1]}


def test_a_run_rewrites_its_own_cpus_section_and_keeps_the_others_line_for_line():
    zen4, zen3 = cpu_kind(ZEN4, "AVX512-BF16", "AVX512"), cpu_kind(ZEN3, None, "AVX2")
    compiled = ["## Compiled, not run: A100, H100, B200", "", "### Triton kernels", "| k | 64 regs |"]
    before = results((zen4, section(zen4, "1.23x")), (zen3, section(zen3, "9.9x"))) + "\n".join(compiled) + "\n"
    after = merge(before, zen4, section(zen4, "1.31x"))
    old, new = sections_of(before), sections_of(after)
    assert list(new) == list(old)  # same sections, same order
    assert "| depth 8 | 1.31x |" in new[CPU_PREFIX + zen4] and "| depth 8 | 1.23x |" not in after
    assert new[CPU_PREFIX + zen3] == old[CPU_PREFIX + zen3]
    assert new[compiled[0]] == old[compiled[0]] == compiled[1:]
    assert merge(after, zen4, section(zen4, "1.31x")) == after  # the same run again: the same file


def test_a_new_cpu_gets_its_own_section_after_the_last_cpus_and_nothing_is_mixed():
    zen4, spr = cpu_kind(ZEN4, "AVX512-BF16", "AVX512"), cpu_kind(SPR, "AMX", "AVX512")
    compiled = ["## Compiled, not run: A100, H100, B200", "", "| k | 64 regs |"]
    before = results((zen4, section(zen4, "1.23x"))) + "\n".join(compiled) + "\n"
    after = merge(before, spr, section(spr, "1.40x"), replace={compiled[0]: ["", "| k | 60 regs |"]})
    new = sections_of(after)
    assert list(new) == [CPU_PREFIX + zen4, CPU_PREFIX + spr, compiled[0]]
    assert "| depth 8 | 1.23x |" in new[CPU_PREFIX + zen4] and "| depth 8 | 1.40x |" not in new[CPU_PREFIX + zen4]
    assert "| depth 8 | 1.40x |" in new[CPU_PREFIX + spr] and "| depth 8 | 1.23x |" not in new[CPU_PREFIX + spr]
    assert new[compiled[0]] == ["", "| k | 60 regs |"]  # regenerated from its own source
    # the run's own tables sit one level under its CPU's heading
    assert "### Muon step" in new[CPU_PREFIX + spr]
    assert after.startswith("# Benchmark results\n")


OWN_SECTIONS = (
    "## Preparation at scale",
    "## Distributed soak",
    "## Checkpoint save with digests",
    "## The windowed family against nanochat and the seeds' GPT",
)


def test_the_checked_in_results_name_the_cpu_of_every_figure():
    """Every "## " section of RESULTS.md is a CPU's, the compiled table (machine-independent) or the
    sections regenerated from their own JSON (preparation, soak, save with digests), which name their CPU."""
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    head, sections = split_sections(text)
    assert not any(line.startswith(("Machine:", "CPU:", "| ")) for line in head)
    for heading, body in sections:
        assert heading.startswith((CPU_PREFIX, "## Compiled, not run", *OWN_SECTIONS)), heading
        if heading in OWN_SECTIONS:  # regenerated from its own JSON: its first line names the CPU
            assert ", on " in body[1], body[1]
        if heading.startswith(CPU_PREFIX):
            assert any(line.startswith("CPU: ") for line in body), heading
