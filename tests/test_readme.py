"""The README a competitor copies from: its first block installs and tests exactly as CI does
(.ci/run), it fits on a screen before the depth that lives in docs/, and nothing a user reads
points at the kit's internal issues or documents."""

import re
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
INTERNAL_REFERENCE = re.compile(r"\b(?:issue|design)[\s-]*(?:§\s*)?\d+\b|\bissue \d+|design\.md|design §|\.\./shared/|"
                                r"\bthe issue's\b", re.I)


def shell_commands(lines):
    """Each simple command of `lines` (split at &&, || and ;), tokenized, without pip's -q."""
    commands = []
    for line in lines:
        for part in re.split(r"&&|\|\||;", line):
            words = [w for w in shlex.split(part, comments=True) if w != "-q"]
            if words:
                commands.append(words)
    return commands


def readme_cpu_block():
    """The lines of the README's first ```bash block, continuation lines joined."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    return block.replace("\\\n", " ").splitlines()


def install_and_test(commands):
    return [c for c in commands if c[:3] == ["python", "-m", "pip"] or c[:3] == ["python", "-m", "pytest"]
            or c[:2] == ["python3", "-m"]]


def test_readme_block_installs_and_tests_as_ci_does():
    ci_lines = (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    ci = install_and_test(shell_commands([line for line in ci_lines if not line.startswith(("#", "set ", "cd "))]))
    readme = install_and_test(shell_commands(readme_cpu_block()))
    assert ci == readme, f"README block {readme}\n!= .ci/run {ci}"
    # the CPU wheel comes first, the default wheel is the fallback, and the tests run as CI runs them
    torch_installs = [c for c in readme if c[:4] == ["python", "-m", "pip", "install"] and
                      any(w.startswith("torch") for w in c[4:])]
    assert "--index-url" in torch_installs[0] and "download.pytorch.org/whl/cpu" in " ".join(torch_installs[0])
    assert "--index-url" not in torch_installs[1]
    assert ["python", "-m", "pytest", "-n", "2"] == readme[-1]


def test_readme_block_runs_the_main_job_on_the_sample():
    commands = shell_commands(readme_cpu_block())
    assert ["python", "tools/prepare_data.py", "sample"] in commands
    train = [c for c in commands if c[-2:] == ["python", "train_gpt.py"]]
    assert train and "PRESET=smoke" in train[0] and "DATA_PATH=data/datasets/pydoc_sample_sp1024" in train[0]


def test_readme_is_short_and_links_existing_docs():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 130
    # both install blocks come before the first section heading (one screen before the first scroll)
    assert text.index("pip install torch==2.9.1") < text.index("\n## ")
    for link in re.findall(r"\]\(((?:docs|records)/[^)#]+)", text):
        assert (REPO / link).is_file(), link


def test_no_internal_references_where_users_read():
    """README, docs/, records/README.md and every non-test module (--help texts, log lines, errors)."""
    paths = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "records" / "README.md"]
    paths += [p for p in sorted([*REPO.rglob("*.py"), *REPO.glob("tools/**/*.yaml")])
              if p.relative_to(REPO).parts[0] not in ("tests", "data", "records", "runs")
              and not p.relative_to(REPO).parts[0].startswith(".")]  # .venv, a GPU machine's .device/ ...
    found = []
    for path in paths:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            hit = INTERNAL_REFERENCE.search(line)
            if hit and not (path.suffix == ".yaml" and hit.group(0) == "../shared/"):  # a sweep's data path
                found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def test_every_relative_link_of_the_docs_resolves():
    for page in sorted((REPO / "docs").glob("*.md")):
        for link in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            assert (page.parent / link).exists(), f"{page.name}: {link}"
