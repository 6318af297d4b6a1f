"""A griffe extension for the API reference: the docstrings of the public forms as they are
at run time.

``rule.public_form`` writes the Args of q, k, v and the gates into each public form's
docstring when the module is imported (``Rule.args_doc``); the source holds an ``{args}``
line in their place. griffe reads the source, so for the functions decorated with
``public_form`` this extension imports them and takes their docstring from the function
itself, and the reference shows the Args the user gets from ``help()``.
"""

from __future__ import annotations

import inspect
from typing import Any

import griffe


class PublicFormDocstrings(griffe.Extension):
    def on_function(self, *, func: griffe.Function, **kwargs: Any) -> None:
        decorated = any(
            str(decorator.value).startswith("public_form(") for decorator in func.decorators
        )
        if not decorated or func.docstring is None:
            return
        runtime = griffe.dynamic_import(func.path)
        func.docstring.value = inspect.cleandoc(runtime.__doc__)
