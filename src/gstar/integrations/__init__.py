"""Optional integrations with other libraries; each submodule imports its library, so import them explicitly.

``gstar.integrations.transformers``: the ``"gstar"`` attention implementation for Hugging Face transformers.
"""
