"""The wheel installs one namespace, branch_settlement, and nothing generic: a user's own `schemas`,
`processors` or `projections` package beside it breaks nothing. Builds the wheel from this checkout (pip fetches
the build backend), installs it into a folder of its own and runs `settle` from there, away from the repository."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(out), str(REPO)],
                   check=True, capture_output=True, text=True)
    [built] = out.glob("branch_settlement-*.whl")
    return built


def test_the_wheel_holds_one_namespace_with_its_schemas(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert tops == {"branch_settlement", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info"}
    assert "branch_settlement/schemas/ChildFailed.avsc" in names
    assert "branch_settlement/schemas/history/ChildFailed.v1.avsc" in names
    assert "branch_settlement/processors/ledger/fold.py" in names
    # the commands' defaults, data of the package: the topic spec and the ACL set
    assert {"branch_settlement/deploy/topics.json", "branch_settlement/deploy/acls.json",
            "branch_settlement/docs/contract.md"} <= set(names)


def test_a_users_own_schemas_package_does_not_shadow_it(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, text=True)
    user = tmp_path / "user"
    for generic in ("schemas", "processors", "projections"):
        (user / generic).mkdir(parents=True)
        (user / generic / "__init__.py").write_text("raise ImportError('the user\\'s own package was imported')\n")
    events = tmp_path / "events.jsonl"
    events.write_text('{"type": "Tick", "event_id": "t", "idempotency_key": "tick/0/5", "parent_id": "", '
                      '"occurred_at_ms": 0, "now_ms": 5}\n')
    # the user's folder first, then the installed wheel, then the dependencies (this interpreter's site-packages)
    path = os.pathsep.join([str(user), str(target), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    # -I -S: no environment, no site (so not the checkout's editable install either): only these folders
    done = subprocess.run([sys.executable, "-I", "-S", "-c",
                           "import sys; sys.path[:0] = sys.argv[1].split(sys.argv[2]); "
                           "import branch_settlement; print(branch_settlement.__file__, file=sys.stderr); "
                           "from branch_settlement.processors.cli.main import main; "
                           "sys.exit(main(['replay', '--json', sys.argv[3]]))", path, os.pathsep, str(events)],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stderr.startswith(str(target)), done.stderr
    assert '"result": "ok"' in done.stdout
    # the topic spec and the ACL set the installed commands read by default: the wheel's own
    specs = subprocess.run([sys.executable, "-I", "-S", "-c",
                            "import sys; sys.path[:0] = sys.argv[1].split(sys.argv[2]); "
                            "from branch_settlement.processors.kafka import acls, topics; "
                            "print(topics.DEFAULT_SPEC_PATH, len(topics.load_spec().topics)); "
                            "print(acls.DEFAULT_SPEC_PATH, acls.DEFAULT_SPEC_PATH.is_file())", path, os.pathsep],
                           capture_output=True, text=True, cwd=tmp_path)
    assert specs.returncode == 0, specs.stderr
    lines = specs.stdout.splitlines()
    assert lines[0].startswith(str(target)) and lines[0].endswith(" 7"), specs.stdout
    assert lines[1].startswith(str(target)) and lines[1].endswith(" True"), specs.stdout


def test_without_the_compiled_package_the_wheel_runs_its_pure_python_path(wheel: Path, tmp_path: Path) -> None:
    """The main package needs no toolchain (docs/implementations.md): where branch-settlement-native is not
    installed (here: its import blocked), `auto` falls back to the pure-Python implementation with the same
    answer, and asking for the compiled one is one line and exit 2."""
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, text=True)
    events = REPO / "examples" / "worked-example.jsonl"
    path = os.pathsep.join([str(target), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])

    def replay(block_native: bool, *flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-I", "-S", "-c",
                               "import sys; sys.path[:0] = sys.argv[1].split(sys.argv[2]); "
                               + ("sys.modules['branch_settlement_native'] = None; " if block_native else "") +
                               "from branch_settlement.processors.cli.main import main; "
                               "from branch_settlement.schemas import native; "
                               "print('auto picks', native.select('auto'), file=sys.stderr); "
                               "sys.exit(main([*sys.argv[4:], 'replay', '--json', sys.argv[3]]))",
                               path, os.pathsep, str(events), *flags], capture_output=True, text=True, cwd=tmp_path)

    fallback, installed = replay(True), replay(False)
    assert fallback.returncode == 0 and installed.returncode == 0, fallback.stderr + installed.stderr
    assert fallback.stderr.startswith("auto picks python") and installed.stderr.startswith("auto picks compiled")
    assert fallback.stdout == installed.stdout and '"result": "ok"' in fallback.stdout
    refused = replay(True, "--implementation", "compiled")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert refused.stderr.splitlines()[1].startswith("settle replay: the compiled implementation was asked for")
