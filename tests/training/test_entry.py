"""How the training command starts: ``train.py`` and ``gdn-train`` enter through
``gdn_train.py``, which takes Ctrl-C over before JAX loads, and a core install (no train
extra) is told what to install.

A Ctrl-C while the command starts must end it with one line and exit status 130: it printed
a ``KeyboardInterrupt`` traceback while JAX loaded, and from about 0.5 s on JAX's
garbage-collection callback could swallow it, after which the run trained to its end. Each
case runs a fresh interpreter, where the interrupt is sent at a known point of the start.
"""

import subprocess
import sys
import textwrap
import tomllib

import pytest
from support.runs import REPO

# Sends SIGINT to this process at a point of the start: when a module is first imported
# (the interrupt arrives inside that import), or inside the first garbage collection after a
# module was imported (where Python cannot propagate it).
INTERRUPT_AT = textwrap.dedent(
    """
    import gc, os, signal, sys

    where, module = sys.argv[1], sys.argv[2]

    class InterruptOnImport:
        def find_spec(self, name, path=None, target=None):
            if name == module:
                sys.meta_path.remove(self)
                os.kill(os.getpid(), signal.SIGINT)
                sum(range(1000))  # the handler runs here
            return None

    def interrupt_in_collection(phase, info):
        if phase == "start" and module in sys.modules:
            gc.callbacks.remove(interrupt_in_collection)
            os.kill(os.getpid(), signal.SIGINT)
            sum(range(1000))  # the handler runs here, inside the collector's callback

    if where == "import":
        sys.meta_path.insert(0, InterruptOnImport())
    else:
        gc.callbacks.append(interrupt_in_collection)
    sys.argv = [sys.argv[3], *sys.argv[4:]]
    """
)


def entry_code(command: str) -> str:
    """What runs the command: ``train.py`` as a script, or ``gdn-train`` as pip's wrapper
    of the ``[project.scripts]`` entry runs it."""
    if command == "train.py":
        return f"import runpy; runpy.run_path({str(REPO / 'train.py')!r}, run_name='__main__')"
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    module, function = scripts[command].split(":")
    return f"from {module} import {function}; sys.exit({function}())"


@pytest.mark.costly(3)
@pytest.mark.parametrize(
    ("command", "where", "module"),
    [
        ("train.py", "import", "jax"),
        ("gdn-train", "import", "jax"),
        ("gdn-train", "import", "jaxlib.mlir"),  # raised in jaxlib's set-up, it aborted
        ("train.py", "collection", "orbax.checkpoint"),  # while the command imports
    ],
)
def test_ctrl_c_while_the_command_starts_is_one_line_and_exit_130(
    tmp_path, subprocess_env, command, where, module
):
    code = INTERRUPT_AT + entry_code(command)
    # A run that would end at once: the interrupt, not the run, ends it.
    args = ["--set", "train.steps=0", "--set", f"train.out_dir={tmp_path / 'run'}"]
    result = subprocess.run(
        [sys.executable, "-c", code, where, module, command, *args],
        cwd=tmp_path,
        env=subprocess_env,
        capture_output=True,
        text=True,
        timeout=120,  # a guard against a hang: it takes about 2 s
    )
    assert result.returncode == 130, result.stderr
    assert result.stderr == f"{command}: interrupted before training began\n", result.stderr
    assert not (tmp_path / "run").exists()


def test_gdn_train_enters_outside_the_package():
    """Pip's wrapper imports the entry's module first: any module of gdn_jax imports JAX with
    the package, before the command could take the signal over."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["project"]["scripts"]["gdn-train"] == "gdn_train:main"
    assert project["tool"]["setuptools"]["py-modules"] == ["gdn_train"]


@pytest.mark.parametrize("missing", ["tqdm", "matplotlib"])
def test_a_core_install_is_told_to_install_the_train_extra(monkeypatch, capsys, missing):
    """A core install lacks tqdm and matplotlib (Flax brings the rest of the extra): the
    command died with a ModuleNotFoundError traceback."""
    from gdn_jax.sweep.cli import main as sweep
    from gdn_jax.training.cli import main

    monkeypatch.setitem(sys.modules, missing, None)  # as if not installed
    monkeypatch.setattr(sys, "argv", ["train.py"])
    for command, prog in ((main, "train.py"), (sweep, "python -m gdn_jax.sweep")):
        assert command(["--set", "train.steps=0"] if command is main else []) == 2
        out, err = capsys.readouterr()
        assert out == "" and err == (
            f"{prog}: error: training needs the train extra, which this install lacks (no "
            f'module {missing}): pip install "gdn_jax[train]"\n'
        )
