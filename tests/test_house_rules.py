"""Rules about the code itself: the public names at the top level of gdn_jax, enforced
annotations, no private imports across modules, no import circle, small modules and
functions, and a README of a reader's length."""

import ast
import tomllib
from pathlib import Path

import jax.numpy as jnp
import jaxtyping
import pytest

import gdn_jax
from gdn_jax import GatedDeltaNet, LanguageModel
from gdn_jax.ops.chunked.scalar import chunked_rule
from gdn_jax.ops.recurrent import recurrent_rule
from gdn_jax.ops.step import delta_step

PACKAGE = Path(gdn_jax.__file__).parent
REPO = PACKAGE.parent


def test_top_level_exports():
    assert gdn_jax.GatedDeltaNet is GatedDeltaNet and gdn_jax.LanguageModel is LanguageModel


def test_core_shape_annotations_are_checked_in_the_test_session():
    """conftest.py runs jaxtyping's import hook over gdn_jax: a core called against its
    annotations fails at once rather than computing something."""
    q, v = jnp.zeros((8, 4)), jnp.zeros((8, 3))
    gates, states = (jnp.zeros(8), jnp.zeros(8)), jnp.zeros((1, 3, 4))
    k_too_wide = jnp.zeros((8, 5))
    with pytest.raises(jaxtyping.TypeCheckError, match="k"):
        chunked_rule(q, k_too_wide, v, gates, states, chunk_size=16)
    with pytest.raises(jaxtyping.TypeCheckError, match="initial_states"):
        recurrent_rule(q, q, v, gates, jnp.zeros((1, 4, 3)), step=delta_step)
    wrong_offsets = jnp.asarray([0, 8], jnp.int32)  # N+1 = 2 offsets, but N = 2 states
    with pytest.raises(jaxtyping.TypeCheckError, match="cu_seqlens"):
        chunked_rule(q, q, v, gates, jnp.zeros((2, 3, 4)), chunk_size=16, cu_seqlens=wrong_offsets)


def private_uses(source: str) -> list[str]:
    """Private names (one leading underscore) that ``source`` takes from gdn_jax modules:
    ``from gdn_jax.x import _y`` or ``x._y`` on a name imported from gdn_jax."""
    tree = ast.parse(source)
    imported, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gdn_jax"):
            for alias in node.names:
                imported.add(alias.asname or alias.name)
                if alias.name.startswith("_"):
                    found.append(f"{node.module}.{alias.name}")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in imported
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            found.append(f"{node.value.id}.{node.attr}")
    return found


def test_the_private_import_check_can_fail():
    source = "from gdn_jax.ops import api\nfrom gdn_jax.ops.api import _batched\napi._batched\n"
    assert private_uses(source) == ["gdn_jax.ops.api._batched", "api._batched"]


def test_no_module_imports_a_private_name_from_another():
    offenders = {
        str(path.relative_to(PACKAGE)): found
        for path in sorted(PACKAGE.rglob("*.py"))
        if (found := private_uses(path.read_text()))
    }
    assert not offenders, offenders


def imports_of(path: Path, root: Path) -> set[str]:
    """The modules under ``root`` (a package, and the modules beside it) that the module at
    ``path`` imports, at any depth of its code: an import inside a function closes a circle
    as surely as one at the top, it only hides it. ``from a import b`` counts as an import of
    ``a.b`` where that is a module, else of ``a``; a package's ``__init__`` is the package."""

    def module(name: str) -> str | None:
        parts = name.split(".")
        if (root.joinpath(*parts).with_suffix(".py")).is_file():
            return name
        return name if (root.joinpath(*parts) / "__init__.py").is_file() else None

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {module(alias.name) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {
                module(f"{node.module}.{alias.name}") or module(node.module) for alias in node.names
            }
    return found - {None}


def circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``graph`` (module -> the modules it imports) as the modules around it,
    the first repeated at the end; None where there is none."""
    done, path = set(), []

    def visit(node):
        if node in path:
            return path[path.index(node) :] + [node]
        if node in done:
            return None
        path.append(node)
        for child in sorted(graph.get(node, ())):
            if found := visit(child):
                return found
        path.pop()
        done.add(node)
        return None

    for node in sorted(graph):
        if found := visit(node):
            return found
    return None


def import_graph(root: Path, package: str, modules: list[str]) -> dict[str, set[str]]:
    """The import graph of ``package`` under ``root`` and of the top-level ``modules`` beside
    it (a script the package imports would close a circle through it)."""
    paths = {
        ".".join(p.relative_to(root).with_suffix("").parts): p
        for p in sorted((root / package).rglob("*.py"))
    }
    paths = {name.removesuffix(".__init__"): path for name, path in paths.items()}
    paths |= {name: root / f"{name}.py" for name in modules}
    return {name: imports_of(path, root) & set(paths) for name, path in paths.items()}


def test_the_circle_check_can_fail(tmp_path):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    for name, source in {
        "pkg/__init__.py": "from pkg.sub.a import f\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/a.py": "def f():\n    from pkg.sub import b\n",
        "pkg/sub/b.py": "import script\n",
        "script.py": "from pkg.sub.a import f\n",
    }.items():
        (tmp_path / name).write_text(source)
    graph = import_graph(tmp_path, "pkg", ["script"])
    assert graph["pkg"] == {"pkg.sub.a"} and graph["pkg.sub"] == set()
    assert circle(graph) == ["pkg.sub.a", "pkg.sub.b", "script", "pkg.sub.a"]
    (tmp_path / "pkg/sub/b.py").write_text("")
    assert circle(import_graph(tmp_path, "pkg", ["script"])) is None


def test_no_import_circle():
    """No module of gdn_jax imports, at any depth, a module that imports it back: through a
    script outside the package (``gdn_train``) either. A circle works only by the order of
    its imports, and a local import that hides one is a layer out of place."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    scripts = project["tool"]["setuptools"]["py-modules"]
    assert circle(import_graph(REPO, "gdn_jax", scripts)) is None


def test_no_gate_kinds_kernels_import_the_others():
    """The Mosaic GPU kernels of one gate kind (``ops/mosaic/scalar/``, ``ops/mosaic/channel/``)
    share only the common rooms (limits, tiles, layout, the state pass), never each other's."""
    graph = import_graph(REPO, "gdn_jax", [])
    kinds = ("gdn_jax.ops.mosaic.scalar", "gdn_jax.ops.mosaic.channel")
    for kind in kinds:
        (other,) = (k for k in kinds if k != kind)
        crossing = {
            (module, target)
            for module, targets in graph.items()
            if module.startswith(kind)
            for target in targets
            if target.startswith(other)
        }
        assert not crossing, crossing
    assert any(m.startswith(kinds[0]) for m in graph) and any(m.startswith(kinds[1]) for m in graph)


MAX_MODULE_LINES, MAX_FUNCTION_LINES = 450, 80


def oversized(path: Path) -> list[str]:
    """The module ``path`` if it is over ``MAX_MODULE_LINES`` lines, and its functions over
    ``MAX_FUNCTION_LINES`` (docstring included)."""
    source = path.read_text()
    found = []
    if len(source.splitlines()) > MAX_MODULE_LINES:
        found.append(f"the module: {len(source.splitlines())} lines")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                found.append(f"{node.name}: {lines} lines")
    return found


def test_the_size_check_can_fail(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "big.py").write_text(f"def f():\n{body}\n")
    assert oversized(tmp_path / "big.py") == [f"f: {MAX_FUNCTION_LINES + 1} lines"]


def test_modules_and_functions_are_small():
    """Small files whose names say what they hold: no module of gdn_jax over 450 lines, no
    function over 80 (files split by idea, not to fit a count)."""
    offenders = {
        str(path.relative_to(PACKAGE)): found
        for path in sorted(PACKAGE.rglob("*.py"))
        if (found := oversized(path))
    }
    assert not offenders, offenders


MAX_README_LINES = 200


def test_the_readme_is_a_front_door():
    """The README is for users: what it is, how to install, a tour, the results. It grew to
    227 lines as history and details moved in; history goes to docs/benchmarks/history.jsonl
    and details to docs/."""
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md: {lines} lines, at most {MAX_README_LINES}"


def test_test_modules_have_names_of_their_own():
    """The test folders are not packages, so pytest imports each test module by its file
    name: two of one name, in two folders, stop the whole collection."""
    names = {}
    for path in sorted(Path(__file__).parent.rglob("test_*.py")):
        names.setdefault(path.name, []).append(str(path.relative_to(Path(__file__).parent)))
    shared = {name: paths for name, paths in names.items() if len(paths) > 1}
    assert not shared, f"test modules of one name: {shared}"
