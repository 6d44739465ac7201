"""The examples in docstrings run and print what they say."""

import doctest

import pytest
import torch

import twell.format
import twell.nn
import twell.recipe.data
import twell.training.path


@pytest.mark.parametrize("module", [twell.format, twell.nn, twell.training.path, twell.recipe.data], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    torch.manual_seed(0)
    result = doctest.testmod(module, extraglobs={"torch": torch}, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
