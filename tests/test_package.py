"""Architecture guards: the solver stays torch-free and `import autopar` stays cheap."""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
TORCH_FREE = [ROOT / "autopar" / "solver", ROOT / "autopar" / "layout"]


def _imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_solver_and_core_vocabulary_do_not_import_torch():
    files = []
    for root in TORCH_FREE:
        files += sorted(root.rglob("*.py")) if root.is_dir() else [root]
    assert files
    offenders = [str(f.relative_to(ROOT)) for f in files if "torch" in _imports(f)]
    assert offenders == [], f"these must stay torch-free (plain data): {offenders}"


def test_import_autopar_does_not_import_torch():
    code = "import sys, autopar; autopar.MeshSpec; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
