"""Strip what changes on every run from the chapters' stored notebooks: execution timestamps and stale widget
state. Outputs stay (readers see them on GitHub). Run by `make chapters` after executing the notebooks."""

import json
import sys
from pathlib import Path


def clean(path: Path) -> None:
    notebook = json.loads(path.read_text())
    notebook["metadata"].pop("widgets", None)
    for cell in notebook["cells"]:
        cell.get("metadata", {}).pop("execution", None)
    path.write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    for name in sys.argv[1:] or sorted(str(p) for p in Path("chapters").glob("*.ipynb")):
        clean(Path(name))
