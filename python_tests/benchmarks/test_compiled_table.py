"""benchmarks/compiled_table.py without compiling anything: how runs of two Triton versions are merged
into compiled.json and shown side by side in RESULTS.md (`make aot-compat` compiles them for real)."""

import sys

import pytest
from support.repo_paths import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import compiled_table  # noqa: E402
from compiled_table import by_variant, merge_runs, section  # noqa: E402


def record(kernel="_k", config="small", dtype="bf16", target="sm_90", registers=64, spills=0, problems=(), cubin=None):
    return dict(
        kernel=kernel,
        config=config,
        dtype=dtype,
        target=target,
        registers=registers,
        shared=48 * 1024,
        spill_stores=spills,
        spill_loads=0,
        spills_ok="",
        call=None,
        problems=list(problems),
        cubin_registers=registers if cubin is None else cubin,
    )


def run(triton, records, sources="same", date="2026-01-01"):
    return dict(
        triton=triton,
        date=date,
        ptxas=[f"ptxas {triton}"],
        seconds=1.0,
        summary=f"{len(records)} variants",
        sources=sources,
        records=records,
    )


def test_the_installed_run_comes_first_then_added_then_previous_runs_of_the_same_sources(capsys):
    installed = run("3.9.0", [record()])
    added = run("3.6.0", [record(registers=70)])
    previous = [
        run("3.9.0", [], date="old"),
        run("3.6.0", [], date="old"),
        run("3.7.0", [record()]),
        run("3.5.0", [record()], sources="other"),
    ]
    runs = merge_runs(installed, [added], previous)
    assert [r["triton"] for r in runs] == ["3.9.0", "3.6.0", "3.7.0"]
    assert runs[0] is installed and runs[1] is added  # the previous 3.9.0 and 3.6.0 runs are replaced
    assert "dropped the Triton 3.5.0 records" in capsys.readouterr().out


def test_an_added_run_of_other_sources_or_of_the_installed_version_is_refused():
    installed = run("3.9.0", [record()])
    with pytest.raises(ValueError, match="other kernel sources"):
        merge_runs(installed, [run("3.6.0", [record()], sources="other")])
    with pytest.raises(ValueError, match="two runs of Triton 3.9.0"):
        merge_runs(installed, [run("3.9.0", [record()])])


def test_variants_are_matched_across_runs():
    a, b = record(target="sm_80"), record(target="sm_90")
    c, d = record(target="sm_90", registers=72), record(target="sm_100")
    assert by_variant([run("3.9.0", [a, b]), run("3.6.0", [c, d])]) == {
        ("_k", "small", "bf16", "sm_80"): [a, None],
        ("_k", "small", "bf16", "sm_90"): [b, c],
        ("_k", "small", "bf16", "sm_100"): [None, d],
    }


def data(runs):
    call = dict(shape="n", bytes=1e6, flops=1e6, math="fp32")
    return dict(
        date="2026-01-01",
        nvcc="release 13.0",
        triton_runs=runs,
        cuda_records=[],
        ns_flops=[],
        adamw=[dict(dtype="fp32", bytes=28, flops=14, call=call)],
    )


def test_the_section_shows_each_version_and_names_what_fails_under_which():
    broken = dict(record(kernel="_b"), error="CompilationError: at 3:4")
    del broken["registers"]
    broken["problems"] = ["_b [small, bf16] on sm_90 (H100 SXM): does not compile: CompilationError: at 3:4"]
    spilling = record(
        kernel="_s", spills=16, cubin=72, problems=["_s [small, bf16] on sm_90 (H100 SXM): spills (16 B ...)"]
    )
    lines = section(data([run("3.9.0", [record(kernel="_b"), record(kernel="_s")]), run("3.6.0", [broken, spilling])]))
    text = "\n".join(lines)
    assert "Also compiled by Triton 3.6.0" in text and "| 3.6.0 | 2026-01-01 | ptxas 3.6.0 | 2 variants |" in text
    assert "| kernel | config | dtype | target | registers 3.9.0 | registers 3.6.0 | smem (KiB) 3.9.0 |" in text
    assert "| _b | small | bf16 | sm_90 | 64 | **does not compile** | 48.0 |  | 0 |  | 3.6.0 |" in lines
    assert "| _s | small | bf16 | sm_90 | 64 | 64 (cubin 72) | 48.0 | 48.0 | 0 | **16** | 3.6.0 |" in lines
    assert f"- Triton 3.6.0: {broken['problems'][0]}" in lines and f"- Triton 3.6.0: {spilling['problems'][0]}" in lines
    assert compiled_table.problems_of(data([run("3.9.0", [record()]), run("3.6.0", [broken])])) == [
        f"Triton 3.6.0: {broken['problems'][0]}"
    ]


def test_one_version_has_no_versions_table():
    text = "\n".join(section(data([run("3.9.0", [record()])])))
    assert "### Triton versions" not in text and "Also compiled by" not in text
