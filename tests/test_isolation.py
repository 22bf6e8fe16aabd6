"""The runtime stays light: importing kvruntime pulls in neither the compile stage nor its heavy dependencies,
and no file loads pickles or remote code."""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_kvruntime_imports_without_the_compile_stage():
    code = (
        "import sys, kvruntime\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in {'kvcompile', 'd3rlpy', 'datasets', 'kvpress'})\n"
        "print(','.join(bad))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == ""


def test_no_pickle_loads_or_remote_code_in_the_sources():
    pattern = re.compile(r"torch\.load\(|pickle\.loads?\(|trust_remote_code\s*=\s*True")
    sources = [*ROOT.glob("kvcompile/**/*.py"), *ROOT.glob("runtime/**/*.py"), *ROOT.glob("benchmarks/**/*.py")]
    assert sources
    offenders = [str(p.relative_to(ROOT)) for p in sources if pattern.search(p.read_text())]
    assert offenders == []
