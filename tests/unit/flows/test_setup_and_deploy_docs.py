"""The first commands a user types: the README's set-up, `make test`, and the deploy list (README and prefect.yaml)."""

from __future__ import annotations

import re
import subprocess

import yaml

from tests.paths import REPO


def _bash_block_after(text: str, heading: str) -> list[str]:
    section = text[text.index(heading):]
    return section[section.index("```bash\n") + 8:section.index("\n```", section.index("```bash"))].splitlines()


def test_the_readme_set_up_commands_stay_as_they_are():
    assert _bash_block_after((REPO / "README.md").read_text(), "## Set up and run") == [
        "make run     # bootstraps .venv, then trains the default example agent (SmolLM2-135M, arithmetic) on the CPU",
        "make test    # bootstraps .venv, then runs the test suite",
    ]


def test_make_test_shows_the_ten_slowest_tests_and_runs_on_workers():
    dry = subprocess.run(["make", "-n", "test"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert any(re.search(r"-m pytest -q -n auto --maxprocesses=4 --dist loadfile --durations=10$", line)
               for line in dry.stdout.splitlines()), dry.stdout


def _deploy_commands() -> tuple[list[str], list[str]]:
    readme = _bash_block_after((REPO / "README.md").read_text(), "## Deploying")
    header = [line[4:] for line in (REPO / "prefect.yaml").read_text().splitlines() if line.startswith("#   ")]
    return readme, header


def test_the_deploy_commands_are_one_list_that_a_new_terminal_can_follow():
    readme, header = _deploy_commands()
    assert readme == header  # prefect.yaml's header repeats the README's list
    commands = [line.split("  #")[0].strip() for line in readme]
    # one set-up command, after the server and before the workers that run what it deployed
    assert commands.index("prefect server start --host 127.0.0.1 --port 4200") < commands.index("trajflow deploy") \
        < commands.index("prefect worker start --pool cpu-pool")
    assert "PREFECT_SERVER_ANALYTICS_ENABLED=false" in readme[0] and readme[0].startswith("export PREFECT_API_URL=")
    for line in readme:  # the commands that never return say they need a terminal of their own
        blocks = line.startswith(("prefect server start", "prefect worker start"))
        assert ("# blocks: own terminal" in line) == blocks, line


def test_prefect_yaml_deploys_the_flows_from_the_checkout_named_at_deploy_time():
    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    assert spec["pull"] == [{"prefect.deployments.steps.set_working_directory": {"directory": "{{ $TRAJFLOW_HOME }}"}}]
    for deployment in spec["deployments"]:
        path, _, name = deployment["entrypoint"].partition(":")
        assert f"def {name}(" in (REPO / path).read_text()
