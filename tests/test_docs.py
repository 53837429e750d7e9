"""Docs that are generated from code stay in step with it."""

from prefixd.proxy import docgen
from prefixd.proxy.settings import Settings


def test_readme_and_env_example_match_settings():
    assert docgen.README.read_text() == docgen.render_readme(docgen.README.read_text()), \
        "README config reference is stale: python -m prefixd.proxy.docgen --write"
    assert docgen.ENV_EXAMPLE.read_text() == docgen.env_example(), \
        "deploy/prefixd.env.example is stale: python -m prefixd.proxy.docgen --write"
    for name in Settings.model_fields:
        assert f"PREFIXD_{name.upper()}" in docgen.README.read_text()


def test_every_setting_is_described():
    missing = [n for n, f in Settings.model_fields.items() if not f.description]
    assert not missing
