"""The runtime stays light: importing kvruntime pulls in neither the compile stage nor its heavy dependencies
(the scan for pickles and remote code is tests/test_security.py)."""

import subprocess
import sys


def test_kvruntime_imports_without_the_compile_stage():
    code = (
        "import sys, kvruntime\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in {'kvcompile', 'd3rlpy', 'datasets', 'kvpress'})\n"
        "print(','.join(bad))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == ""
