"""A GGUF file whose head count does not divide its width is refused in one line that says what smallem needs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import Family
from test_gguf_load import need, refused, run, write


@pytest.mark.parametrize("heads", [7, 5])
def test_head_count_that_does_not_divide_the_width(
    family: Family, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, heads: int
) -> None:
    gguf = need()

    def lying(self: Any, n: int) -> None:  # the file says `heads`; its tensors are the tiny target's (dim 32)
        self.add_uint32(f"{self.arch}.attention.head_count", heads)

    monkeypatch.setattr(gguf.GGUFWriter, "add_head_count", lying)
    path = tmp_path / "heads.gguf"
    write(path, family)
    res = run("generate", "hi", "--target", str(path))
    refused(res, f"embedding_length 32 is not divisible by llama.attention.head_count {heads}", "key_length")
    assert "?" not in res.stderr


def test_rope_width_that_disagrees_names_the_width_needed(
    family: Family, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = need()
    key = "llama.rope.dimension_count"
    monkeypatch.setattr(gguf.GGUFWriter, "add_rope_dimension_count", lambda self, n: self.add_uint32(key, 6))
    path = tmp_path / "rope.gguf"
    write(path, family)
    res = run("generate", "hi", "--target", str(path))
    refused(res, "rope.dimension_count=6", "needs the head width 8")
