"""The package split: `pagedkv.kv` is torch-free bookkeeping, `pagedkv.kvstore` the tensors and
files, and imports go one way (kvstore -> kv)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pagedkv.kv


def imported_after(statement: str) -> dict[str, bool]:
    """Run `statement` in a fresh interpreter; which of torch and pagedkv.kvstore it loaded."""
    code = (
        f"{statement}\nimport json, sys\n"
        "print(json.dumps({m: m in sys.modules for m in ('torch', 'pagedkv.kvstore')}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_the_bookkeeping_imports_no_torch():
    loaded = imported_after(
        "import pagedkv.kv, pagedkv.kv.manager, pagedkv.kv.prefix, pagedkv.kv.swap, "
        "pagedkv.kv.report, pagedkv.kv.policy"
    )
    assert loaded == {"torch": False, "pagedkv.kvstore": False}


def test_no_kv_module_imports_the_tensor_side():
    """Imports go one way: kvstore -> kv, never back (so no cycle), and kv never names torch."""
    kv = Path(pagedkv.kv.__file__).parent
    for path in kv.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                assert not name.startswith(("torch", "pagedkv.kvstore")), f"{path.name}: {name}"
