"""The runtime stays light: importing kvruntime pulls in neither the compile stage nor its heavy dependencies
(the scan for pickles and remote code is tests/test_security.py)."""

import subprocess
import sys


def test_kvruntime_imports_without_the_compile_stage():
    code = (
        "import sys, kvruntime\n"
        "[getattr(kvruntime, name) for name in kvruntime.__all__]\n"  # every public name: the whole runtime
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in {'kvcompile', 'd3rlpy', 'datasets', 'kvpress'})\n"
        "print(','.join(bad))"
    )
    result = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == ""


def test_the_command_line_parses_and_refuses_without_importing_torch():
    """`kvcompile --help` and the refusals of bad generate arguments come before torch and transformers load
    (they used to take 7-9 s)."""
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from kvcompile.cli import app\n"
        "runner = CliRunner()\n"
        "assert runner.invoke(app, ['--help']).exit_code == 0\n"
        "refused = runner.invoke(app, ['generate', '--prompt-file', 'README.md', '--method', 'snapkv', '--ratio', '2'])\n"
        "assert refused.exit_code == 2, refused.output\n"
        "print(','.join(sorted(m for m in ('torch', 'transformers') if m in sys.modules)))"
    )
    result = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == ""
