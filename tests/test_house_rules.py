"""Rules about the code itself: the public names at the top level of gdn_jax, enforced
annotations, no private imports across modules, and small modules and functions."""

import ast
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


def test_test_modules_have_names_of_their_own():
    """The test folders are not packages, so pytest imports each test module by its file
    name: two of one name, in two folders, stop the whole collection."""
    names = {}
    for path in sorted(Path(__file__).parent.rglob("test_*.py")):
        names.setdefault(path.name, []).append(str(path.relative_to(Path(__file__).parent)))
    shared = {name: paths for name, paths in names.items() if len(paths) > 1}
    assert not shared, f"test modules of one name: {shared}"
