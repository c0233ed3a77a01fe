"""The README's Python snippets run as written, so they cannot drift from the API.

Every ```python block right after a `<!-- runs in tests/test_readme.py ... -->` line is extracted and executed in a
fresh namespace, with `/ckpt/` pointing at checkpoints of the toy preset cut to one KDA and one MLA layer (every
code path of the snippets at a third of the compile time): `Ling-3.0-flash`, an HF directory in the official layout
(MTP layer included), and `ling-orbax`, its `ling-jax convert` output. The snippets that build a
mesh take the 4 CPU devices tests/conftest.py sets up. On the CPU the Pallas kernels run in interpret mode, minutes
for these snippets, so `backend="fast"` runs as "reference" here (the kernels have their own tests).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
SNIPPET = re.compile(r"^<!-- runs in tests/test_readme\.py[^\n]*-->\n```python\n(.*?)^```", re.M | re.S)


def snippets() -> dict[str, str]:
    """{the heading of the section it sits in: its code}, in README order."""
    text = README.read_text()
    out = {}
    for match in SNIPPET.finditer(text):
        heading = re.findall(r"^## (.+)$", text[:match.start()], re.M)[-1]
        out[heading] = match.group(1)
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from conversion.orbax_io import convert
    from conversion.synthetic import write_synthetic
    from tests.test_cli import two_layer_toy

    root = tmp_path_factory.mktemp("ckpt")
    write_synthetic(root / "Ling-3.0-flash", two_layer_toy(), seed=0, progress=False)
    convert(root / "Ling-3.0-flash", root / "ling-orbax", progress=False)
    return root


def test_the_readme_marks_its_python_snippets():
    """Every ```python block of the README is marked, so none escapes this test."""
    assert README.read_text().count("```python") == len(snippets()) >= 4


@pytest.mark.parametrize("section", list(snippets()))
def test_readme_snippet_runs(section, ckpt, capsys):
    code = snippets()[section].replace("/ckpt/", f"{ckpt}/").replace('backend="fast"', 'backend="reference"')
    exec(compile(code, f"README.md, {section}", "exec"), {"__name__": "__readme__"})
