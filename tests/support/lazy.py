"""Imports made when first used, for the test modules that need torch and transformers.

Every pytest worker imports every test module to collect it, and most run none of a given
module's tests: torch and transformers' model modules would cost ~6 s of imports in each.
"""

import importlib


class Lazy:
    """A module, or one of its attributes, imported when first used."""

    def __init__(self, module, attribute=None):
        self._module, self._attribute = module, attribute

    def _target(self):
        module = importlib.import_module(self._module)
        return module if self._attribute is None else getattr(module, self._attribute)

    def __getattr__(self, name):
        # pytest looks for its markers (private names) on everything a test module holds.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._target(), name)

    def __call__(self, *args, **kwargs):
        return self._target()(*args, **kwargs)
