"""Every offline command of the README runs on a plain ``pip install tokenbridge`` (issue 12):
the commands are read from README.md itself and run in a child where what only the
``[test]`` / ``[trainers]`` extras install (torch, transformers, datasets, pandas, openai,
the trainers) cannot be imported, as on a machine that never installed them."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, write_run_config
from outputs_support import SRC
from tokenbridge.pipeline import load_run_config, run_pipeline

#: Import roots of what the extras (and the test tools) bring; none is a dependency of the package.
EXTRAS_ONLY = ("torch", "transformers", "datasets", "pandas", "openai", "hypothesis", "pytest", "specforge",
               "speculators", "sglang", "renderers", "tinker_cookbook", "safetensors")
_PLAIN = """
import sys
class _NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, _NotInstalled())
from tokenbridge.cli import main
sys.argv[0] = "tokenbridge"
main()
"""
#: README commands that need the network or never end (real providers, a server).
_ONLINE = ("--config generate.toml", "probe ", "emulator ", "--base-url")


def _readme_commands() -> list[str]:
    blocks, current = [], None
    for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            if current is None:
                current = [] if line.strip() in ("```", "```bash", "```sh") else ["<not shell>"]
            else:
                if current[:1] != ["<not shell>"]:
                    blocks.append("\n".join(current) + "\n")
                current = None
        elif current is not None:
            current.append(line)
    commands = []
    for block in blocks:
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split("  #")[0].strip()
            for prefix in (".venv/bin/tokenbridge ", "tokenbridge "):
                if line.startswith(prefix) and not any(s in line for s in _ONLINE):
                    commands.append(line[len(prefix):])
    return commands


def test_the_readme_names_the_commands_this_test_runs():
    commands = _readme_commands()
    kinds = sorted({c.split()[0] for c in commands})
    assert kinds == ["export", "inspect", "reconstruct", "report", "vocab"], commands
    assert sum(c.startswith("export ") for c in commands) == 4  # one per format


@pytest.fixture(scope="module")
def workdir(kimi_dir, tmp_path_factory) -> Path:
    """A folder laid out like a checkout: examples/, ../shared, RUN from a small run and
    runs/k25 holding its exchanges (the README's generate against a real API)."""
    root = tmp_path_factory.mktemp("plain") / "clone"
    root.mkdir()
    (root / "examples").symlink_to(ROOT / "examples")
    (root.parent / "shared").symlink_to(kimi_dir.parents[1])
    run_pipeline(load_run_config(write_run_config(root, kimi_dir)), echo=lambda _: None)
    (root / "RUN").mkdir()
    (root / "out" / "reconstructed.jsonl").rename(root / "RUN" / "reconstructed.jsonl")
    (root / "runs" / "k25").mkdir(parents=True)  # what the README's (online) generate leaves
    (root / "out" / "exchanges.jsonl").rename(root / "runs" / "k25" / "exchanges.jsonl")
    return root


def test_every_offline_readme_command_runs_without_the_extras(workdir):
    commands = _readme_commands()
    for cmd in commands:
        res = subprocess.run([sys.executable, "-c", _PLAIN.format(blocked=EXTRAS_ONLY), *shlex.split(cmd)],
                             cwd=workdir, capture_output=True, text=True, timeout=300, env={"PYTHONPATH": SRC})
        # the README's reconstruct example has one broken line on purpose: exit 1, said in the README
        want = 1 if cmd.startswith("reconstruct examples/exchanges.jsonl") else 0
        assert res.returncode == want, (cmd, res.stdout[-2000:], res.stderr[-2000:])
        assert "Traceback" not in res.stderr and "No module named" not in res.stderr, (cmd, res.stderr[-2000:])
    assert (workdir / "runs" / "k25" / "reconstructed.jsonl").is_file()
    run = workdir / "RUN"
    for name in ("export/specforge/train.jsonl", "export/speculators/dataset_info.json", "export/parquet/README.md",
                 "export/conv/README.md", "vocab/vocab_mapping.pt", "vocab/d2t.npy", "report/report.html"):
        assert (run / name).is_file(), name
