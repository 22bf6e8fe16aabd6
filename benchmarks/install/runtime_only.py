"""The runtime installed alone (`make check-runtime`): in a venv holding `pip install ./runtime` and nothing of the
compile stage, check that none of its dependencies came along, time `import kvruntime`, measure the install, and
answer the shipped pass-key prompt in question mode (the context compressed once, then the question) with a bundle
of compiled artifacts (`kvcompile bundle`), named by its folder and by a hub repo id placed in a local Hugging Face
cache (offline). Standalone: it imports kvruntime and the standard library only.

    python benchmarks/install/runtime_only.py --bundle BUNDLE --prompts calibration_data/prompts
    python benchmarks/install/runtime_only.py --measure-only        # another venv's size and import time

Exit status 1 when a compile-stage package is installed or the answer is wrong.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

COMPILE_STAGE = ("kvcompile", "d3rlpy", "datasets", "scipy", "matplotlib")
PASS_KEY = "25613"
HUB_ID = "kvcompile-check/smollm2-135m-instruct-kvcompile"


def installed(names: tuple[str, ...]) -> list[str]:
    found = []
    for name in names:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def import_seconds(runs: int = 3) -> float:
    """The fastest of `runs` fresh interpreters importing kvruntime and every public name (torch and transformers
    load on first use)."""
    code = "import kvruntime; [getattr(kvruntime, n) for n in kvruntime.__all__]"
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-P", "-c", code], check=True)
        times.append(time.perf_counter() - started)
    return min(times)


def site_packages_mib() -> float:
    root = Path(sysconfig.get_paths()["purelib"])
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) / 2**20


def question_mode_answer(bundle: str, prompts: Path) -> str:
    import kvruntime

    model, tokenizer = kvruntime.load_model()
    context = (prompts / "passkey_2k_context.txt").read_text()
    question = "\n\nWhat is the pass key? The pass key is"
    context_ids = tokenizer(context, return_tensors="pt").input_ids
    question_ids = tokenizer(question, return_tensors="pt", add_special_tokens=False).input_ids
    with kvruntime.compress(model, "compresskv", ratio=0.5, artifacts=[bundle]) as session:
        compressed = session.prefill(context_ids)
        output = compressed.generate(question_ids, max_new_tokens=12, do_sample=False)
    print(compressed.report)
    return tokenizer.decode(output[0, question_ids.shape[1] :], skip_special_tokens=True)


def place_in_hub_cache(bundle: Path, cache: Path, repo_id: str) -> None:
    """The bundle as huggingface_hub caches a downloaded repo: a snapshot folder named by a commit, and the ref
    `main` naming that commit."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    commit = "0" * 40
    shutil.copytree(bundle, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", type=Path)
    parser.add_argument("--prompts", type=Path)
    parser.add_argument("--measure-only", action="store_true")
    args = parser.parse_args()
    print(f"python {platform.python_version()} on {platform.machine()}, {sys.prefix}")
    print(f"import kvruntime: {import_seconds():.2f} s; site-packages: {site_packages_mib():.0f} MiB")
    if args.measure_only:
        return 0
    unwanted = installed(COMPILE_STAGE)
    if unwanted:
        print(f"the runtime-only install holds compile-stage packages: {', '.join(unwanted)}")
        return 1
    with tempfile.TemporaryDirectory() as cache:
        place_in_hub_cache(args.bundle, Path(cache), HUB_ID)
        os.environ.update(HF_HUB_CACHE=cache, HF_HUB_OFFLINE="1")  # read when kvruntime first imports huggingface_hub
        answers = {
            "by folder": question_mode_answer(str(args.bundle), args.prompts),
            f"by hub id {HUB_ID}": question_mode_answer(HUB_ID, args.prompts),
        }
    for how, answer in answers.items():
        print(f"answer ({how}): {answer!r}")
    return 0 if all(PASS_KEY in answer for answer in answers.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
