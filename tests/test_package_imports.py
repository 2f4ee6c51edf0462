"""The package's lazy public API: ``import tokenbridge`` and ``tokenbridge --help`` stay light,
and every public name still resolves."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest

import tokenbridge
from outputs_support import SRC

#: What a light start must not load: each costs tens of milliseconds, and multiprocessing
#: only belongs to reconstruct's worker pool.
HEAVY = ("jinja2", "multiprocessing", "pyarrow", "aiohttp", "orjson", "numpy")


def _modules_after(code: str) -> set[str]:
    """Every module loaded in a fresh interpreter after running ``code``."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": SRC})
    assert res.returncode == 0, res.stderr
    return set(json.loads(res.stdout.splitlines()[-1]))


def _loaded_after(code: str) -> list[str]:
    """The HEAVY top-level modules loaded after running ``code``."""
    return sorted({m.partition(".")[0] for m in _modules_after(code)} & set(HEAVY))


def test_import_tokenbridge_loads_no_heavy_module() -> None:
    assert _loaded_after("import tokenbridge") == []


def test_help_loads_neither_heavy_modules_nor_rich() -> None:
    code = ("import sys, contextlib, io\nsys.argv = ['tokenbridge', '--help']\nfrom tokenbridge.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n    main()\n"
            "assert 'rich' not in sys.modules, 'rich loaded'")
    assert _loaded_after(code) == []


def test_a_public_name_loads_its_own_module_not_the_others() -> None:
    loaded = _modules_after("from tokenbridge import Tokenizer")
    assert "tokenbridge.tokenizer" in loaded and "tokenbridge.reconstruct" not in loaded
    assert "tokenbridge.reconstruct" in _modules_after("from tokenbridge import reconstruct_file")


@pytest.mark.parametrize("name", sorted(set(tokenbridge.__all__) - {"__version__"}))
def test_every_public_name_resolves_to_its_definition(name: str) -> None:
    value = getattr(tokenbridge, name)
    home = importlib.import_module(f"tokenbridge.{tokenbridge._HOMES[name]}")
    assert value is getattr(home, name)
    assert name in dir(tokenbridge)


def test_homes_and_all_name_the_same_public_api() -> None:
    assert set(tokenbridge._HOMES) | {"__version__"} == set(tokenbridge.__all__)


def test_star_import_and_version() -> None:
    namespace: dict[str, object] = {}
    exec("from tokenbridge import *", namespace)  # noqa: S102 - the statement under test
    assert set(tokenbridge.__all__) <= set(namespace)
    assert isinstance(tokenbridge.__version__, str) and tokenbridge.__version__


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="module 'tokenbridge' has no attribute 'nope'"):
        tokenbridge.nope  # noqa: B018 - the access under test
    with pytest.raises(ImportError):
        exec("from tokenbridge import nope", {})  # noqa: S102


def test_reconstruct_and_inspect_load_neither_the_writers_nor_numpy() -> None:
    """Their flags are checked by the run config's schema, which names the export formats:
    that must not load the writers (numpy, pyarrow and OpenBLAS's threads for a command
    that writes no export)."""
    code = ("import tokenbridge.runconfig, tokenbridge.view, tokenbridge.reconstruct\n"
            "from tokenbridge.export.source import iter_records\nfrom tokenbridge.export.validate import RowContract")
    loaded = _modules_after(code)
    assert not {"numpy", "pyarrow", "tokenbridge.export.writers", "tokenbridge.export.vocab"} & loaded


def test_export_package_names_resolve_lazily_and_formats_match_the_writers() -> None:
    import tokenbridge.export as export
    from tokenbridge.export.formats import FORMATS
    from tokenbridge.export.writers import WRITERS

    assert tuple(WRITERS) == FORMATS == export.FORMATS
    for name in export.__all__:
        value = getattr(export, name)
        assert value is getattr(importlib.import_module(f"tokenbridge.export.{export._HOMES[name]}"), name)
        assert name in dir(export)
    assert set(export._HOMES) == set(export.__all__)
    with pytest.raises(AttributeError, match="module 'tokenbridge.export' has no attribute 'nope'"):
        export.nope  # noqa: B018 - the access under test
