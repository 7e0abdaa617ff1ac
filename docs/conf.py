"""Sphinx configuration: the site is built from the repository's own Markdown and the code's docstrings.

`make docs` builds it offline into docs/_build/html with warnings as errors. No extension downloads anything
(no intersphinx); the configuration reference (configs.md) is generated from logra_jax/job/run_config.py's
dataclasses at every build (_ext/config_reference.py).
"""

import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "_ext"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

project = "logra_jax"
author = "the logra_jax authors"
extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "docstring_blocks",
    "config_reference",
    "repo_pages",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "_generated/config_fields.md", "Thumbs.db", ".DS_Store"]
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3
suppress_warnings = ["myst.xref_missing"]

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True  # Attributes: as a field list; autodoc documents the fields themselves

html_theme = "alabaster"
html_title = "logra_jax"
html_theme_options = {"page_width": "1320px", "body_max_width": "none", "sidebar_width": "230px"}
html_static_path = ["_static"]  # custom.css (alabaster links it)
